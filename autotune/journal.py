"""The run's journal: `run_dir/events.jsonl`, one JSON object per line, append-only.

Every line has `time` (unix seconds), `kind`, `step` and `epoch`; the rest depends on the
kind (`fit_start`, `oom`, `action`, `epoch_end`, `fit_end`, ...). Lines are flushed as
they are written so a crashed run keeps everything up to the crash.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Callable, Iterator


class Journal:
    """Append-only JSONL writer. `Journal(None)` records nothing (e.g. non-zero ranks).

    `listeners` are called with every record written (TensorBoard's text tab is one).
    """

    def __init__(self, path: Path | None):
        self.path = path
        self.listeners: list[Callable[[dict[str, Any]], None]] = []
        self._file = None
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(path, "a", buffering=1, encoding="utf-8")

    def write(self, kind: str, step: int, epoch: int, **fields: Any) -> dict[str, Any]:
        """Append one record and return it."""
        record = {"time": time.time(), "kind": kind, "step": step, "epoch": epoch, **fields}
        if self._file is not None:
            self._file.write(json.dumps(record, default=str) + "\n")
            for listener in self.listeners:
                listener(record)
        return record

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def read_journal(path: Path) -> Iterator[dict[str, Any]]:
    """Yield the records of a journal. A truncated last line (a crash mid-write) is skipped;
    a bad line anywhere else is an error naming the file and line."""
    lines = Path(path).read_text(encoding="utf-8").splitlines()
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            yield json.loads(line)
        except json.JSONDecodeError as exc:
            if number == len(lines):
                return
            raise ValueError(f"{path}:{number}: not a JSON line: {exc}") from exc


class StepLog:
    """`run_dir/steps.jsonl`: per-step figures for plots (micro-batch, data wait, demand,
    allocator), at most one line every `min_interval` seconds after the first `every_step_for`
    steps, so a two-day run writes tens of megabytes, not gigabytes."""

    def __init__(self, path: Path | None, min_interval: float = 1.0, every_step_for: int = 200):
        self._journal = Journal(path)
        self.min_interval = min_interval
        self.every_step_for = every_step_for
        self._lines = 0
        self._last = 0.0

    def due(self) -> bool:
        """Whether the next step gets a line."""
        return self._lines < self.every_step_for or time.time() - self._last >= self.min_interval

    def write(self, step: int, epoch: int, **fields: Any) -> None:
        """Write the step's line (callers ask `due()` first)."""
        self._lines += 1
        self._last = time.time()
        self._journal.write("step", step, epoch, **fields)

    def close(self) -> None:
        self._journal.close()
