"""Shared bits of the benchmarks: machine description, medians, results files."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any, Callable

import torch

RESULTS = Path(__file__).parent / "results"


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return (f"{os.cpu_count()} cores ({cpu}), torch {torch.__version__}, "
            f"threads {torch.get_num_threads()}, Python {platform.python_version()}")


def fresh_run_dir(path: str | Path, rank: int = 0) -> Path:
    """`path` emptied (by rank 0; under torchrun the caller waits at a barrier after): a run folder
    that holds an earlier benchmark run's checkpoints refuses a new run (AnotherRunsCheckpoints)."""
    if rank == 0:
        shutil.rmtree(path, ignore_errors=True)
    return Path(path)


def median(values: list[float]) -> float:
    return statistics.median(values)


def write_results(name: str, title: str, lines: list[str]) -> Path:
    """Write benchmarks/results/NAME.md with the command, the machine and the date."""
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"{name}.md"
    command = "python " + " ".join([os.path.relpath(sys.argv[0])] + sys.argv[1:])
    header = [
        f"# {title}", "",
        f"- command: `{command}`",
        f"- machine: {machine()}",
        f"- date: {datetime.datetime.now().strftime('%Y-%m-%d %H:%M')}", "",
    ]
    path.write_text("\n".join(header + lines) + "\n")
    print(path.read_text())
    return path


def two_ranks(script: str, worker: Callable[[int, str], None], rounds: int, out: str) -> tuple[int, Any] | None:
    """A two-rank benchmark's launch: in a rank (`--worker`), `worker(rounds, out)` and None; otherwise
    `script` under torchrun with 2 processes (gloo, one thread each), then (rounds, what rank 0 wrote to `out`)."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=rounds)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.rounds, out)
        return None
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone", script,
                    "--worker", "--rounds", str(args.rounds)], check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    return args.rounds, json.loads(Path(out).read_text())


def alternate(rounds: int, *loops: tuple[str, Callable[[], Any]]) -> dict[str, list]:
    """Each loop once to warm up, then `rounds` rounds, the order reversed every round so the
    machine's noise hits them alike; {name: [what each call returned]}."""
    for _, run in loops:
        run()
    results: dict[str, list] = {name: [] for name, _ in loops}
    for r in range(rounds):
        for name, run in loops if r % 2 == 0 else loops[::-1]:
            results[name].append(run())
    return results
