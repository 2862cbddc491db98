"""What every step of the GPU check shares (benchmarks/gpu_check.py runs each in its own interpreter).

A step is a `run(report, device)` function: it asserts behaviour with `report.check(name, ok,
detail)` and keeps measurements with `report.figure(name, value)`. Every call rewrites the
step's result file, so a step cut short by its time limit keeps what it had checked. `main(run)`
is a step's entry point: `--result PATH` (where the JSON goes), `--dry-run` (imports and
arguments only: the CPU dry-run in the test suite).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable

MiB = 2**20


class Report:
    """One step's checks and figures, saved to `path` after each."""

    def __init__(self, path: Path | None):
        self.path = path
        self.checks: list[dict[str, Any]] = []
        self.figures: dict[str, Any] = {}
        self.started = time.monotonic()

    def check(self, name: str, ok: bool, detail: Any = "") -> bool:
        self.checks.append({"name": name, "ok": bool(ok), "detail": str(detail)})
        print(f"  [{'ok' if ok else 'FAILED'}] {name}" + (f": {detail}" if detail != "" else ""), flush=True)
        self.save()
        return bool(ok)

    def figure(self, name: str, value: Any) -> Any:
        self.figures[name] = value
        print(f"  {name} = {value}", flush=True)
        self.save()
        return value

    @property
    def passed(self) -> bool:
        return bool(self.checks) and all(c["ok"] for c in self.checks)

    def save(self) -> None:
        if self.path is not None:
            self.path.write_text(json.dumps({"checks": self.checks, "figures": self.figures,
                                             "seconds": round(time.monotonic() - self.started, 1)}, default=str))


def main(run: Callable[[Report, Any], None]) -> None:
    """A step's entry point (see the module docstring). Exit status: 0 every check passed, 1 one
    failed or the step raised, 2 no CUDA device."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--result", type=Path, default=None)
    parser.add_argument("--dry-run", action="store_true", help="imports and arguments only (no CUDA needed)")
    args = parser.parse_args()
    report = Report(args.result)
    if args.dry_run:
        report.check("dry run: the step's imports", True)
        sys.exit(0)
    import torch

    if not torch.cuda.is_available():
        report.check("a CUDA device", False, f"torch {torch.__version__} sees none")
        sys.exit(2)
    device = torch.device("cuda", torch.cuda.current_device())  # memory fractions want an index
    try:
        run(report, device)
    except Exception as exc:  # the step's own failure: recorded with where it happened, then failed
        report.check(f"the step ran to its end ({type(exc).__name__})", False,
                     "".join(traceback.format_exception(exc))[-1500:])
        sys.exit(1)
    sys.exit(0 if report.passed else 1)


def cuda_context_free(pid: int) -> bool:
    """Whether process `pid` has no CUDA driver library mapped (no context could be made without it)."""
    maps = Path(f"/proc/{pid}/maps").read_text()
    return "libcuda.so" not in maps


def wait_for(predicate: Callable[[], Any], timeout: float, period: float = 0.05) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(period)
    return predicate()
