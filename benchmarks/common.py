"""Shared bits of the benchmarks: machine description, medians, results files."""

from __future__ import annotations

import datetime
import os
import platform
import statistics
import sys
from pathlib import Path

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
