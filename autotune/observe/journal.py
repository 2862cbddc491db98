"""The run log: the journal (`run_dir/events.jsonl`, one JSON object per line, append-only),
the steps log, TensorBoard and the progress bar, behind one `RunLog`.

Every line has `time` (unix seconds), `kind`, `step` and `epoch`; the rest depends on the
kind, as records.py's registry lists them (a kind that is not there is refused). Lines are
flushed as they are written so a crashed run keeps everything up to the crash.

Owns: `events.jsonl`, `steps.jsonl`, the TensorBoard writer, the progress bar, and the one
reader of the run's JSONL files. Touches nothing of training.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path
from typing import IO, Any, Callable, Iterator

from tqdm.auto import tqdm

from autotune.common.files import NotAFile, open_regular
from autotune.common.notices import warn
from autotune.observe.records import Kind
from autotune.observe.records import check as check_record

STRICT = os.environ.get("AUTOTUNE_STRICT_JOURNAL") == "1"  # every field checked too (the test suite's)


class Journal:
    """Append-only JSONL writer. `Journal(None)` records nothing (e.g. non-zero ranks).

    `listeners` are called with every record written (TensorBoard's text tab is one).
    """

    def __init__(self, path: Path | None):
        self.path = path
        self.listeners: list[Callable[[dict[str, Any]], None]] = []
        self._file = None
        self.lost = 0  # lines that could not be written
        self._lock = threading.Lock()  # a background checkpoint's line comes from its writer thread
        self._owner = os.getpid()  # a child forked by the run (a callback's, a loader worker) writes nothing here
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open_for_append(path)

    def write(self, kind: str, step: int, epoch: int, **fields: Any) -> dict[str, Any]:
        """Append one record (a kind of records.py's, with its fields) and return it."""
        check_record(kind, fields, STRICT)
        record = {"time": time.time(), "kind": kind, "step": step, "epoch": epoch, **fields}
        with self._lock:
            if self._file is not None and os.getpid() == self._owner:
                try:
                    self._file.write(json.dumps(record, default=str) + "\n")
                except OSError as exc:  # a full disk: the run's record suffers, never the training
                    self.lost += 1
                    warn(f"could not write the run's journal {self.path} ({exc}); training goes on, and the lines "
                         "it loses are counted at the end", key=f"journal write failed {self.path}", error=True)
                for listener in self.listeners:
                    listener(record)
        return record

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                try:
                    self._file.close()  # flushes what is left in its buffer
                except OSError as exc:
                    self.lost += 1
                    warn(f"could not write the end of the run's journal {self.path} ({exc})", key=f"journal close {self.path}")
                self._file = None
            if self.lost:
                warn(f"{self.lost} line(s) of the run's journal {self.path} could not be written (see above)",
                     key=f"journal lost {self.path}")


def open_for_append(path: Path) -> IO[str]:
    """`path` opened to append JSONL lines (line-buffered). A file that ends mid-line (a process
    killed mid-write, a short write on a full disk) gets its newline first: the fragment stays an
    unreadable line of its own, and the next record is whole (appended to the fragment, it was lost)."""
    try:
        with open(path, "rb") as f:
            f.seek(-1, os.SEEK_END)
            torn = f.read(1) != b"\n"
    except OSError:  # no file yet, an empty one (the seek fails), or one that cannot be read
        torn = False
    file = open(path, "a", buffering=1, encoding="utf-8")
    if torn:
        file.write("\n")
    return file


MAX_LINE_BYTES = 2**20  # a record autotune writes is a few hundred bytes; a longer line is skipped


def _bounded_lines(f: IO[bytes]) -> Iterator[bytes | None]:
    # Each line of `f`, or None for one longer than MAX_LINE_BYTES, read past in pieces: memory stays
    # bounded whatever the file holds (a 2 GiB tail of NULs is one such line).
    while line := f.readline(MAX_LINE_BYTES + 1):
        if len(line) <= MAX_LINE_BYTES or line.endswith(b"\n"):
            yield line
            continue
        while line and not line.endswith(b"\n"):
            line = f.readline(MAX_LINE_BYTES)
        yield None


def each_line(path: Path) -> Iterator[tuple[int, dict[str, Any] | ValueError]]:
    """(line number, its record) for each non-blank line of a JSONL file, a line at a time; a line
    that is not UTF-8, not JSON (or nested too deeply to parse), not a JSON object or longer than
    MAX_LINE_BYTES gives its ValueError instead. A missing file has none; one that is not a
    regular file is `NotAFile`."""
    f = open_regular(Path(path))
    if f is None:
        return
    with f:
        for number, line in enumerate(_bounded_lines(f), start=1):
            if line is None:
                yield number, ValueError(f"a line longer than {MAX_LINE_BYTES} bytes")
                continue
            if not line.strip():
                continue
            try:
                record = json.loads(line.decode("utf-8"))
            except ValueError as exc:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
                yield number, exc
                continue
            except RecursionError:  # arrays or objects nested thousands deep: the parser's stack runs out
                yield number, ValueError("JSON nested too deeply to read")
                continue
            yield number, record if isinstance(record, dict) else ValueError(
                f"a JSON {type(record).__name__}, not an object")


def last_run_id(path: Path) -> str | None:
    """The run id of a journal's newest `fit_start` or `resume` record that names one: the run that
    wrote this folder last (None: no journal, or none names a run). Read from the end, a block at a
    time, so a long run's journal costs no more than its last records."""
    try:
        f = open_regular(Path(path))
    except NotAFile:
        return None
    if f is None:
        return None
    with f:
        end, carry = f.seek(0, os.SEEK_END), b""
        while end > 0:
            start = max(0, end - MAX_LINE_BYTES)
            f.seek(start)
            lines = (f.read(end - start) + carry).split(b"\n")
            carry = lines.pop(0) if start > 0 else b""  # the first may begin in the block before
            for line in reversed(lines):
                run_id = _run_id_in(line)
                if run_id is not None:
                    return run_id
            if len(carry) > MAX_LINE_BYTES:  # an overlong line: its other pieces are never a record
                carry = b""
            end = start
    return None


def _run_id_in(line: bytes) -> str | None:
    if b'"run_id"' not in line:
        return None
    try:
        record = json.loads(line.decode("utf-8"))
    except (ValueError, RecursionError):  # RecursionError: nested too deeply (each_line's)
        return None
    if isinstance(record, dict) and record.get("kind") in (Kind.FIT_START, Kind.RESUME):
        run_id = record.get("run_id")
        return run_id if isinstance(run_id, str) else None
    return None


def read_lines(path: Path, strict: bool = False) -> tuple[list[dict[str, Any]], int]:
    """The records of a JSONL file (the journal, steps.jsonl, samples.jsonl) and how many of its
    lines could not be read (`each_line`). A line that cannot be read (a truncated last line, a
    crash mid-write, a byte gone bad) is skipped and counted, unless `strict`: then it is an error
    naming the file and the line (a truncated last line still only counts; a missing file is an
    error too)."""
    if strict and not Path(path).exists():
        raise FileNotFoundError(f"{path}: no such journal")
    records: list[dict[str, Any]] = []
    unreadable = 0
    previous = None  # a bad line's error, raised (strict) only once another line follows it
    for number, record in each_line(path):
        if previous is not None:
            raise previous
        if isinstance(record, ValueError):
            if strict:
                previous = ValueError(f"{path}:{number}: not a JSON object line: {record}")
            unreadable += 1
        else:
            records.append(record)
    return records, unreadable


def read_journal(path: Path) -> Iterator[dict[str, Any]]:
    """Yield the records of a journal, strictly (`read_lines(path, strict=True)`)."""
    yield from read_lines(path, strict=True)[0]


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
        self._journal.write(Kind.STEP, step, epoch, **fields)

    def close(self) -> None:
        self._journal.close()


class _ProgressBar(tqdm):
    # tqdm's monitor thread is started on the first bar; under a hard memory cap a thread
    # whose stack cannot be mapped makes Thread.start() wait forever. The bar refreshes on
    # every update anyway, so the monitor is not needed.
    monitor_interval = 0


# What a RunLog makes in the run folder: the journal, the steps log, TensorBoard's default folder.
JOURNAL_NAME, STEPS_NAME, TENSORBOARD_NAME = "events.jsonl", "steps.jsonl", "tb"


class RunLog:
    """Everything a run writes about itself: the journal (events.jsonl), the steps log
    (steps.jsonl), TensorBoard and the progress bar. On ranks other than 0 it writes nothing.
    Owns those files and the bar; touches no training state."""

    def __init__(self, run_dir: Path, *, writes: bool, tensorboard: bool | str | Path, progress: bool):
        if writes:  # `tensorboard` checked with the other options (tuning/config.py)
            run_dir.mkdir(parents=True, exist_ok=True)
        self.journal = Journal(run_dir / JOURNAL_NAME if writes else None)
        self.steps = StepLog(run_dir / STEPS_NAME if writes else None)
        self.tensorboard = None
        if tensorboard is not False and writes:
            from autotune.observe.tensorboard_log import TensorBoardLog

            self.tensorboard = TensorBoardLog(run_dir / TENSORBOARD_NAME if tensorboard is True else tensorboard)
            self.journal.listeners.append(self.tensorboard.record)
        self.show_progress = progress and writes
        self.bar: tqdm | None = None
        self.moves_bar = False  # a bar is shown that moves every step (`advance`)
        self._last_shown = 0.0

    def open_bar(self, total: int | None) -> None:
        self.bar = None
        self._on_bar(self._make_bar, total)

    def _make_bar(self, total: int | None) -> None:
        self.bar = _ProgressBar(total=total, disable=not self.show_progress, unit="batch", dynamic_ncols=True)
        self.moves_bar = self.show_progress  # a bar is shown that moves every step (`advance`)

    def step_due(self) -> bool:
        """Whether `step` has a line to write for the next step: a caller may skip gathering its
        figures otherwise (and only move the bar: `advance`)."""
        return self.steps.due()

    def advance(self) -> None:
        """The bar one step on."""
        if self.bar is not None:
            self._on_bar(self.bar.update, 1)

    def _on_bar(self, action: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
        # The bar writes to stderr: where that is gone (its descriptor closed, a pipe whose reader left:
        # `... 2>&1 | head`), the bar stops and the run goes on (the journal and steps.jsonl have it all).
        try:
            action(*args, **kwargs)
        except (OSError, ValueError) as exc:
            if isinstance(exc, ValueError) and "closed file" not in str(exc):
                raise
            bar, self.bar, self.moves_bar, self.show_progress = self.bar, None, False, False
            if bar is not None:
                bar.disable = True  # its close() then writes nothing

    def step(self, step: int, epoch: int, *, samples: int, samples_seen: int, micro_batch_size: int,
             step_seconds: float, data_wait_fraction: float, demand: float | None, allocated_bytes: int | None,
             reserved_bytes: int | None, loss: Callable[[], Any], sample: Callable[[], Any],
             grad_norm: Any = None) -> None:
        """One step's figures: to steps.jsonl and TensorBoard when due (thinned: a two-day run
        writes megabytes, and reads the loss off the device rarely), and to the bar.
        `loss()`: the batch's mean loss (read off the device only when written). The bar is moved
        apart (`advance`), every step."""
        if not self.steps.due():
            return
        norm = {} if grad_norm is None else {"grad_norm": round(float(grad_norm), 6)}  # read off the device: thinned
        self.steps.write(step, epoch, micro_batch_size=micro_batch_size, samples=samples, samples_seen=samples_seen,
                         step_seconds=round(step_seconds, 6), data_wait_fraction=round(data_wait_fraction, 4),
                         demand=None if demand is None else round(demand, 4),
                         allocated_bytes=allocated_bytes, reserved_bytes=reserved_bytes, **norm)
        if self.tensorboard is not None:
            now = sample()
            self.tensorboard.step(
                step, loss=float(loss()), samples_seen=samples_seen, step_samples=samples, **norm,
                step_seconds=step_seconds, micro_batch_size=micro_batch_size, data_wait_fraction=data_wait_fraction,
                used_bytes=now.used_bytes, cap_bytes=now.cap_bytes, allocated_bytes=allocated_bytes,
                reserved_bytes=reserved_bytes, demand=demand)

    def show_due(self, now: float) -> bool:
        """Whether `show` would refresh the bar now (a caller may skip gathering its figures otherwise)."""
        return self.bar is not None and self.show_progress and now - self._last_shown > 0.5

    def show(self, now: float, **figures: Any) -> None:
        """Refresh the bar's figures, at most twice a second (each may read the device)."""
        if not self.show_due(now):
            return
        self._last_shown = now
        self._on_bar(self.bar.set_postfix, **{k: v() if callable(v) else v for k, v in figures.items()}, refresh=False)

    def flush(self) -> None:
        if self.tensorboard is not None:
            self.tensorboard.flush()

    def close(self) -> None:
        """Close every file (the trainer's `close()`); a closed log writes nothing more."""
        self.close_bar()
        self.journal.close()
        self.steps.close()
        if self.tensorboard is not None:
            self.tensorboard.close()
            self.tensorboard = None

    def close_bar(self) -> None:
        if self.bar is not None:
            self._on_bar(self.bar.close)
            self.bar = None
            self.moves_bar = False
