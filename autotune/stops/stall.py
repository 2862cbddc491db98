"""A stalled loader is named, and a stop by signal does not wait for it.

A `__getitem__` that blocks (a network mount gone, a lock never released, a worker stuck in a
library call) used to hang a fit without a word, and the first SIGTERM only raised a flag that
the loop reads after the step that never came. `StallWatch` keeps a daemon thread, started with
the trainer (before a memory cap is likely set: RLIMIT_AS counts a thread's stack, 256 KiB here)
and stopped at its close, that looks at the batch in hand once a second while a fit runs:

    waiting for a batch longer than the threshold   a WARNING on stderr (once per batch) naming the
                                                    epoch, the batch, its place in the epoch and the
                                                    dataset indices being fetched; a `data_stalled`
                                                    journal record
    a stop signal during the wait                   `interrupts()` tells the signal handler
    (SIGTERM, SIGINT, SIGHUP, SIGUSR1)              (preemption.py) to raise `StoppedWhileWaiting`
                                                    there: the weights are the last completed
                                                    step's, so the trainer checkpoints them and exits
                                                    128 + n within seconds; its workers, the stuck
                                                    one included, are stopped on the way out

The threshold is `seconds` when given; otherwise 20 times the mean time between batches so far
in this fit, bounded to 30 s .. 10 min (the first batch, which starts the workers: 2 min). Under
torchrun a signal interrupts a wait only once it is a stall: a rank that raised in an ordinary
wait would leave the others in the step's collectives instead of the agreed checkpoint, and a
stalled rank cannot join one (the newest checkpoint is the one to resume from).

A thread that cannot start (a cap already set, no room left) leaves the run without the warning,
said at DEBUG; the stop by signal during a wait does not need the thread.

Owns the watchdog thread. Touches: the user's warnings, the journal; reads the batch in hand.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any, Callable

from loguru import logger

from autotune.common.notices import warn
from autotune.memory.figures import start_with_small_stack
from autotune.observe.records import Kind

FACTOR, LOWEST, HIGHEST, FIRST_BATCH = 20.0, 30.0, 600.0, 120.0  # seconds, but FACTOR
POLL_SECONDS = 1.0


class StoppedWhileWaiting(BaseException):
    """Raised by the signal handler out of a wait for a batch (never caught by a dataset's `except
    Exception`); the trainer turns it into a checkpoint and `Preempted`."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


class StallWatch:
    """The watchdog of a trainer's fits: `start()` with the trainer, `with watch:` around each fit
    (what it watches), `stop()` at close."""

    def __init__(self, in_hand: Any, indices: Callable[[int], list[int] | None], journal: Any, *, ranks: Any,
                 seconds: float | None = None):
        self._in_hand, self._indices, self._journal = in_hand, indices, journal
        self._ranks, self._seconds = ranks, seconds  # ranks: this process's place in the job (ranks/process.py)
        self._done = threading.Event()
        self._thread: threading.Thread | None = None
        self._fitting = False  # between a fit's start and end: the batch in hand is this trainer's
        self._warned: tuple[int, int] | None = None  # (epoch, batch) last named
        self.start()  # now, with the trainer: before a cap is likely set

    def threshold(self) -> float:
        """Seconds a wait for a batch may last before it is named a stall."""
        if self._seconds is not None:
            return self._seconds
        mean = self._in_hand.mean_seconds_between_batches()
        return FIRST_BATCH if mean is None else min(HIGHEST, max(LOWEST, FACTOR * mean))

    def interrupts(self) -> bool:
        """Whether a stop signal now should unwind the wait for a batch (see the module docstring): only
        inside the loader's `next()` (`BatchInHand.fetch` catches it there)."""
        waited = self._in_hand.waited()
        return waited is not None and self._in_hand.in_next and self._ranks.may_stop_waiting(waited >= self.threshold())

    def start(self) -> None:
        """Start the thread (once); where it cannot start, the run goes on without the warning."""
        if self._thread is not None:
            return
        # The thread holds the watch weakly: a trainer dropped without close() takes its watch along.
        thread = threading.Thread(target=_watch, args=(weakref.ref(self), self._done), name="autotune-stall-watch",
                                  daemon=True)
        try:
            start_with_small_stack(thread)
        except RuntimeError as exc:  # can't start new thread: a hard memory cap already set
            logger.debug(f"no stalled-loader watch: {exc}")
            return
        self._thread = thread

    def stop(self) -> None:
        """End the thread (idempotent)."""
        self._done.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        self._thread = None

    def __enter__(self) -> "StallWatch":
        self._in_hand.new_fit()
        self._fitting = True
        return self

    def __exit__(self, *exc: object) -> None:
        self._fitting = False

    def check(self) -> None:
        """Name the batch in hand if its wait has passed the threshold (once per batch)."""
        waited, batch = self._in_hand.waited(), self._in_hand.batch
        if waited is None or batch is None:
            return
        threshold = self.threshold()
        epoch, position, batches_done = batch
        if waited < threshold or self._warned == (epoch, batches_done):
            return
        self._warned = (epoch, batches_done)
        indices = self._indices(position) or []
        shown = (f"; the dataset's samples being fetched: [{', '.join(map(str, indices[:64]))}"
                 f"{', ...' if len(indices) > 64 else ''}]") if indices else ""
        # Said on every rank: a stalled rank is rarely rank 0, whose peers wait for it in silence.
        rank = self._ranks.label()
        warn(f"{rank}no batch for {waited:.0f} s (over {threshold:.0f} s): waiting for batch {batches_done + 1} of "
             f"epoch {epoch + 1}, {position} samples into it{shown}. A __getitem__ that blocks (storage, a lock) or a "
             "stuck worker? SIGTERM or Ctrl-C now checkpoints the last completed step and stops",
             key=f"data stalled {id(self)} {epoch} {batches_done}", every_rank=True)
        self._journal.write(Kind.DATA_STALLED, self._in_hand.step_at_start, epoch, seconds=round(waited, 1),
                            threshold=round(threshold, 1), position=position, batch=batches_done,
                            indices=indices[:64])


def _watch(watch_ref: weakref.ref, done: threading.Event) -> None:
    # The watchdog's loop: once a second, while the watch (and so its trainer) lives and is not stopped.
    while not done.wait(POLL_SECONDS):
        watch = watch_ref()
        if watch is None:
            return
        if watch._fitting:
            watch.check()
        del watch  # not held across the wait
