"""SIGTERM and SIGINT during `fit()`: finish the step, checkpoint, exit cleanly.

Schedulers (Slurm, Kubernetes, spot instances) send SIGTERM and wait a grace period before
SIGKILL. The first SIGTERM or SIGINT only raises a flag; the loop sees it after the current
optimizer step, writes a checkpoint and raises `Preempted`. While the loop waits for a batch
(`interrupts()` says so: stall.py), the handler raises `StoppedWhileWaiting` instead, so a
loader that never answers does not hold the stop. A second signal of either kind gets the
default behaviour back: a second Ctrl-C aborts at once.

Owns: the SIGTERM/SIGINT handlers while a fit runs (put back after). Touches nothing else.
"""

from __future__ import annotations

import signal
import threading
from types import FrameType
from typing import Callable

from autotune.stall import StoppedWhileWaiting


class Preempted(SystemExit):
    """Training stopped on a signal after writing a checkpoint. Exit code 128 + signal number
    (143 for SIGTERM, 130 for SIGINT), as shells and schedulers expect."""

    def __init__(self, signum: int, message: str):
        super().__init__(128 + signum)
        self.signum = signum
        self.message = message

    def __str__(self) -> str:
        return self.message


class StopRequests:
    """Installs the handlers for the duration of a `with` block (main thread only)."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self, interrupts: Callable[[], bool] | None = None) -> None:
        self.signum: int | None = None
        self._interrupts = interrupts  # whether the loop is in a wait the handler should unwind
        self._previous: dict[int, object] = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.signum = signum
        for sig in self.SIGNALS:  # the next signal acts at once
            signal.signal(sig, signal.SIG_DFL if sig == signal.SIGTERM else signal.default_int_handler)
        if self._interrupts is not None and self._interrupts():
            raise StoppedWhileWaiting(signum)  # out of the blocked fetch (PEP 475 retries it otherwise)

    def __enter__(self) -> "StopRequests":
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
