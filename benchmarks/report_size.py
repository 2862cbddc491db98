"""`autotune report` on a large journal: wall time and peak memory of the command, as a user runs it.

    python benchmarks/report_size.py [--mib 200] [--rounds 3] [--base PATH] [--out FILE]

Writes a synthetic journal of about `--mib` MiB (a long run's mix: 60% policy actions, 20% OOMs,
20% checkpoints, an epoch end every 1,000 records, one fit), then runs `python -m autotune.cli
report DIR` in a fresh interpreter `--rounds` times, for this checkout and, with `--base`, for
another one (PYTHONPATH=PATH: a `git worktree` of an older commit), the sides in turn. Prints
and (with `--out`) writes the medians: wall seconds and the child's peak RSS (ru_maxrss).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]


def write_journal(path: Path, mib: float) -> int:
    """A journal of about `mib` MiB; returns its number of records."""
    target, written, records, t = mib * 2**20, 0, 0, 0.0
    with open(path, "w") as f:
        def put(record: dict) -> None:
            nonlocal written, records
            line = json.dumps(record) + "\n"
            f.write(line)
            written += len(line)
            records += 1

        put({"kind": "fit_start", "time": t, "step": 0, "epoch": 0, "device": "cpu", "world": 1,
             "micro_batch_size": 32, "batch_size": 32})
        step = 0
        while written < target:
            step += 1
            t += 0.01
            epoch = step // 1000
            kind = ("checkpoint", "oom", "action", "action", "action")[step % 5]
            if kind == "checkpoint":
                put({"kind": kind, "time": t, "step": step, "epoch": epoch, "reason": "every",
                     "path": f"/runs/x/checkpoints/step-{step:09d}.pt", "seconds": 0.1})
            elif kind == "oom":
                put({"kind": kind, "time": t, "step": step, "epoch": epoch, "micro_batch_size": 32,
                     "message": "DefaultCPUAllocator: can't allocate memory", "lost_seconds": 0.01})
            else:
                put({"kind": kind, "time": t, "step": step, "epoch": epoch, "policy": "halve_on_oom",
                     "action": "set_micro_batch", "params": {"size": 16}, "applied": True,
                     "reason": "an OOM at micro-batch 32", "note": ""})
            if step % 1000 == 0:
                put({"kind": "epoch_end", "time": t, "step": step, "epoch": epoch - 1, "samples_seen": step * 32,
                     "loss": 0.5, "micro_batch_size": 16})
    return records


def run_once(run_dir: Path, pythonpath: Path) -> tuple[float, float]:
    """(wall seconds, peak RSS in MiB) of one `autotune report` in a fresh interpreter."""
    script = ("import resource, subprocess, sys, time; t = time.perf_counter(); "
              f"subprocess.run([sys.executable, '-m', 'autotune.cli', 'report', {str(run_dir)!r}], check=True, "
              "stdout=subprocess.DEVNULL); "
              "print(time.perf_counter() - t, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024)")
    # Run from the side's folder: `python -m` puts the working directory first on sys.path.
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True,
                         cwd=pythonpath, env={**os.environ, "PYTHONPATH": str(pythonpath)})
    seconds, rss = out.stdout.split()
    return float(seconds), float(rss)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", type=float, default=200.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--base", type=Path, default=None)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    sides = {"head": HERE} | ({"base": args.base.resolve()} if args.base else {})
    with tempfile.TemporaryDirectory() as folder:
        run_dir = Path(folder)
        started = time.perf_counter()
        records = write_journal(run_dir / "events.jsonl", args.mib)
        size = (run_dir / "events.jsonl").stat().st_size / 2**20
        print(f"journal: {size:.0f} MiB, {records:,} records (written in {time.perf_counter() - started:.1f} s)")
        figures: dict[str, list[tuple[float, float]]] = {name: [] for name in sides}
        for _ in range(args.rounds):
            for name, path in sides.items():  # the sides in turn: the machine's drift falls on both
                figures[name].append(run_once(run_dir, path))
    lines = [f"`python benchmarks/report_size.py --mib {args.mib:g} --rounds {args.rounds}"
             + (" --base <worktree>" if args.base else "") + "`",
             f"journal {size:.0f} MiB, {records:,} records; medians of {args.rounds} runs of `autotune report DIR`:", ""]
    for name, runs in figures.items():
        seconds = statistics.median(s for s, _ in runs)
        rss = statistics.median(r for _, r in runs)
        lines.append(f"- {name}: {seconds:.2f} s, peak RSS {rss:.0f} MiB "
                     f"(runs: {', '.join(f'{s:.2f} s / {r:.0f} MiB' for s, r in runs)})")
    text = "\n".join(lines)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        with open(args.out, "a") as f:
            f.write(text + "\n\n")


if __name__ == "__main__":
    main()
