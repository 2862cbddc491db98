"""`autotune report RUN_DIR --plot`: the run's timeline as a picture (memory used against the cap,
the micro-batch with the sizes that hit OOM, the data-wait share, a line for every OOM and action).

Owns the picture. Touches nothing of a run (read-only); reading the run's files is report.py's.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

from autotune.observe.journal import read_lines
from autotune.observe.records import Kind
from autotune.observe.report import _has, _journal_path, _readable, _side_file


@dataclasses.dataclass
class _Run:
    records: list[dict[str, Any]]  # events.jsonl
    unreadable: int  # its lines that could not be read
    samples: list[dict[str, Any]]  # samples.jsonl (the monitor's)
    steps: list[dict[str, Any]]  # steps.jsonl


def _read_run(run_dir: Path) -> _Run:
    """Every file of a run, read whole (the timeline plot's; the summary streams: `_Tally`)."""
    records, unreadable = read_lines(_journal_path(run_dir))
    readable = [r for r in records if _readable(r)]  # a line without what the report reads is counted, not read
    return _Run(readable, unreadable + len(records) - len(readable),
                _timed(run_dir / "samples.jsonl"), _timed(run_dir / "steps.jsonl"))


def _timed(path: Path) -> list[dict[str, Any]]:
    # The records of a side file that have a time (the plot's x).
    return [s for _, s in _side_file(path) if isinstance(s, dict) and _has(s, {"time": (int, float)})]


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
    # Written beside it and renamed over it: a link planted at its name is replaced, never written through.
    temporary = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    try:
        fig.savefig(temporary, dpi=110, format=out.suffix.lstrip(".") or "png")
        os.replace(temporary, out)
    finally:
        temporary.unlink(missing_ok=True)
    plt.close(fig)
    return fig
