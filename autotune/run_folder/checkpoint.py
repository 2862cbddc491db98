"""Checkpoints of a run: when they are due (every N steps, every interval), writing one (every
rank's random state gathered, never over a finite one with non-finite weights, failures retried
then stopping the run), resuming from the newest that loads (this folder's run, its model and
optimizer checked), and the stop by a signal.

Periodic checkpoints are synchronous: one of step N is on disk before step N+1 starts, whatever
kills the run after; the end-of-fit one is written in the background. The files themselves, their
atomic and background writes and reading them back are checkpoint_files.py's.

Owns: when checkpoints are written and what is said about them. The random states it saves are
rng.py's. Touches nothing else: the state to save comes from a function the host passes; its layout
is checkpoint_format.py's; collectives go through the job (distributed.py).
"""

from __future__ import annotations

import enum
import functools
import os
import shutil
import signal
import time
from pathlib import Path
from typing import Any, Callable

import torch
from loguru import logger

from autotune.common.batching import tensor_bytes
from autotune.common.notices import info, warn
from autotune.common.units import format_bytes
from autotune.observe.journal import last_run_id
from autotune.observe.records import Kind
from autotune.run_folder.checkpoint_files import Checkpoints, remove_stale_temporaries, wait_for_writes
from autotune.run_folder.run_lock import still_held
from autotune.run_folder.same_run import FRESH_FIT, AnotherRunsCheckpoints, another_runs_checkpoints, run_id_of
from autotune.step.finite import nonfinite
from autotune.stops.preemption import Preempted


def nonfinite_weights(weights: dict[str, Any]) -> list[str]:
    """The names of the floating-point tensors in `weights` (a state dict; a sharded model's:
    this rank's shards) holding a NaN or an inf (`finite.nonfinite`: one read a device)."""
    named = [(name, t.to_local() if hasattr(t, "to_local") else t) for name, t in weights.items()
             if isinstance(t, torch.Tensor) and t.is_floating_point()]
    named = [(name, t) for name, t in named if t.numel()]
    return [named[i][0] for i in nonfinite([t for _, t in named])]


class _Writing:
    """One checkpoint's two ways of being written (ranks/job.py's `CheckpointWriter`), each
    returning (path, seconds taken, whether it is still being written in the background): the
    job calls the one its model's layout needs."""

    def __init__(self, checkpointer: "Checkpointer", reason: str, epoch: int, background: bool,
                 journal_fields: dict[str, Any]):
        self._checkpointer, self._reason, self._epoch = checkpointer, reason, epoch
        self._background, self._journal_fields = background, journal_fields

    def clear_unfinished(self, step: int) -> None:
        self._checkpointer.store.clear_unfinished(step)

    def write_whole(self, state: dict[str, Any], step: int) -> tuple[Path, float, bool]:
        checkpointer = self._checkpointer
        if self._background and checkpointer.room_bytes is not None:
            done = functools.partial(checkpointer._written, self._reason, step, self._epoch, self._journal_fields)
            queued = checkpointer.store.save_in_background(state, step, checkpointer.room_bytes(), done)
            if queued is not None:
                return (*queued, True)
        return (*checkpointer.store.save(state, step), False)

    def write_shards(self, state: dict[str, Any], step: int, is_main: bool) -> tuple[Path, float, bool]:
        return (*self._checkpointer.store.save_sharded(state, step, is_main), False)  # synchronously, every rank


def _weights(state: dict[str, Any]) -> dict[str, Any]:
    # The weights in a state to save (checkpoint_format.py's "core"; {} in a state that has none).
    return (state.get("core") or {}).get("model") or {}


class CheckpointDue(enum.IntEnum):
    """Whether a checkpoint is due, and by which rule (the larger wins when ranks agree)."""

    NO = 0
    BY_TIME = 1
    BY_STEPS = 2


class RankFailed(Exception):
    """A rank reported, in a checkpoint's gather, that it cannot go on (see distributed.py)."""


class CheckpointFailed(RuntimeError):
    """Several checkpoints in a row could not be written (a full disk, a folder gone read-only):
    the run stops rather than train on with nothing saved. The message names the folder, the
    bytes a checkpoint needs and those free, and the newest checkpoint on disk."""


MAX_FAILED_CHECKPOINTS = 3  # in a row, before the run stops


class Checkpointer:
    """When checkpoints are due, writing them (rank 0, with every rank's random state) and
    finding the newest for a resume. Owns `run_dir/checkpoints/` and nothing else: the state
    to save comes from a function the trainer passes in."""

    def __init__(self, folder: Path, *, keep: int, every: int | None, interval: float | None,
                 ranks: Any, journal: Any, room_bytes: Callable[[], int | None] | None = None):
        self.store = Checkpoints(folder, keep=keep)
        self.every, self.interval = every, interval
        self.ranks, self.journal = ranks, journal
        self.room_bytes = room_bytes  # the memory left for a copy of the state; None: no background writes
        self._last = (0, time.monotonic())  # (step, time) of the last checkpoint or of the fit's start
        self.failed_in_a_row = 0  # checkpoints that could not be written since the last one that was
        self._last_error: str | None = None
        self._state_bytes = 0  # the size of the last state taken, for the error that says what is needed
        self._refused: str | None = None  # the non-finite tensors, where the last failure was a refusal
        self._owner = os.getpid()
        if ranks.is_main:
            removed = remove_stale_temporaries(self.store.folder)
            if removed:
                logger.info(f"removed {removed} unfinished checkpoint file(s) of a killed run from {self.store.folder}")

    def restart_clock(self, step: int) -> None:
        """Count from `step` and now (at the start of a fit)."""
        self._last = (step, time.monotonic())

    def due(self, step: int) -> CheckpointDue:
        """Whether a checkpoint is due once the run has done `step` optimizer steps: every N steps
        means at steps N, 2N, ... (the caller passes the step the current batch will end at)."""
        last_step, last_time = self._last
        if self.every is not None and step - last_step >= self.every:
            return CheckpointDue.BY_STEPS
        if self.interval is not None and time.monotonic() - last_time >= self.interval:
            return CheckpointDue.BY_TIME
        return CheckpointDue.NO

    def save(self, reason: str, state_fn: Callable[[], dict[str, Any]], step: int, epoch: int,
             failure: str | None = None, background: bool = False, **journal_fields: Any) -> Path | None:
        """Write a checkpoint now (every rank calls this together under torchrun). Failing to write
        one is journaled, not raised: it must not turn an orderly stop (or the error being
        reported) into a different error. `failure`: this rank cannot go on; under torchrun it
        travels in the gather, and `RankFailed` is raised on every rank before anything is written.
        `background`: the state is taken now and written on a thread (see the module docstring);
        its journal line says `background` and the seconds of taking it; a write that fails adds
        a `checkpoint_failed` line. A sharded model's checkpoint is written by every rank, and
        synchronously."""
        if os.getpid() != self._owner:  # a child the run forked (its callback's) ending: never the run's checkpoint
            return None
        if self.ranks.is_main and not still_held(self.store.folder.parent):
            return None  # the run folder is another's now: RunDirLost was raised when that was found
        # The job writes it as its model is held: rank 0 the whole of it, or every rank its shards.
        job, writer = self.ranks.job, _Writing(self, reason, epoch, background, journal_fields)
        try:
            job.prepare_checkpoint(writer, step, self.ranks.is_main)
            state = state_fn()
            self._state_bytes = tensor_bytes(state)
            gathered = self.ranks.gather((state["rng"], failure, nonfinite_weights(_weights(state))))
            failures = [f"rank {rank}: {text}" for rank, (_, text, _) in enumerate(gathered) if text]
            if failures:
                raise RankFailed("; ".join(failures))
            nonfinite = sorted({name for _, _, names in gathered for name in names})
            if nonfinite:
                # Never over a finite one: the older checkpoints stay as they are.
                self.journal.write(Kind.CHECKPOINT_REFUSED, step, epoch, reason=reason, nonfinite=nonfinite[:20])
                names = f"{', '.join(nonfinite[:5])}{', ...' if len(nonfinite) > 5 else ''}"
                warn(f"not writing the checkpoint of step {step} ({reason}): the model's weights are not finite "
                     f"({names}); the older checkpoints are kept, and the run stops after {MAX_FAILED_CHECKPOINTS} "
                     "refused in a row", key=f"checkpoint refused {self.store.folder}", error=True)
                # A run that cannot be saved does not train on as if it could: refusals count as failures.
                self._last, self._refused = (step, time.monotonic()), names
                self.failed_in_a_row += 1
                return None
            if len(gathered) > 1:  # every rank's random state; the rest is the same everywhere
                state["rng"] = {**state["rng"], "ranks": [rng for rng, _, _ in gathered]}
            written = job.write_checkpoint(writer, state, step, self.ranks.is_main)
            if not self.ranks.is_main:
                self._last = (step, time.monotonic())
                return None
            path, seconds, queued = written
        except RankFailed:
            raise
        except Exception as exc:
            self._failed(reason, step, epoch, None, exc)
            return None
        self._last = (step, time.monotonic())
        if queued:
            return path  # journaled by `_written` once it is on disk
        self.failed_in_a_row = 0
        self.journal.write(Kind.CHECKPOINT, step, epoch, reason=reason, path=str(path), seconds=round(seconds, 4),
                           **journal_fields)
        return path

    def _written(self, reason: str, step: int, epoch: int, journal_fields: dict[str, Any], path: Path,
                 serialized: float, seconds: float, error: BaseException | None) -> None:
        # On the writer's thread, once the background write is done.
        if error is not None:
            self._failed(reason, step, epoch, path, error)
            return
        self.failed_in_a_row = 0
        self.journal.write(Kind.CHECKPOINT, step, epoch, reason=reason, path=str(path), seconds=round(serialized, 4),
                           background=True, write_seconds=round(seconds, 4), **journal_fields)

    def _failed(self, reason: str, step: int, epoch: int, path: Path | None, error: BaseException) -> None:
        # Retried at the next due time (every N steps, every interval), not at every step: `_last`
        # moves on as after a checkpoint; several in a row stop the run (`raise_if_failing`).
        self._last, self._refused = (step, time.monotonic()), None
        self.failed_in_a_row += 1
        self._last_error = f"{type(error).__name__}: {error}"
        self.journal.write(Kind.CHECKPOINT_FAILED, step, epoch, reason=reason, error=repr(error)[:300],
                           **({"path": str(path)} if path is not None else {}), in_a_row=self.failed_in_a_row)
        warn(f"could not write the checkpoint of step {step} ({reason}) into {self.store.folder}: {error}; "
             f"retried at the next one, and the run stops after {MAX_FAILED_CHECKPOINTS} failures in a row",
             key=f"checkpoint failed {self.store.folder}", error=True)

    def raise_if_failing(self, failing: bool) -> None:
        """After a scheduled checkpoint: stop the run (`CheckpointFailed`) where the last
        MAX_FAILED_CHECKPOINTS could not be written (`failing`: on any rank, as agreed)."""
        if not failing:
            return
        self.wait()
        newest = next(iter(self.store._paths()), None)
        if self._refused is not None:
            raise CheckpointFailed(
                f"{self.failed_in_a_row} checkpoints in a row were refused: the model's weights are not finite "
                f"({self._refused}; a buffer such as BatchNorm's running variance overflows on an input far out of "
                "range, a weight on a learning rate too high). The run cannot be saved, so it stops. The newest "
                f"checkpoint on disk is {newest if newest is not None else 'none'}: continue from it with "
                "fit(..., resume=True) once the cause is found")
        free = shutil.disk_usage(self.store.folder).free if self.store.folder.is_dir() else None
        raise CheckpointFailed(
            f"{self.failed_in_a_row} checkpoints in a row could not be written into {self.store.folder} (last: "
            f"{self._last_error}); one needs about {format_bytes(self._state_bytes)}"
            + (f" and the disk there has {format_bytes(free)} free" if free is not None else "")
            + f". The newest checkpoint on disk is {newest if newest is not None else 'none'}: make room (or pass "
              "run_dir= elsewhere) and continue with fit(..., resume=True)")

    @property
    def failing(self) -> bool:
        """Whether the last MAX_FAILED_CHECKPOINTS checkpoints all failed (this rank's view)."""
        return self.failed_in_a_row >= MAX_FAILED_CHECKPOINTS

    def wait(self) -> None:
        """Until the checkpoint being written in the background, if any, is on disk."""
        wait_for_writes(self.folder)

    def begin(self, resume: bool | str | Path, load: Callable[[dict[str, Any]], None], progress: Any,
              device: torch.device, template: Callable[[], dict[str, Any]] | None = None) -> None:
        """A fit's start: `resume` True (the newest checkpoint here) or a path (that one) through
        `resume`; False: a fresh start, refused where this folder holds another run's checkpoints."""
        if resume is False:
            self.refuse_another_run()  # never pruned, nor resumed later, as this run's
        else:
            self.resume(load, progress, device, path=None if resume is True else Path(resume), template=template)

    def resume(self, load: Callable[[dict[str, Any]], None], progress: Any, device: torch.device,
               path: Path | None = None, template: Callable[[], dict[str, Any]] | None = None) -> None:
        """`load` the checkpoint at `path`, or (None) the newest that loads; none: say so, and the
        run starts fresh. A named one that does not load is an error naming it. `template`: the
        state now (`state_dict`), whose shards a sharded model's checkpoint is read into."""
        # Sharded checkpoints are read into the state now: by the ranks of a sharded job, or by a job of
        # one process, which reads every rank's shards into whole tensors (a node lost: issue 33).
        template = self.ranks.job.reads_shards(template)
        elsewhere = path is not None and path.resolve().parent != self.folder.resolve()
        if elsewhere:  # this folder's checkpoints, if any, are another run's
            self.refuse_another_run()
        if path is not None:
            if not path.exists():
                raise FileNotFoundError(f"resume={str(path)!r}: no such checkpoint")
            try:
                found = self.store.load(path, device, template, self.ranks), path
            except Exception as exc:
                raise ValueError(f"resume={str(path)!r} is not a checkpoint that loads: {type(exc).__name__}: {exc}") from None
        else:
            found = self.store.load_latest(device, template, self.ranks, run_id=self._folder_run_id())
        self.store.adopted = not elsewhere  # this run's from here: pruned as its own
        unloadable = self.store.paths() if found is None else []
        if unloadable:
            raise ValueError(f"resume: none of the {len(unloadable)} checkpoints in {self.folder} loads (each "
                             "is named above, with why); not starting afresh over them. Move the folder away to "
                             "start a new run, or name a checkpoint with resume=PATH")
        if found is None:
            info(f"no checkpoint in {self.folder}: starting fresh")
            self.journal.write(Kind.RESUME, progress.step, progress.epoch, found=False)
            return
        state, path = found
        load(state)
        run_id = run_id_of(state)
        warn(f"resuming run {run_id or '(no id: an older autotune)'} from {path}: step {progress.step}, epoch "
             f"{progress.epoch}, {progress.position} samples into it")
        self.journal.write(Kind.RESUME, progress.step, progress.epoch, found=True, path=str(path),
                           position=progress.position, samples_seen=progress.samples_seen, run_id=run_id)

    def _folder_run_id(self) -> str | None:
        # The run this folder's journal says wrote it last (rank 0 reads it; every rank skips alike).
        run_id = last_run_id(self.journal.path) if self.ranks.is_main and self.journal.path is not None else None
        return self.ranks.broadcast_object(run_id)

    def refuse_another_run(self, starting: tuple[str, str] = FRESH_FIT) -> None:
        """Before a run starts afresh here (`fit(resume=False)`, a Tuner's first batch: `starting`):
        `AnotherRunsCheckpoints`, on every rank alike, where the folder holds checkpoints this run
        neither wrote nor resumed from."""
        others = self.store.others() if self.ranks.is_main else []
        refusal = str(another_runs_checkpoints(self.folder, others, starting)) if others else None
        refusal = self.ranks.broadcast_object(refusal)  # alone: its own
        if refusal is not None:
            raise AnotherRunsCheckpoints(refusal)

    def preempted(self, signum: int, path: Path | None, progress: Any) -> Preempted:
        """The error that ends a run stopped by a signal, after its checkpoint (`path`) was written
        (None: none could be, a rank stalled under torchrun)."""
        name = signal.Signals(signum).name
        saved = (f"checkpoint {path}" if path is not None else "no checkpoint of this stop (under torchrun one needs every "
                 f"rank; this one stopped waiting for its data): the newest in {self.folder} is the one to resume from")
        message = (f"stopped by {name} at step {progress.step} (epoch {progress.epoch}, {progress.position} samples "
                   f"into it); {saved}; continue with fit(..., resume=True)")
        self.journal.write(Kind.PREEMPTED, progress.step, progress.epoch, signal=name, checkpoint=str(path))
        warn(message)
        return Preempted(signum, message)

    @property
    def folder(self) -> Path:
        return self.store.folder
