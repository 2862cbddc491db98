"""The batch a fit is loading or training, and the checkpoint an error that is not an OOM gets.

An error that is not an OOM (a sample that cannot be read, a bug in step_fn or a callback, a
non-finite step with on_nonfinite="stop") loses nothing: between optimizer steps the weights
are those of the last completed step, so that is checkpointed, and the error gets a note
naming the batch and the checkpoint. An error while the batch was loading also names the
sample: the batch's samples are fetched again one at a time, and the first that fails is named
with its own error (in the note, and for the journal's `fit_failed`). An OOM error, a
preemption and TooManyNonFiniteSteps have written theirs already. Under torchrun a checkpoint needs every rank, and the
others are not here: the note says so. A `SystemExit` from the user's code (`sys.exit` in a
dataset, a step_fn, a callback) is checkpointed the same way, and said on stderr (its traceback
is never printed); `Preempted` and a `KeyboardInterrupt` (Ctrl-C pressed three times) are not.

A stop signal during the wait for a batch ends the wait (preemption.py, stall.py): the weights
are the last completed step's, so they are checkpointed and `Preempted` raised. So does a stop
received before the wait began (alone; under torchrun the step's agreement carries it), and an
error of the loader while a stop is under way (its workers got the signal too).

Owns: which batch is in hand (its place in the epoch, and the step it started at). Touches: the
error's notes, the user's warnings (notices.py); it saves through the function it is given.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path
from typing import Any, Callable, Iterator

from autotune.common.notices import warn
from autotune.common.oom import ExchangeFailed, OutOfMemory, TooManyNonFiniteSteps
from autotune.data.pipeline import UnlikeTheOthers
from autotune.ranks.process import Process
from autotune.run_folder.checkpoint import CheckpointFailed, RankFailed
from autotune.stops.stall import StoppedWhileWaiting

END = object()  # what `BatchInHand.fetch` returns after an epoch's last batch


class BatchInHand:
    """Where the loop is, kept cheaply (put in words only when an error needs it)."""

    def __init__(self, describe: Callable[[int, int, int], str], *, ranks: Process, folder: Path,
                 find_bad: Callable[[int, int], tuple[int, Exception] | None] | None = None,
                 preempted: Callable[[int, Path | None], BaseException] | None = None,
                 stop_pending: Callable[[], int | None] | None = None):
        self._describe = describe  # (epoch, position, batches_done) -> "batch 3 of epoch 0: samples ..."
        self._find_bad = find_bad  # (epoch, position) -> (index, its error) of the first sample that fails
        self._preempted = preempted  # (signum, the checkpoint's path) -> the error that ends a stop by signal
        self._stop_pending = stop_pending  # () -> the stop signal received in this fit, or None
        self._ranks, self._folder = ranks, folder  # this process's place in the job; the checkpoints' folder
        self._batch: tuple[int, int, int] | None = None
        self._waiting_since: float | None = None  # perf_counter() at the start of the wait for the batch in hand
        self.in_next = False  # inside the loader's next(): a stop signal may unwind the wait
        self._first_wait: float | None = None  # this fit's first, and the waits begun since: the mean batch time
        self._waits = 0
        self.step_at_start = 0
        self.bad_sample: dict[str, Any] | None = None  # the sample named at the last error, for the journal

    def start(self, epoch: int, position: int, batches_done: int, step: int, now: float) -> None:
        """The wait for the batch at `position` of `epoch` begins (`now`: time.perf_counter())."""
        self._batch, self.step_at_start, self._waiting_since = (epoch, position, batches_done), step, now
        self.in_next = True
        if self._first_wait is None:
            self._first_wait = now
        self._waits += 1

    def fetch(self, batches: Iterator[Any], epoch: int, position: int, batches_done: int, step: int,
              now: float, save: Callable[[str], Path | None]) -> Any:
        """The next batch of `batches` (`END` after the last), its wait marked (`start`) for the stall
        watch. A stop signal during the wait (stall.py) ends it: the weights are the last completed
        step's, so they are checkpointed (`save(reason)`, alone; under torchrun the other ranks are
        not here) and `preempted(signum, path)` is raised."""
        try:
            try:
                self.start(epoch, position, batches_done, step, now)  # inside: a signal may come once it is marked
                # Alone; under torchrun the step's agreement carries it.
                pending = self._ranks.known_to_all(self._stop_pending()) if self._stop_pending is not None else None
                if pending is not None:  # it came after the last step's check: no new wait
                    raise StoppedWhileWaiting(pending)
                batch = next(batches)
            finally:
                self.in_next = False  # from here a signal only raises the flag (inside: it is caught below)
        except StopIteration:
            self.done()
            return END
        except StoppedWhileWaiting as stop:
            self._stopped(stop.signum, save)
        except Exception:
            pending = self._stop_pending() if self._stop_pending is not None else None
            if pending is None:
                raise
            self._stopped(pending, save)  # the stop reached the loader's workers too: it is the stop, not a failure
        self._waiting_since = None
        return batch

    def _stopped(self, signum: int, save: Callable[[str], Path | None]) -> None:
        saved, _ = self._ranks.save_alone(lambda: save(f"signal {signal.Signals(signum).name}"))
        raise self._preempted(signum, saved) from None

    def done(self) -> None:
        self._batch = self._waiting_since = None
        self.in_next = False

    def new_fit(self) -> None:
        """A fit starts: the mean time between batches counts from its first."""
        self._first_wait, self._waits = None, 0

    batch = property(lambda self: self._batch, doc="(epoch, position, batches_done) of the batch in hand, or None")

    def waited(self) -> float | None:
        """Seconds the batch in hand has been waited for so far; None when none is awaited."""
        since = self._waiting_since
        return None if since is None else time.perf_counter() - since

    def mean_seconds_between_batches(self) -> float | None:
        """This fit's mean time from one wait's start to the next (None before a second batch)."""
        first, since, waits = self._first_wait, self._waiting_since, self._waits
        if first is None or since is None or waits < 2:
            return None
        return (since - first) / (waits - 1)

    def save_before_raising(self, exc: BaseException, step: int, save: Callable[[str], Path | None]) -> Path | None:
        """Note the batch on `exc` (an `Exception`, or the user's `SystemExit`) and, where that loses
        nothing, `save(reason)` (module docstring); the checkpoint's path, or None."""
        self.bad_sample = None  # this error's, not an earlier fit's
        exiting = not isinstance(exc, Exception)  # sys.exit: Python prints no traceback, so no note is seen
        if self._batch is not None:
            exc.add_note(f"autotune: {self._describe(*self._batch)}")
            if self._waiting_since is not None and self._find_bad is not None and not exiting:
                self._name_bad_sample(exc)  # (a sample that calls sys.exit would call it again)
        if isinstance(exc, (OutOfMemory, ExchangeFailed, RankFailed, CheckpointFailed, TooManyNonFiniteSteps)):
            return None
        unsaved, path = None, None
        if self._batch is not None and step != self.step_at_start:
            # keep_effective_batch=False steps inside a batch (alone only): a checkpoint would train that part again.
            unsaved = ("not checkpointed: this batch was already partly stepped on, and the newest checkpoint in "
                       f"{self._folder} is the one to resume from")
        else:
            path, why = self._ranks.save_alone(lambda: save("exit" if exiting else "error"))
            if why is not None:
                unsaved = f"not checkpointed ({why}); the newest checkpoint in {self._folder} is the one to resume from"
        if exiting:
            done = unsaved or (f"the training up to step {step} is in the checkpoint {path}" if path is not None
                               else "the checkpoint could not be written (said above)")
            where = f" ({self._describe(*self._batch)})" if self._batch is not None else ""
            warn(f"sys.exit({getattr(exc, 'code', None)!r}) in the training (a dataset, step_fn or callback) at step "
                 f"{step}{where}: {done}; continue with fit(..., resume=True)", key=f"exit {id(exc)}")
        elif unsaved is not None:
            exc.add_note(f"autotune: {unsaved}")
        elif path is not None:
            exc.add_note(f"autotune: the training up to step {step} is in the checkpoint {path}; "
                         "fix the cause and continue with fit(..., resume=True)")
            warn(f"stopped by {type(exc).__name__} at step {step}; checkpoint {path}; continue with "
                 "fit(..., resume=True) once the cause is fixed", key=f"error checkpoint {path}")
        return path

    def failure_fields(self, saved: Path | None) -> dict[str, Any]:
        """What the journal's `fit_failed` adds: the checkpoint `saved` before raising, the bad sample."""
        return {**({"checkpoint": str(saved)} if saved else {}),
                **({"bad_sample": self.bad_sample} if self.bad_sample else {})}

    def _name_bad_sample(self, exc: Exception) -> None:
        epoch, position, _ = self._batch
        found = self._find_bad(epoch, position)
        if found is None:
            exc.add_note("autotune: each of the batch's samples loads on its own: the batch failed as a whole "
                         "(its collate_fn, or a worker)")
            return
        index, error = found
        if isinstance(error, UnlikeTheOthers):
            self.bad_sample = {"index": index, "error": str(error)[:300]}
            exc.add_note(f"autotune: sample {index} of the dataset loads, but unlike the others: {error}")
            return
        text = f"{type(error).__name__}: {error}"[:300]
        self.bad_sample = {"index": index, "error": text}
        exc.add_note(f"autotune: sample {index} of the dataset fails to load (fetched alone): {text}")
