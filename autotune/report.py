"""`autotune report RUN_DIR`: what a run did and why, from its journal and memory samples.

Works on a finished run, one still in progress, and one that crashed (a truncated last
journal line is tolerated and reported). Everything comes from `events.jsonl` (and
`samples.jsonl` when the monitor ran): nothing is recomputed from the model.

Owns: reading a run back into figures and words. Touches nothing of a run (read-only).
"""

from __future__ import annotations

import collections
import dataclasses
import sys
from pathlib import Path
from typing import Any

from autotune.journal import read_lines
from autotune.records import Kind, RecordsByKind
from autotune.units import describe_breakdown, format_bytes


class NotARun(ValueError):
    """The folder has no journal: it is not a run directory."""


@dataclasses.dataclass
class _Run:
    records: list[dict[str, Any]]  # events.jsonl
    unreadable: int  # its lines that could not be read
    samples: list[dict[str, Any]]  # samples.jsonl (the monitor's)
    steps: list[dict[str, Any]]  # steps.jsonl


def _read_run(run_dir: Path) -> _Run:
    """Every file of a run, read once; NotARun with the reason when it is not one."""
    journal_path = run_dir / "events.jsonl"
    if not run_dir.is_dir():
        raise NotARun(f"{run_dir} is not a folder")
    if not journal_path.exists():
        raise NotARun(f"{run_dir} is not a run directory: it has no events.jsonl")
    records, unreadable = read_lines(journal_path)
    readable = [r for r in records  # a line without what the report reads is counted, not read
                if _has(r, _EVERY_RECORD) and _has(r, _READS.get(r["kind"], {}))]
    return _Run(readable, unreadable + len(records) - len(readable),
                [s for s in read_lines(run_dir / "samples.jsonl")[0] if _has(s, {"time": (int, float)})],
                [s for s in read_lines(run_dir / "steps.jsonl")[0] if _has(s, {"time": (int, float)})])


# What the report reads of every journal record; a record without them (a hand-edited line, another
# tool's) is counted among the unreadable lines.
_EVERY_RECORD = {"kind": str, "time": (int, float), "step": int, "epoch": int}
_READS = {Kind.ACTION: {"policy": str, "action": str, "params": object, "applied": bool},
          Kind.OOM: {"micro_batch_size": int}, Kind.RELIEF: {"relief": str},
          Kind.WORLD_CHANGED: {"to_world": int, "from_world": int, "batch_size_to": int}}


def _has(record: dict[str, Any], fields: dict[str, Any]) -> bool:
    return all(name in record and isinstance(record[name], kind) for name, kind in fields.items())


def _failed_again(retry: dict[str, Any], ooms: list[dict[str, Any]]) -> bool:
    # The retried batch ran out of memory again: an `oom` after the retry, at the same step and epoch.
    return any(o["time"] >= retry["time"] and o["step"] == retry["step"] and o["epoch"] == retry["epoch"]
               for o in ooms)


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


def _on_disk(path: str | None, run_dir: Path) -> bool:
    # A relative path is the training's working directory's; the run folder may have moved since.
    return bool(path) and (Path(path).exists() or (run_dir / "checkpoints" / Path(path).name).exists())


def summarize(run_dir: str | Path) -> dict[str, Any]:
    """The summary of a run as plain data (what `--json` prints)."""
    # A checkpoint this process is still writing: its journal line comes when it is on disk. (Asked
    # without importing torch: if nothing imported the checkpoint module, nothing is being written.)
    checkpoint = sys.modules.get("autotune.checkpoint")
    if checkpoint is not None:
        checkpoint.wait_for_writes()
    run_dir = Path(run_dir)
    run = _read_run(run_dir)
    records, bad_lines, samples, steps = run.records, run.unreadable, run.samples, run.steps
    by_kind = RecordsByKind()  # a kind misspelt here is a KeyError, not an empty list
    for record in records:
        by_kind.add(record)

    first = records[0]["time"] if records else None
    # A background checkpoint's line comes when it is on disk, after the training it saved.
    timed = [r for r in records if not (r.get("kind") == Kind.CHECKPOINT and r.get("background"))]
    last = timed[-1]["time"] if timed else None
    ends, failures = by_kind[Kind.FIT_END], by_kind[Kind.FIT_FAILED]
    started = by_kind[Kind.FIT_START][-1]["time"] if by_kind[Kind.FIT_START] else None

    def since_start(kind: str) -> list[dict[str, Any]]:  # records of `kind` from the last fit() on
        return [r for r in by_kind[kind] if started is None or r["time"] >= started]

    if since_start(Kind.FIT_FAILED):
        status = f"failed: {failures[-1].get('error', '')}"
    elif since_start(Kind.FIT_END):
        status = "finished"
    elif since_start(Kind.PREEMPTED):
        status = "stopped by a signal (resume with fit(..., resume=True))"
    else:
        status = "in progress, or killed without a trace"
    epochs = by_kind[Kind.EPOCH_END]
    last_fit = ends[-1] if ends else {}
    throughput = []
    previous_time, previous_seen = first, 0
    for epoch in epochs:
        seconds = epoch["time"] - previous_time if previous_time is not None else None
        trained = (epoch.get("samples_seen") or 0) - previous_seen
        throughput.append({"epoch": epoch["epoch"], "seconds": seconds, "samples": trained,
                           "samples_per_second": trained / seconds if seconds else None, "loss": epoch.get("loss")})
        previous_time, previous_seen = epoch["time"], epoch.get("samples_seen") or 0
    actions: dict[str, list[dict[str, Any]]] = collections.defaultdict(list)
    for record in by_kind[Kind.ACTION]:
        actions[record["policy"]].append({"step": record["step"], "action": record["action"], "params": record["params"],
                                          "applied": record["applied"], "reason": record.get("reason", ""),
                                          "note": record.get("note", "")})
    ooms = by_kind[Kind.OOM]
    cache = by_kind[Kind.SAMPLE_CACHE]
    reliefs = by_kind[Kind.RELIEF]
    pruned = [r for r in reliefs if r.get("relief") == "pruning"]
    used = [s["used_bytes"] for s in samples if s.get("used_bytes") is not None]
    caps = [s["cap_bytes"] for s in samples if s.get("cap_bytes")]
    start = by_kind[Kind.FIT_START][0] if by_kind[Kind.FIT_START] else {}
    return {
        "run_dir": str(run_dir),
        "status": status,
        "journal_lines_unreadable": bad_lines,
        "wall_seconds": (last - first) if first is not None else None,
        "samples_seen": last_fit.get("samples_seen", epochs[-1].get("samples_seen") if epochs else None),
        "steps": records[-1]["step"] if records else 0,
        "epochs_completed": len(epochs),
        "epochs": throughput,
        "throughput_over_time": throughput_over_time(steps),
        "batch_size": last_fit.get("batch_size", start.get("batch_size")),
        "micro_batch_size": {"start": start.get("micro_batch_size"),
                             "end": last_fit.get("micro_batch_size",
                                                 epochs[-1].get("micro_batch_size") if epochs else None)},
        "ooms": {"survived": len(ooms),
                 # None for journals written before OOMs were timed
                 "seconds_lost": (round(sum(o["lost_seconds"] for o in ooms), 3)
                                  if all("lost_seconds" in o for o in ooms) else None),
                 "by_micro_batch": {str(k): v for k, v in collections.Counter(o["micro_batch_size"] for o in ooms).items()},
                 "gave_up": len(by_kind[Kind.OUT_OF_MEMORY]),
                 # CUDA: a batch's first OOM retried once at the same size (oom_retry); it fit unless the
                 # same batch failed again
                 "same_size_retries": len(by_kind[Kind.OOM_RETRY]),
                 "same_size_fit": sum(1 for r in by_kind[Kind.OOM_RETRY] if not _failed_again(r, ooms)),
                 # where the memory went at the last OOM that measured it (journals since issue 16)
                 "last_breakdown": next((o["breakdown"] for o in reversed(ooms) if o.get("breakdown")), None),
                 # memory_snapshot=True (CUDA): the allocator's state at the last OOM, and its largest sites
                 "last_snapshot": next((o["memory_snapshot"] for o in reversed(ooms) if o.get("memory_snapshot")),
                                       None)},
        "actions": dict(actions),
        "reliefs": [{"step": r["step"], "relief": r["relief"], "demand_before": r.get("demand_before")}
                    for r in reliefs],
        "parameters_removed_by_pruning": pruned[-1].get("parameters_removed_in_all") if pruned else 0.0,
        "sample_cache": [{"epoch": c["epoch"], "hit_rate": c.get("hit_rate"), "bytes": c.get("bytes"),
                          "entries": c.get("entries")} for c in cache],
        "loader_workers": [r.get("num_workers") for r in by_kind[Kind.LOADER_REBUILT]],
        # `on_disk`: the file is there now (older ones are pruned, and a copied run may lack them).
        "checkpoints": [{"step": c["step"], "reason": c.get("reason"), "path": c.get("path"),
                         "on_disk": _on_disk(c.get("path"), run_dir)} for c in by_kind[Kind.CHECKPOINT]],
        "checkpoints_failed": [{"step": c["step"], "reason": c.get("reason"), "error": c.get("error")}
                               for c in by_kind[Kind.CHECKPOINT_FAILED]],
        "checkpoints_refused": [{"step": c["step"], "reason": c.get("reason"), "nonfinite": c.get("nonfinite")}
                                for c in by_kind[Kind.CHECKPOINT_REFUSED]],
        "nonfinite_steps": [{"step": r.get("at_step"), "error": r.get("error"), "action": r.get("action")}
                            for r in by_kind[Kind.NONFINITE]],
        "evaluations": [{"step": e["step"], "metrics": e.get("metrics", {}), "micro_batch_size": e.get("micro_batch_size"),
                         "ooms": e.get("ooms", 0)} for e in by_kind[Kind.EVALUATE]],
        # The job's number of ranks over the run: at each fit's start (journals since issue 33 say), and
        # where a resume changed it.
        "world": _world_over_the_run(records),
        "stopped_early": next((r.get("reason") for r in reversed(by_kind[Kind.STOP_REQUESTED])), None),
        "memory": {"cap_bytes": start.get("memory_cap") or (caps[-1] if caps else None),
                   "peak_used_bytes": max(used) if used else None, "samples": len(samples),
                   "source": samples[-1].get("source") if samples else None},
    }


def _world_over_the_run(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    changes: list[dict[str, Any]] = []
    for record in records:
        kind = record.get("kind")
        if kind == Kind.WORLD_CHANGED:
            changes.append({"step": record["step"], "ranks": record["to_world"], "batch_size": record["batch_size_to"],
                            "from_ranks": record["from_world"]})
        elif kind == Kind.FIT_START and record.get("world") is not None:
            if not changes or changes[-1]["ranks"] != record["world"]:
                changes.append({"step": record["step"], "ranks": record["world"], "batch_size": record.get("batch_size")})
    return changes


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
                     "skipped (cut off by a crash, not UTF-8 or not a JSON object, or a record missing a field)")
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
    evaluations = summary.get("evaluations", [])
    if evaluations:
        eval_ooms = sum(e["ooms"] for e in evaluations)
        lines.append(f"  evaluations: {len(evaluations)}" + (f" ({eval_ooms} OOMs survived in them, eval micro-batch "
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
            lines.append(f"    {policy}: {len(applied)} applied, {len(actions) - len(applied)} suppressed")
            for a in applied[:8]:
                lines.append(f"      step {a['step']}: {a['action']} {a['params']} - {a['reason']}")
            if len(applied) > 8:
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
        newest = (f"newest on disk: step {on_disk[-1]['step']} ({on_disk[-1]['reason']}): {on_disk[-1]['path']}"
                  if on_disk else "none on disk")
        lines.append(f"  checkpoints: {len(checkpoints)} written, {newest}")
        if failed:
            lines.append(f"  checkpoints that failed: {len(failed)}, at steps {', '.join(str(c['step']) for c in failed)}"
                         f"; last: {failed[-1]['error']}")
        if refused:
            lines.append(f"  checkpoints refused (weights not finite): {len(refused)}, at steps "
                         f"{', '.join(str(c['step']) for c in refused)}")
    nonfinite = summary["nonfinite_steps"]
    if nonfinite:
        lines.append(f"  non-finite steps: {len(nonfinite)}, at steps {', '.join(str(r['step']) for r in nonfinite)}"
                     f" ({nonfinite[-1]['action']})")
    return "\n".join(lines)


_MARKED = {"oom": "OOM", "relief": "relief", "loader_rebuilt": "loader", "sample_cache_on": "cache on",
           "checkpoint": None, "preempted": "stopped"}


def plot_timeline(run_dir: str | Path, out: str | Path | None = None) -> Any:
    """Draw the run's timeline to `out` (default RUN_DIR/timeline.png) and return the figure:
    memory used vs cap, allocator reserved/allocated where known, micro-batch (a step line),
    data-wait share, with a marker and a short label for every OOM and every applied action."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    run = _read_run(run_dir)
    records, samples, steps = run.records, run.samples, run.steps
    t0 = min([r["time"] for r in records[:1]] + [s["time"] for s in samples[:1]] + [s["time"] for s in steps[:1]],
             default=0.0)
    fig, (memory, micro, wait) = plt.subplots(3, 1, sharex=True, figsize=(11, 7.5),
                                              gridspec_kw={"height_ratios": [2.2, 1, 1]})
    gib = 2**30
    if samples:
        xs = [s["time"] - t0 for s in samples]
        memory.plot(xs, [(s.get("used_bytes") or 0) / gib for s in samples], label="used", color="tab:blue")
        caps = [(s.get("cap_bytes") or float("nan")) / gib for s in samples]
        memory.plot(xs, caps, label=f"cap ({samples[-1].get('source', '')})", color="tab:red", linestyle="--")
    known = [s for s in steps if s.get("reserved_bytes") is not None]
    if known:
        xs = [s["time"] - t0 for s in known]
        memory.plot(xs, [s["reserved_bytes"] / gib for s in known], label="allocator reserved", color="tab:orange")
        memory.plot(xs, [s["allocated_bytes"] / gib for s in known], label="allocator allocated", color="tab:green")
    memory.set_ylabel("memory (GiB)")
    memory.set_title(f"autotune run {run_dir.name}")
    starts = [(r["time"] - t0, r.get("micro_batch_size")) for r in records if r["kind"] == Kind.FIT_START]
    # The size a policy set, from the moment it set it (an OOM's halving shows at once, not
    # only when a step completes at the new size).
    changes = [(r["time"] - t0, r["params"]["size"]) for r in records
               if r["kind"] == Kind.ACTION and r.get("applied") and r.get("action") == "set_micro_batch"
               and isinstance(r.get("params"), dict) and "size" in r["params"]]
    if steps or starts:
        # Each fit starts at its first micro-batch; then the size each step completed with.
        points = sorted(starts + changes + [(s["time"] - t0, s.get("micro_batch_size")) for s in steps])
        micro.step([x for x, _ in points], [m for _, m in points], where="post", color="tab:purple",
                   label="micro-batch in use")
    failed = [(r["time"] - t0, r.get("micro_batch_size")) for r in records if r["kind"] == Kind.OOM]
    if failed:
        micro.scatter([x for x, _ in failed], [m for _, m in failed], marker="x", color="tab:red", label="OOM at")
        micro.legend(loc="upper right", fontsize=8)
    if steps:
        wait.plot([s["time"] - t0 for s in steps], [100 * (s.get("data_wait_fraction") or 0) for s in steps],
                  color="tab:gray")
    micro.set_ylabel("micro-batch")
    wait.set_ylabel("data wait (%)")
    wait.set_xlabel("seconds since the run started")
    span = max([r["time"] - t0 for r in records] + [s["time"] - t0 for s in samples + steps], default=1.0) or 1.0
    last_label = -span
    for record in records:
        label = _MARKED.get(record["kind"])
        if record["kind"] == Kind.ACTION and record.get("applied"):
            label = record["action"].replace("set_", "").replace("_", " ")
        if not label:
            continue
        x = record["time"] - t0
        color = "tab:red" if record["kind"] == Kind.OOM else "black"
        for axis in (memory, micro, wait):
            axis.axvline(x, color=color, alpha=0.25, linewidth=0.8)
        if x - last_label >= span / 50:  # labels that would overlap are left to their lines
            memory.annotate(label, (x, 1.0), xycoords=("data", "axes fraction"), rotation=90, fontsize=7,
                            va="top", ha="right", color=color)
            last_label = x
    if memory.get_legend_handles_labels()[0]:
        memory.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    out = Path(out) if out is not None else run_dir / "timeline.png"
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return fig
