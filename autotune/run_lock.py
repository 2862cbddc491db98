"""One writer per run folder: an flock on `RUN_DIR/.lock`, held by the process that writes the run
(rank 0 under torchrun) from its Tuner's start to its close, or to the process's end.

    hold_run_dir(run_dir, ranks)   before anything is written: a second process is refused
                                   (`RunDirInUse`, naming the folder and the holder's PID) on every
                                   rank; a lock whose holder died without letting go (kill -9) is
                                   taken over, said once on stderr; the shared
                                   memory of killed runs is removed (stale.py)
    RunLock.release()              at close: the PID cleared, the lock let go (at exit too)

The kernel lets go of an flock when its holder dies, so a lock that can be taken is free, whatever
the file says; the PID in it only tells whether the last holder ended without closing. Within one
process a second Tuner on the same folder shares the hold (a notebook cell run again builds its
trainer while the old one is still bound): the refusal is for another process.

Owns `RUN_DIR/.lock` and this process's holds. Touches the shared memory of dead processes (at a
run's start, through stale.py).
"""

from __future__ import annotations

import atexit
import fcntl
import os
from pathlib import Path
from typing import IO, Any

from autotune.notices import warn
from autotune.stale import remove_stale_shared_memory

LOCK_NAME = ".lock"


class RunDirInUse(RuntimeError):
    """Another process is writing this run folder (its PID in the message): raised by the Tuner or
    AutoTrainer before anything is written, on every rank. Wait for that run to end, or use another
    `run_dir`. A holder killed with SIGKILL lets go of the folder (the kernel drops its lock)."""


class _Hold:
    def __init__(self, file: IO[str]):
        self.file, self.holders = file, 0


_holds: dict[str, _Hold] = {}  # this process's, by the lock file's resolved path


class RunLock:
    """This process's hold on a run folder; `release()` once (more calls do nothing)."""

    def __init__(self, key: str | None):
        self._key = key  # None: nothing held

    def release(self) -> None:
        key, self._key = self._key, None
        hold = _holds.get(key) if key is not None else None
        if hold is None:
            return
        hold.holders -= 1
        if hold.holders <= 0:
            del _holds[key]
            _let_go(hold.file)


def _let_go(file: IO[str]) -> None:
    # Cleared first: a lock file left with a PID in it says its holder ended without closing.
    file.seek(0)
    file.truncate()
    file.flush()
    fcntl.flock(file, fcntl.LOCK_UN)
    file.close()


def _release_all() -> None:
    for key in list(_holds):
        _let_go(_holds.pop(key).file)


atexit.register(_release_all)


def take(run_dir: Path) -> RunLock:
    """Hold `run_dir` for this process (creating it); `RunDirInUse` when another process does."""
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / LOCK_NAME
    key = str(path.resolve())
    hold = _holds.get(key)
    if hold is None:
        file = open(path, "a+")  # never truncated before the lock is ours: the holder's PID stays readable
        try:
            fcntl.flock(file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            file.seek(0)
            holder = file.read().strip() or "unknown"
            file.close()
            raise RunDirInUse(f"{run_dir} is being written by another process (PID {holder}): a run folder takes one "
                              "writer. Wait for that run to end, or give this one another run_dir") from None
        file.seek(0)
        previous = file.read().strip()
        if previous and previous != str(os.getpid()):
            warn(f"{run_dir}: the process that last wrote this run (PID {previous}) ended without closing it "
                 "(killed?); this process takes the folder over", key=f"run lock {key}")
        file.seek(0)
        file.truncate()
        file.write(f"{os.getpid()}\n")
        file.flush()
        hold = _holds[key] = _Hold(file)
    hold.holders += 1
    return RunLock(key)


def hold_run_dir(run_dir: Path, ranks: Any) -> RunLock:
    """Rank 0 holds `run_dir` (`take`); under torchrun its refusal reaches every rank, so none goes on
    to wait in a collective for a rank 0 that stopped. The other ranks hold nothing (a RunLock
    whose `release` does nothing)."""
    lock, refusal = RunLock(None), None
    if ranks.is_main:
        try:
            lock = take(run_dir)
        except RunDirInUse as exc:
            refusal = str(exc)
        remove_stale_shared_memory()  # the sample boards and caches of runs killed before they could
    if ranks.world > 1:
        refusal = ranks.broadcast_object(refusal)
    if refusal is not None:
        raise RunDirInUse(refusal)
    return lock
