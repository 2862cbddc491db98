"""`autotune report RUN_DIR`: what a run did and why, from its journal and memory samples.

Works on a finished run, one still in progress, and one that crashed (a truncated last
journal line is tolerated and reported). Everything comes from `events.jsonl` (and
`samples.jsonl` when the monitor ran): nothing is recomputed from the model.

Owns: reading a run back into figures and words. Touches nothing of a run (read-only).
"""

from __future__ import annotations

import collections
import sys
from pathlib import Path
from typing import Any

from autotune.common.notices import warn
from autotune.common.units import describe_breakdown, format_bytes
from autotune.observe.journal import NotAFile, each_line
from autotune.observe.records import KINDS, Kind, RecordsByKind


class NotARun(ValueError):
    """The folder has no journal: it is not a run directory."""


def _journal_path(run_dir: Path) -> Path:
    """The run's journal; NotARun with the reason when `run_dir` is not a run."""
    if not run_dir.is_dir():
        raise NotARun(f"{run_dir} is not a folder")
    journal_path = run_dir / "events.jsonl"
    if not journal_path.exists():
        raise NotARun(f"{run_dir} is not a run directory: it has no events.jsonl")
    return journal_path


def _side_file(path: Path) -> Any:
    # The monitor's timeline or the steps log, line by line: one that is not a regular file (a FIFO,
    # a link to a device) is left out with a word; the journal's summary still stands.
    try:
        yield from each_line(path)
    except NotAFile as exc:
        warn(f"{exc}; the report goes on without it", key=f"not a file {path}")


# What the report reads of each kind of record, with the types records.py's registry declares: a record
# whose field is of another type, or missing where marked needed, is counted among the unreadable lines
# (a hand-edited line, another tool's, a damaged one) and never reaches the code below, where it was a
# traceback. "name?": may be missing (a journal older than the field: the report has a default for it).
_READS = {
    Kind.FIT_START: "batch_size? micro_batch_size? world? memory_cap?", Kind.FIT_FAILED: "error?",
    Kind.FIT_END: "samples_seen? batch_size? micro_batch_size?", Kind.STOP_REQUESTED: "reason?",
    Kind.EPOCH_END: "samples_seen? loss? micro_batch_size?", Kind.ACTION: "policy action params applied reason? note?",
    Kind.OOM: "micro_batch_size lost_seconds? breakdown? memory_snapshot?", Kind.LOADER_REBUILT: "num_workers?",
    Kind.RELIEF: "relief demand_before? parameters_removed_in_all?", Kind.SAMPLE_CACHE: "hit_rate? bytes? entries?",
    Kind.CHECKPOINT: "reason? path? background?", Kind.CHECKPOINT_FAILED: "reason? error?",
    Kind.CHECKPOINT_REFUSED: "reason? nonfinite?", Kind.NONFINITE: "at_step? error? action?",
    Kind.EVALUATE: "metrics? micro_batch_size? ooms?", Kind.DATA_STALLED: "seconds batch indices",
    Kind.WORLD_CHANGED: "to_world from_world batch_size_to",
}
# The registry's type names as the exact types json.loads gives (a float field may hold a whole number;
# a bool is not an int here).
_JSON_TYPES = {"int": (int,), "float": (float, int), "str": (str,), "bool": (bool,), "dict": (dict,),
               "list": (list,), "None": (type(None),)}
_NUMBER = frozenset((int, float))
_MISSING = object()


def _checks(kind: str, reads: str) -> tuple[tuple[str, frozenset[type], bool], ...]:
    # (field, its types, needed): a field the registry does not declare is a KeyError at import.
    declared = KINDS[kind].fields
    return tuple((name.rstrip("?"), frozenset(t for part in declared[name.rstrip("?")].split("|")
                                              for t in _JSON_TYPES[part]), not name.endswith("?"))
                 for name in reads.split())


_CHECKS = {kind: _checks(kind, reads) for kind, reads in _READS.items()}
_BREAKDOWN_FIGURES = ("weights", "gradients", "optimizer_state", "activations_and_temporaries", "libraries", "other",
                      "cap", "allocator_cache", "outside_torch")


def _oom_parts(record: dict[str, Any]) -> bool:
    # What the text reads inside an OOM's breakdown and allocator snapshot (units.describe_breakdown, render).
    breakdown, snapshot = record.get("breakdown"), record.get("memory_snapshot")
    if breakdown is not None and not (
            type(breakdown.get("held")) in _NUMBER and isinstance(breakdown.get("measure"), str)
            and all(breakdown.get(name) is None or type(breakdown[name]) in _NUMBER for name in _BREAKDOWN_FIGURES)):
        return False
    if snapshot is None:
        return True
    sites, refused = snapshot.get("largest_sites"), snapshot.get("refused")
    return (isinstance(snapshot.get("path"), str) and isinstance(sites, list)
            and all(_site(site) for site in sites) and (refused is None or _site(refused)))


def _site(site: Any) -> bool:
    return isinstance(site, dict) and type(site.get("bytes")) in _NUMBER and isinstance(site.get("site"), str)


def _readable(record: dict[str, Any]) -> bool:
    # Runs once per journal line (a million in a long run's journal): exact type lookups, no calls per field.
    get = record.get
    kind = get("kind")
    if not (type(kind) is str and type(get("time")) in _NUMBER and type(get("step")) is int
            and type(get("epoch")) is int):
        return False
    for name, types, needed in _CHECKS.get(kind, ()):
        value = get(name, _MISSING)
        if (needed if value is _MISSING else type(value) not in types):
            return False
    return kind != Kind.OOM or _oom_parts(record)


def _has(record: dict[str, Any], fields: dict[str, Any]) -> bool:
    return all(name in record and isinstance(record[name], kind) for name, kind in fields.items())


def throughput_over_time(steps: list[dict[str, Any]], windows: int = 8) -> list[dict[str, Any]]:
    """Samples per second in up to `windows` equal stretches of the run, from the cumulative
    `samples_seen` of steps.jsonl (thinned lines are fine: only differences are used). A
    stretch in which samples_seen ends lower than it began (a resume from an earlier
    checkpoint) is left out."""
    points = [(s["time"], s["samples_seen"]) for s in steps if isinstance(s.get("samples_seen"), (int, float))]
    if len(points) < 2:
        return []
    t0, t1 = points[0][0], points[-1][0]
    width = (t1 - t0) / windows
    if width <= 0:
        return []
    result = []
    for i in range(windows):
        start, end = t0 + i * width, t0 + (i + 1) * width
        inside = [p for p in points if start <= p[0] <= end]
        if len(inside) < 2 or inside[-1][1] < inside[0][1]:
            continue
        seconds = inside[-1][0] - inside[0][0]
        if seconds > 0:
            result.append({"from_seconds": round(start - t0, 1), "to_seconds": round(end - t0, 1),
                           "samples_per_second": (inside[-1][1] - inside[0][1]) / seconds})
    return result


def _on_disk(path: str | None, run_dir: Path) -> str | None:
    # Where the checkpoint is now: the run folder's own copy first (the folder may have been copied or
    # moved since, and the recorded path is then another run's or nowhere), else the recorded path (a
    # relative one is the training's working directory's); None where it is gone.
    if not path:
        return None
    own = run_dir / "checkpoints" / Path(path).name
    if _exists(own):
        return str(own)
    return path if _exists(Path(path)) else None


def _exists(path: Path) -> bool:
    # Path.exists raises on a name too long or a folder that may not be searched: not there, for the report.
    try:
        return path.exists()
    except (OSError, ValueError):
        return False


# The newest records of a kind that a summary lists whole (their counts are always complete): a long
# run's journal holds hundreds of thousands of actions, and the report reads it in bounded memory.
KEEP = 100


class _Tally:
    """The journal read once, a record at a time, keeping only what the summary shows: the count,
    first, last and newest KEEP records of each kind, and the running figures (OOM sizes and time
    lost, each policy's actions, the epochs' throughput, the number of ranks over the run)."""

    def __init__(self) -> None:
        self.count: collections.Counter[str] = collections.Counter()
        self.first: dict[str, dict[str, Any]] = {}
        self.last: dict[str, dict[str, Any]] = {}
        self._newest = RecordsByKind(keep=KEEP)
        self.unreadable = 0
        self.first_time: float | None = None
        self.last_time: float | None = None  # a background checkpoint's line comes after the training it saved
        self.last_step = 0
        self.since_start: set[str] = set()  # the kinds written since the last fit_start
        self.actions: dict[str, collections.deque[dict[str, Any]]] = {}
        self.applied: collections.Counter[str] = collections.Counter()
        self.suppressed: collections.Counter[str] = collections.Counter()
        self.oom_sizes: collections.Counter[int] = collections.Counter()
        self.oom_seconds: float | None = 0.0  # None once an OOM has no lost_seconds (journals before they were timed)
        self.last_breakdown: dict[str, Any] | None = None
        self.last_snapshot: dict[str, Any] | None = None
        self._retries_open: collections.Counter[tuple[int, int]] = collections.Counter()
        self.retries_failed_again = 0  # CUDA's same-size retries whose batch ran out of memory again
        self.epochs: collections.deque[dict[str, Any]] = collections.deque(maxlen=KEEP)
        self._epoch_from: tuple[float, int] = (0.0, 0)  # (time, samples_seen) where the next epoch's count starts
        self.world: list[dict[str, Any]] = []
        self.pruned_in_all = 0.0

    def newest(self, kind: str) -> list[dict[str, Any]]:
        """The newest KEEP records of `kind` (a kind not in the registry: KeyError, not an empty list)."""
        return list(self._newest[kind])

    def add(self, record: dict[str, Any]) -> None:
        kind, time, step, epoch = record["kind"], record["time"], record["step"], record["epoch"]
        self.count[kind] += 1
        self.first.setdefault(kind, record)
        self.last[kind] = record
        self._newest.add(record)
        if self.first_time is None:
            self.first_time, self._epoch_from = time, (time, 0)
        if not (kind == Kind.CHECKPOINT and record.get("background")):
            self.last_time = time
        self.last_step = step
        if kind == Kind.FIT_START:
            self.since_start = set()
        self.since_start.add(kind)
        if kind == Kind.ACTION:
            policy = record["policy"]
            (self.applied if record["applied"] else self.suppressed)[policy] += 1
            actions = self.actions.get(policy)
            if actions is None:
                actions = self.actions[policy] = collections.deque(maxlen=KEEP)
            actions.append(record)
        elif kind == Kind.OOM:
            self.oom_sizes[record["micro_batch_size"]] += 1
            lost = record.get("lost_seconds")
            self.oom_seconds = self.oom_seconds + lost if self.oom_seconds is not None and \
                isinstance(lost, (int, float)) else None
            self.last_breakdown = record.get("breakdown") or self.last_breakdown
            self.last_snapshot = record.get("memory_snapshot") or self.last_snapshot
            self.retries_failed_again += self._retries_open.pop((step, epoch), 0)
        elif kind == Kind.OOM_RETRY:
            self._retries_open[(step, epoch)] += 1
        elif kind == Kind.EPOCH_END:
            since, seen_before = self._epoch_from
            seen = record.get("samples_seen") or 0
            seconds = time - since
            self.epochs.append({"epoch": epoch, "seconds": seconds, "samples": seen - seen_before,
                                "samples_per_second": (seen - seen_before) / seconds if seconds else None,
                                "loss": record.get("loss")})
            self._epoch_from = (time, seen)
        elif kind == Kind.RELIEF and record["relief"] == "pruning":
            self.pruned_in_all = record.get("parameters_removed_in_all") or 0.0
        if kind == Kind.WORLD_CHANGED:  # the job's number of ranks: where a resume changed it,
            self.world.append({"step": step, "ranks": record["to_world"], "batch_size": record["batch_size_to"],
                               "from_ranks": record["from_world"]})
        elif kind == Kind.FIT_START and record.get("world") is not None and (  # and at each fit's start (issue 33)
                not self.world or self.world[-1]["ranks"] != record["world"]):
            self.world.append({"step": step, "ranks": record["world"], "batch_size": record.get("batch_size")})


def _tally(run_dir: Path) -> _Tally:
    tally = _Tally()
    for _, record in each_line(_journal_path(run_dir)):
        if isinstance(record, dict) and _readable(record):
            tally.add(record)
        else:  # not UTF-8 or not a JSON object, or a record without what the report reads
            tally.unreadable += 1
    return tally


def _memory(path: Path) -> dict[str, Any]:
    # The monitor's samples, streamed: the peak, the last cap and its source.
    peak, cap, source, count = None, None, None, 0
    for _, sample in _side_file(path):
        if not (isinstance(sample, dict) and _has(sample, {"time": (int, float)})):
            continue
        count += 1
        used = sample.get("used_bytes")
        if isinstance(used, (int, float)) and (peak is None or used > peak):
            peak = used
        cap, source = sample.get("cap_bytes") or cap, sample.get("source")
    return {"peak_used_bytes": peak, "cap_bytes": cap, "samples": count, "source": source}


def _steps(path: Path) -> list[dict[str, Any]]:
    # steps.jsonl, only what the throughput reads (its lines are thinned as the run grows).
    return [{"time": s["time"], "samples_seen": s.get("samples_seen")} for _, s in _side_file(path)
            if isinstance(s, dict) and _has(s, {"time": (int, float)})]


def summarize(run_dir: str | Path) -> dict[str, Any]:
    """The summary of a run as plain data (what `--json` prints). Its lists hold the newest KEEP
    records of their kind; `counts` has how many there were in all."""
    # A checkpoint this process is still writing: its journal line comes when it is on disk. (Asked
    # without importing torch: if nothing imported the checkpoint module, nothing is being written.)
    checkpoint = sys.modules.get("autotune.run_folder.checkpoint_files")
    if checkpoint is not None:
        checkpoint.wait_for_writes()
    run_dir = Path(run_dir)
    tally = _tally(run_dir)
    count, last, since_start = tally.count, tally.last, tally.since_start
    memory = _memory(run_dir / "samples.jsonl")

    if Kind.FIT_FAILED in since_start:
        status = f"failed: {last[Kind.FIT_FAILED].get('error', '')}"
    elif Kind.FIT_END in since_start:
        status = "finished"
    elif Kind.PREEMPTED in since_start:
        status = "stopped by a signal (resume with fit(..., resume=True))"
    else:
        status = "in progress, or killed without a trace"
    last_fit, last_epoch = last.get(Kind.FIT_END, {}), last.get(Kind.EPOCH_END, {})
    start = tally.first.get(Kind.FIT_START, {})
    return {
        "run_dir": str(run_dir),
        "status": status,
        "journal_lines_unreadable": tally.unreadable,
        "wall_seconds": (tally.last_time - tally.first_time) if tally.first_time is not None else None,
        "samples_seen": last_fit.get("samples_seen", last_epoch.get("samples_seen")),
        "steps": tally.last_step,
        "epochs_completed": count[Kind.EPOCH_END],
        "epochs": list(tally.epochs),
        "throughput_over_time": throughput_over_time(_steps(run_dir / "steps.jsonl")),
        "batch_size": last_fit.get("batch_size", start.get("batch_size")),
        "micro_batch_size": {"start": start.get("micro_batch_size"),
                             "end": last_fit.get("micro_batch_size", last_epoch.get("micro_batch_size"))},
        "ooms": {"survived": count[Kind.OOM],
                 # None for journals written before OOMs were timed
                 "seconds_lost": round(tally.oom_seconds, 3) if tally.oom_seconds is not None else None,
                 "by_micro_batch": {str(k): v for k, v in tally.oom_sizes.items()},
                 "gave_up": count[Kind.OUT_OF_MEMORY],
                 # CUDA: a batch's first OOM retried once at the same size (oom_retry); it fit unless the
                 # same batch failed again
                 "same_size_retries": count[Kind.OOM_RETRY],
                 "same_size_fit": count[Kind.OOM_RETRY] - tally.retries_failed_again,
                 # where the memory went at the last OOM that measured it (journals since issue 16)
                 "last_breakdown": tally.last_breakdown,
                 # memory_snapshot=True (CUDA): the allocator's state at the last OOM, and its largest sites
                 "last_snapshot": tally.last_snapshot},
        "actions": {policy: [{"step": a["step"], "action": a["action"], "params": a["params"], "applied": a["applied"],
                              "reason": a.get("reason", ""), "note": a.get("note", "")} for a in actions]
                    for policy, actions in tally.actions.items()},
        "action_counts": {policy: {"applied": tally.applied[policy], "suppressed": tally.suppressed[policy]}
                          for policy in tally.actions},
        "reliefs": [{"step": r["step"], "relief": r["relief"], "demand_before": r.get("demand_before")}
                    for r in tally.newest(Kind.RELIEF)],
        "parameters_removed_by_pruning": tally.pruned_in_all,
        "sample_cache": [{"epoch": c["epoch"], "hit_rate": c.get("hit_rate"), "bytes": c.get("bytes"),
                          "entries": c.get("entries")} for c in tally.newest(Kind.SAMPLE_CACHE)],
        "loader_workers": [r.get("num_workers") for r in tally.newest(Kind.LOADER_REBUILT)],
        # `on_disk`: the file is there now (older ones are pruned, and a copied run may lack them).
        # `file`: where it is now (None: gone); `path`: where it was written.
        "checkpoints": [{"step": c["step"], "reason": c.get("reason"), "path": c.get("path"),
                         "on_disk": file is not None, "file": file}
                        for c in tally.newest(Kind.CHECKPOINT) for file in [_on_disk(c.get("path"), run_dir)]],
        "checkpoints_failed": [{"step": c["step"], "reason": c.get("reason"), "error": c.get("error")}
                               for c in tally.newest(Kind.CHECKPOINT_FAILED)],
        "checkpoints_refused": [{"step": c["step"], "reason": c.get("reason"), "nonfinite": c.get("nonfinite")}
                                for c in tally.newest(Kind.CHECKPOINT_REFUSED)],
        "nonfinite_steps": [{"step": r.get("at_step"), "error": r.get("error"), "action": r.get("action")}
                            for r in tally.newest(Kind.NONFINITE)],
        "evaluations": [{"step": e["step"], "metrics": e.get("metrics", {}), "micro_batch_size": e.get("micro_batch_size"),
                         "ooms": e.get("ooms", 0)} for e in tally.newest(Kind.EVALUATE)],
        "data_stalls": [{"step": r["step"], "epoch": r["epoch"], "seconds": r.get("seconds"), "batch": r.get("batch"),
                         "indices": r.get("indices")} for r in tally.newest(Kind.DATA_STALLED)],
        "counts": {"epochs": count[Kind.EPOCH_END], "checkpoints": count[Kind.CHECKPOINT],
                   "checkpoints_failed": count[Kind.CHECKPOINT_FAILED],
                   "checkpoints_refused": count[Kind.CHECKPOINT_REFUSED], "nonfinite_steps": count[Kind.NONFINITE],
                   "evaluations": count[Kind.EVALUATE], "reliefs": count[Kind.RELIEF],
                   "data_stalls": count[Kind.DATA_STALLED], "kept": KEEP},
        "world": tally.world,
        "stopped_early": last.get(Kind.STOP_REQUESTED, {}).get("reason"),
        "memory": {"cap_bytes": start.get("memory_cap") or memory["cap_bytes"],
                   "peak_used_bytes": memory["peak_used_bytes"], "samples": memory["samples"],
                   "source": memory["source"]},
    }


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.1f}s"
    if seconds < 7200:
        return f"{seconds / 60:.0f}m"
    return f"{seconds / 3600:.1f}h"


def render(summary: dict[str, Any]) -> str:
    """The summary as text for a terminal."""
    def size(value: Any) -> str:
        return format_bytes(value) if isinstance(value, (int, float)) else "n/a"

    lines = [f"run {summary['run_dir']}: {summary['status']}"]
    if summary["journal_lines_unreadable"]:
        lines.append(f"  note: {summary['journal_lines_unreadable']} journal line(s) could not be read and were "
                     "skipped (cut off by a crash, not UTF-8 or not a JSON object, or a record missing a field or "
                     "holding one of the wrong type)")
    wall = summary["wall_seconds"]
    lines.append(f"  time {wall:.1f} s, {summary['steps']} steps, {summary['epochs_completed']} epochs, "
                 f"{summary['samples_seen']} samples" if wall is not None else "  nothing recorded yet")
    micro = summary["micro_batch_size"]
    lines.append(f"  batch {summary['batch_size']}, micro-batch {micro['start']} -> {micro['end']}")
    for epoch in summary["epochs"]:
        rate = f"{epoch['samples_per_second']:.0f} samples/s" if epoch["samples_per_second"] else ""
        loss = f"loss {epoch['loss']:.4f}" if isinstance(epoch["loss"], (int, float)) else ""
        lines.append(f"    epoch {epoch['epoch']}: {epoch['seconds']:.1f} s {loss} {rate}".rstrip())
    if summary["throughput_over_time"]:
        lines.append("  samples/s over time: " + ", ".join(
            f"{_duration(w['from_seconds'])}-{_duration(w['to_seconds'])} {w['samples_per_second']:.0f}"
            for w in summary["throughput_over_time"]))
    ooms = summary["ooms"]
    lines.append(f"  OOMs survived {ooms['survived']}"
                 + (f" (at micro-batch {', '.join(f'{k} x{v}' for k, v in ooms['by_micro_batch'].items())}"
                    + (f"; {ooms['seconds_lost']:.2f} s of work and clean-up lost to them)"
                       if ooms["seconds_lost"] is not None else ")")
                    if ooms["survived"] else "")
                 + (f"; gave up {ooms['gave_up']} time(s)" if ooms["gave_up"] else ""))
    if ooms.get("same_size_retries"):
        lines.append(f"  retried at the same micro-batch first (the cache emptied): {ooms['same_size_retries']}, "
                     f"of which {ooms['same_size_fit']} fit without a smaller one")
    if ooms.get("last_breakdown"):
        lines.append(f"  at the last OOM: {describe_breakdown(ooms['last_breakdown'])}")
    if ooms.get("last_snapshot"):
        snapshot = ooms["last_snapshot"]
        lines.append(f"  allocator snapshot: {snapshot['path']} (open it on https://pytorch.org/memory_viz); "
                     "largest sites:")
        lines += [f"    {format_bytes(s['bytes'])}  {s['site']}" for s in snapshot["largest_sites"]]
        if snapshot.get("refused"):
            lines.append(f"    refused: {format_bytes(snapshot['refused']['bytes'])} at {snapshot['refused']['site']}")
    counts = summary.get("counts", {})
    evaluations = summary.get("evaluations", [])
    if evaluations:
        eval_ooms = sum(e["ooms"] for e in evaluations)
        lines.append(f"  evaluations: {counts.get('evaluations', len(evaluations))}"
                     + (f" ({eval_ooms} OOMs survived in "
                        f"{'them' if counts.get('evaluations', 0) <= len(evaluations) else f'the last {len(evaluations)}'}"
                        ", eval micro-batch "
                        f"{evaluations[-1]['micro_batch_size']})" if eval_ooms else ""))
        for e in evaluations[-5:]:
            lines.append(f"    step {e['step']}: " + ", ".join(f"{k} {v:.4g}" for k, v in e["metrics"].items()
                                                             if isinstance(v, (int, float))))
    world = summary.get("world", [])
    if len(world) > 1 or (world and world[0]["ranks"] > 1):
        lines.append("  ranks: " + " -> ".join(f"{w['ranks']} from step {w['step']} (batch {w['batch_size']} each)"
                                               for w in world))
    if summary.get("stopped_early"):
        lines.append(f"  stopped early: {summary['stopped_early']}")
    if summary["actions"]:
        lines.append("  actions:")
        for policy, actions in summary["actions"].items():
            applied = [a for a in actions if a["applied"]]
            total = summary.get("action_counts", {}).get(policy) or {
                "applied": len(applied), "suppressed": len(actions) - len(applied)}
            lines.append(f"    {policy}: {total['applied']} applied, {total['suppressed']} suppressed")
            if total["applied"] > len(applied):
                lines.append(f"      ... {total['applied'] - len(applied)} earlier; the newest:")
            for a in applied[-8:] if total["applied"] > len(applied) else applied[:8]:
                lines.append(f"      step {a['step']}: {a['action']} {a['params']} - {a['reason']}")
            if total["applied"] <= len(applied) and len(applied) > 8:
                lines.append(f"      ... {len(applied) - 8} more")
    for relief in summary["reliefs"]:
        lines.append(f"  relief at step {relief['step']}: {relief['relief']}")
    if summary["parameters_removed_by_pruning"]:
        lines.append(f"  pruning removed {summary['parameters_removed_by_pruning']:.0%} of the parameters")
    for cache in summary["sample_cache"]:
        rate = cache["hit_rate"]
        lines.append(f"  sample cache, epoch {cache['epoch']}: hit rate "
                     f"{'n/a' if rate is None else f'{rate:.0%}'}, {cache['entries']} samples, {size(cache['bytes'])}")
    if summary["loader_workers"]:
        lines.append(f"  loader workers changed: {' -> '.join(map(str, summary['loader_workers']))}")
    memory = summary["memory"]
    lines.append(f"  memory: peak {size(memory['peak_used_bytes'])} of cap {size(memory['cap_bytes'])}"
                 + (f" ({memory['source']}, {memory['samples']} samples)" if memory["samples"] else " (no samples)"))
    checkpoints, failed, refused = summary["checkpoints"], summary["checkpoints_failed"], summary["checkpoints_refused"]
    if checkpoints or failed or refused:
        on_disk = [c for c in checkpoints if c["on_disk"]]
        newest = (f"newest on disk: step {on_disk[-1]['step']} ({on_disk[-1]['reason']}): "
                  f"{on_disk[-1].get('file', on_disk[-1]['path'])}"
                  if on_disk else "none on disk")
        lines.append(f"  checkpoints: {counts.get('checkpoints', len(checkpoints))} written, {newest}")
        if failed:
            lines.append(f"  checkpoints that failed: {counts.get('checkpoints_failed', len(failed))}, at steps "
                         f"{_steps_of(failed, counts.get('checkpoints_failed'))}; last: {failed[-1]['error']}")
        if refused:
            lines.append(f"  checkpoints refused (weights not finite): {counts.get('checkpoints_refused', len(refused))}"
                         f", at steps {_steps_of(refused, counts.get('checkpoints_refused'))}")
    nonfinite = summary["nonfinite_steps"]
    if nonfinite:
        lines.append(f"  non-finite steps: {counts.get('nonfinite_steps', len(nonfinite))}, at steps "
                     f"{_steps_of(nonfinite, counts.get('nonfinite_steps'))} ({nonfinite[-1]['action']})")
    for stall in summary.get("data_stalls", [])[-3:]:
        lines.append(f"  data stalled at step {stall['step']} (epoch {stall['epoch']}): no batch for {stall['seconds']} s, "
                     f"batch {stall['batch']}, samples {stall['indices'][:8]}")
    return "\n".join(lines)


def _steps_of(records: list[dict[str, Any]], total: int | None) -> str:
    # The steps of a (capped) list, newest last; "..." first where older ones were left out.
    return ("..., " if total is not None and total > len(records) else "") + ", ".join(str(r["step"]) for r in records)
