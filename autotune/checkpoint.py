"""Checkpoints: when they are due, atomic writes, the last K kept, resume from the newest one that loads.

A checkpoint is one `torch.save` file in `run_dir/checkpoints/`, named by step. It is written
to a temporary file, fsynced, renamed into place and the folder fsynced, so a kill at any
moment leaves either the old set or the new one, never a half file under a real name.
Loading uses `weights_only=True`: a checkpoint holds tensors and plain data, never code.

The end-of-fit checkpoint is written in the background: the state is serialized in the caller's
thread, so what is saved is the state at that moment, and the bytes are written, fsynced and
renamed on a thread while `fit` returns (the fsync of a 22 MB file took 40-300 ms here). One
write at a time per folder: the next save, a load, a listing and `close()` wait for it, and so
does the interpreter's exit. Where a copy of the state would not fit in a quarter of the memory
left, or the thread cannot start, the write is synchronous. Periodic checkpoints stay
synchronous: one of step N is on disk before step N+1 starts, whatever kills the run after.

A sharded (FSDP2) model's checkpoint is a folder, `step-N/`, that every rank writes its shards
into with `torch.distributed.checkpoint` (sharded_checkpoint.py): no rank gathers the whole
model. It is written as `.step-N.tmp/` and renamed by rank 0 once every rank's files and the
index are on disk; it is always written synchronously.

Owns: `run_dir/checkpoints/` (the files, their order, what is kept). The random states it saves
are rng.py's.
Touches nothing else: the state to save comes from a function the host passes; its layout is
checkpoint_format.py's; collectives go through the job (distributed.py).
"""

from __future__ import annotations

import enum
import functools
import io
import os
import re
import shutil
import signal
import threading
import time
from pathlib import Path
from typing import Any, Callable

import torch
from loguru import logger

from autotune import checksums
from autotune.batching import tensor_bytes
from autotune.checksums import write_beside, write_manifest
from autotune.finite import nonfinite
from autotune.memory import start_with_small_stack
from autotune.notices import info, warn
from autotune.preemption import Preempted
from autotune.records import Kind
from autotune.same_run import AnotherRunsCheckpoints, another_runs_checkpoints, run_id_of
from autotune.stale import remove_stale
from autotune.sharded_checkpoint import REST, read_rest, read_shards, split, write_shards
from autotune.units import format_bytes

_NAME = re.compile(r"^step-(\d{9,})(\.pt)?$")  # a file, or a sharded checkpoint's folder


def nonfinite_weights(weights: dict[str, Any]) -> list[str]:
    """The names of the floating-point tensors in `weights` (a state dict; a sharded model's:
    this rank's shards) holding a NaN or an inf (`finite.nonfinite`: one read a device)."""
    named = [(name, t.to_local() if hasattr(t, "to_local") else t) for name, t in weights.items()
             if isinstance(t, torch.Tensor) and t.is_floating_point()]
    named = [(name, t) for name, t in named if t.numel()]
    return [named[i][0] for i in nonfinite([t for _, t in named])]


def _weights(state: dict[str, Any]) -> dict[str, Any]:
    # The weights in a state to save (checkpoint_format.py's "core"; {} in a state that has none).
    return (state.get("core") or {}).get("model") or {}


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_atomically(data: Any, final: Path, checksum: bool = True) -> None:
    """`data` (bytes, or a state to torch.save) to `final`: a temporary file, fsynced, its sha256
    written beside (`checksum`: checksums.py), renamed, the folder fsynced."""
    temporary = final.parent / f".{final.name}.{os.getpid()}.tmp"
    try:
        with open(temporary, "wb") as f:
            if isinstance(data, (bytes, memoryview)):
                f.write(data)
            else:
                torch.save(data, f)
            f.flush()
            os.fsync(f.fileno())
        if checksum:
            write_beside(temporary, final)
        os.replace(temporary, final)
    except BaseException:
        temporary.unlink(missing_ok=True)  # a full disk stays no fuller than before the attempt
        raise
    _fsync_dir(final.parent)


_TEMPORARY = re.compile(r"\.step-\d{9}\.pt(?:\.sha256)?\.(\d+)\.tmp$")


def remove_stale_temporaries(folder: Path) -> int:
    """Remove what writes killed midway left in `folder` (their process is gone); returns how many."""
    return remove_stale(folder, _TEMPORARY)


_writing: dict[Path, threading.Thread] = {}  # folder -> its background write (one at a time)
_writing_lock = threading.Lock()


def wait_for_writes(folder: Path | None = None) -> None:
    """Wait until the background checkpoint writes into `folder` (None: into any folder) are done."""
    with _writing_lock:
        threads = [t for f, t in _writing.items() if folder is None or f == Path(folder).resolve()]
    for thread in threads:
        if thread is not threading.current_thread():
            thread.join()


class Checkpoints:
    """The checkpoint folder of a run."""

    def __init__(self, folder: Path, keep: int = 3):
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self.folder = Path(folder)
        self.keep = keep
        # This run's checkpoints: those it wrote, or all once it resumed from this folder (same_run.py).
        # Another run's are never pruned as this one's.
        self.written: set[str] = set()
        self.adopted = False

    def paths(self) -> list[Path]:
        """Checkpoints (files, or sharded ones' folders), newest (highest step) first (once a write
        in progress is done)."""
        wait_for_writes(self.folder)
        return self._paths()

    def _paths(self) -> list[Path]:
        if not self.folder.is_dir():
            return []
        found = [(int(m.group(1)), p) for p in self.folder.iterdir()
                 if (m := _NAME.match(p.name)) and (m.group(2) is not None) != p.is_dir()]
        return [p for _, p in sorted(found, reverse=True)]

    def _path(self, step: int, sharded: bool = False) -> Path:
        path = self.folder / f"step-{step:09d}{'' if sharded else '.pt'}"  # what _NAME reads back
        self.written.add(path.name)  # asked for to be written
        return path

    def others(self) -> list[Path]:
        """The checkpoints in the folder that are not this run's, newest first."""
        return [] if self.adopted else [path for path in self.paths() if path.name not in self.written]

    def _unfinished(self, step: int) -> Path:
        return self.folder / f".step-{step:09d}.tmp"

    def save(self, state: dict[str, Any], step: int) -> tuple[Path, float]:
        """Write `state` atomically as the checkpoint of `step`; returns (path, seconds taken)."""
        wait_for_writes(self.folder)  # in order: an older one in progress first
        started = time.perf_counter()
        self.folder.mkdir(parents=True, exist_ok=True)
        final = self._path(step)
        _write_atomically(state, final)
        self._prune()
        return final, time.perf_counter() - started

    def clear_unfinished(self, step: int) -> None:
        """Rank 0, before any rank writes the sharded checkpoint of `step`: remove what a run killed
        while writing one left (its files could outnumber this job's ranks)."""
        shutil.rmtree(self._unfinished(step), ignore_errors=True)

    def save_sharded(self, state: dict[str, Any], step: int, is_main: bool) -> tuple[Path, float]:
        """Every rank at once: its shards of `state` into the folder of `step`; rank 0 adds the rest
        and renames the folder into place. Returns (path, seconds taken)."""
        started = time.perf_counter()
        unfinished, final = self._unfinished(step), self._path(step, sharded=True)
        tensors, rest = split(state)
        write_shards(tensors, unfinished)
        if is_main:
            _write_atomically(rest, unfinished / REST, checksum=False)
            write_manifest(unfinished)  # every rank's shards are in (DCP's save ends in a barrier)
            if final.exists():  # the same step saved again (a stop right after a periodic one)
                replaced = self.folder / f".{final.name}.replaced"
                shutil.rmtree(replaced, ignore_errors=True)
                os.replace(final, replaced)
                shutil.rmtree(replaced)
            os.replace(unfinished, final)
            _fsync_dir(self.folder)
            self._prune()
        return final, time.perf_counter() - started

    def save_in_background(self, state: dict[str, Any], step: int, room_bytes: int | None,
                           done: Callable[[Path, float, float, BaseException | None], None]) -> tuple[Path, float] | None:
        """Serialize `state` now and write it on a thread; `done(path, seconds serializing, seconds
        writing, error)` is called there when it is on disk (or failed). Returns (path, seconds of serializing), or None
        where it must be written synchronously: a copy would not fit in a quarter of
        `room_bytes` (the memory left, None: unknown), or the copy or the thread failed."""
        wait_for_writes(self.folder)
        started = time.perf_counter()
        if room_bytes is not None and 4 * tensor_bytes(state) > room_bytes:
            return None
        try:
            buffer = io.BytesIO()
            torch.save(state, buffer)
        except (MemoryError, RuntimeError) as exc:  # no room for the copy after all: the caller writes it directly
            logger.debug(f"checkpoint of step {step}: no background write ({type(exc).__name__}: {exc})")
            return None
        self.folder.mkdir(parents=True, exist_ok=True)
        final = self._path(step)
        serialized = time.perf_counter() - started
        thread = threading.Thread(target=self._write, args=(buffer, final, functools.partial(done, final, serialized)),
                                  name="autotune-checkpoint")
        with _writing_lock:
            try:
                start_with_small_stack(thread)  # not a daemon: the interpreter's exit waits for the checkpoint
            except RuntimeError as exc:  # can't start new thread (a hard memory cap): synchronous
                logger.debug(f"checkpoint of step {step}: no background write ({exc})")
                return None
            _writing[self.folder.resolve()] = thread
        return final, serialized

    def _write(self, buffer: io.BytesIO, final: Path, done: Callable[[float, BaseException | None], None]) -> None:
        started = time.perf_counter()
        error: BaseException | None = None
        try:
            with buffer.getbuffer() as data:
                _write_atomically(data, final)
            self._prune()
        except Exception as exc:  # reported through `done`: the journal and the log say it failed
            error = exc
        buffer.close()
        try:
            done(time.perf_counter() - started, error)  # before a waiter goes on (and closes the journal)
        finally:
            with _writing_lock:
                if _writing.get(self.folder.resolve()) is threading.current_thread():
                    del _writing[self.folder.resolve()]

    def _prune(self) -> None:
        for old in [path for path in self._paths() if self.adopted or path.name in self.written][self.keep:]:
            if old.is_dir():
                shutil.rmtree(old, ignore_errors=True)
            else:
                old.unlink(missing_ok=True)
                checksums.beside(old).unlink(missing_ok=True)

    def load_latest(self, map_location: str | torch.device = "cpu", template: Callable[[], dict[str, Any]] | None = None,
                    ranks: Any = None) -> tuple[dict[str, Any], Path] | None:
        """The newest checkpoint that loads; a truncated or corrupt one is skipped with a warning.
        A sharded one needs `template` and `ranks` (see `load`)."""
        for path in self.paths():
            if path.is_dir() and template is None:  # not skipped: the run would start afresh instead
                raise ValueError(f"{path} {NOT_SHARDED}")
            try:
                return self.load(path, map_location, template, ranks), path
            except BaseException as exc:  # truncated, changed on disk, bad pickle, DCP's CheckpointException
                if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                    raise
                warn(f"checkpoint {path} cannot be loaded ({type(exc).__name__}: {exc}); trying an older one")
        return None

    @staticmethod
    def load(path: Path, map_location: str | torch.device = "cpu", template: Callable[[], dict[str, Any]] | None = None,
             ranks: Any = None) -> dict[str, Any]:
        """The checkpoint at `path`. A sharded one (a folder) is read by every rank at once, into
        `template()`'s tensors (the state now, of the model sharded alike); rank 0 reads the rest
        and hands it to the others, so every rank goes on, or skips the checkpoint, alike."""
        if not path.is_dir():
            checksums.verify(path)
            return torch.load(path, map_location=map_location, weights_only=True)
        if template is None or ranks is None:
            raise ValueError(f"{path} {NOT_SHARDED}")
        rest: dict[str, Any] | str | None = None
        if ranks.is_main:
            try:
                checksums.verify(path)
                rest = read_rest(path)
            except Exception as exc:  # what went wrong, to every rank
                rest = f"{path / REST} does not load ({type(exc).__name__}: {exc})"
        rest = ranks.broadcast_object(rest)
        if isinstance(rest, str):
            raise ValueError(rest)
        return read_shards(path, rest, template())  # DCP raises on every rank if any rank's read failed


NOT_SHARDED = ("is a sharded checkpoint (torch.distributed.checkpoint): it resumes the same model sharded with "
               "FSDP2 under torchrun (AutoTrainer(..., shard=True)), or in one process alone")


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
        sharded = self.ranks.job.writes_shards
        try:
            if sharded and self.ranks.is_main:  # before the gather: no rank writes there yet
                self.store.clear_unfinished(step)
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
                warn(f"not writing the checkpoint of step {step} ({reason}): the model's weights are not finite "
                     f"({', '.join(nonfinite[:5])}{', ...' if len(nonfinite) > 5 else ''}); the older checkpoints "
                     "are kept", key=f"checkpoint refused {self.store.folder}", error=True)
                return None
            if len(gathered) > 1:  # every rank's random state; the rest is the same everywhere
                state["rng"] = {**state["rng"], "ranks": [rng for rng, _, _ in gathered]}
            if sharded:  # every rank writes its shards
                path, seconds = self.store.save_sharded(state, step, self.ranks.is_main)
            if not self.ranks.is_main:
                self._last = (step, time.monotonic())
                return None
            queued = None
            if not sharded:
                if background and self.room_bytes is not None:
                    done = functools.partial(self._written, reason, step, epoch, journal_fields)
                    queued = self.store.save_in_background(state, step, self.room_bytes(), done)
                path, seconds = queued if queued is not None else self.store.save(state, step)
        except RankFailed:
            raise
        except Exception as exc:
            self._failed(reason, step, epoch, None, exc)
            return None
        self._last = (step, time.monotonic())
        if queued is not None:
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
        self._last = (step, time.monotonic())
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
        template = template if self.ranks.job.writes_shards or self.ranks.world == 1 else None
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
            found = self.store.load_latest(device, template, self.ranks)
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

    def refuse_another_run(self) -> None:
        """Before a run starts afresh here (`fit(resume=False)`): `AnotherRunsCheckpoints`, on every
        rank alike, where the folder holds checkpoints this run neither wrote nor resumed from."""
        others = self.store.others() if self.ranks.is_main else []
        refusal = str(another_runs_checkpoints(self.folder, others)) if others else None
        if self.ranks.world > 1:
            refusal = self.ranks.broadcast_object(refusal)
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
