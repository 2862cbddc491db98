"""The checkpoint folder, `run_dir/checkpoints/`: its files, their names and order, atomic and
background writes, what is kept, and reading one back.

A checkpoint is one `torch.save` file, named by step. It is written to a temporary file, fsynced,
its sha256 written beside it (checksums.py), renamed into place and the folder fsynced, so a kill at
any moment leaves either the old set or the new one, never a half file under a real name. Loading
uses `weights_only=True`: a checkpoint holds tensors and plain data, never code; a file changed on
disk since, or one that lost its sum, is skipped for the one before.

The end-of-fit checkpoint is written in the background: the state is serialized in the caller's
thread, so what is saved is the state at that moment, and the bytes are written, fsynced and
renamed on a thread while `fit` returns (the fsync of a 22 MB file took 40-300 ms here). One
write at a time per folder: the next save, a load, a listing and `close()` wait for it, and so
does the interpreter's exit. Where a copy of the state would not fit in a quarter of the memory
left, or the thread cannot start, the write is synchronous.

A sharded (FSDP2) model's checkpoint is a folder, `step-N/`, that every rank writes its shards
into with `torch.distributed.checkpoint` (sharded_checkpoint.py): no rank gathers the whole
model. It is written as `.step-N.tmp/` and renamed by rank 0 once every rank's files and the
index are on disk; it is always written synchronously.

Owns: the files of `run_dir/checkpoints/`. Touches nothing else: when a checkpoint is due and what
it holds are checkpoint.py's.
"""

from __future__ import annotations

import functools
import io
import os
import re
import shutil
import threading
import time
from pathlib import Path
from typing import Any, Callable

import torch
from loguru import logger

from autotune.common.batching import tensor_bytes
from autotune.common.notices import warn
from autotune.common.stale import remove_stale
from autotune.memory.figures import start_with_small_stack
from autotune.run_folder import checksums
from autotune.run_folder.checksums import write_beside, write_manifest
from autotune.run_folder.same_run import run_id_of
from autotune.run_folder.sharded_checkpoint import REST, read_rest, read_shards, split, write_shards

_NAME = re.compile(r"^step-(\d{9,})(\.pt)?$")  # a file, or a sharded checkpoint's folder


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
        found = []
        for path in self.folder.iterdir():
            if not (m := _NAME.match(path.name)):
                continue
            # A file checkpoint is a regular file (a FIFO planted there would hang its read, a link to a device
            # never end it); a sharded one, a folder.
            if path.is_file() if m.group(2) is not None else path.is_dir():
                found.append((int(m.group(1)), path))
            elif m.group(2) is not None and path.exists():
                warn(f"{path} is not a regular file: not a checkpoint, passed over", key=f"not a checkpoint {path}")
        return [path for _, path in sorted(found, reverse=True)]

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
                    ranks: Any = None, run_id: str | None = None) -> tuple[dict[str, Any], Path] | None:
        """The newest checkpoint that loads; a truncated or corrupt one is skipped with a warning,
        and so is one of another run than `run_id` (the folder's, from its journal; None: any).
        A sharded one needs `template` and `ranks` (see `load`)."""
        for path in self.paths():
            if path.is_dir() and template is None:  # not skipped: the run would start afresh instead
                raise ValueError(f"{path} {NOT_SHARDED}")
            try:
                state = self.load(path, map_location, template, ranks)
            except BaseException as exc:  # truncated, changed on disk, bad pickle, DCP's CheckpointException
                if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                    raise
                warn(f"checkpoint {path} cannot be loaded ({type(exc).__name__}: {exc}); trying an older one")
                continue
            theirs = run_id_of(state)
            if run_id is None or theirs is None or theirs == run_id:
                return state, path
            warn(f"checkpoint {path} is another run's: run {theirs}, where this folder's journal is run {run_id}'s "
                 f"(copied in from another folder?); trying an older one. To continue run {theirs}, resume it from "
                 "a folder of its own (resume=PATH into an empty run_dir)")
        return None

    @staticmethod
    def load(path: Path, map_location: str | torch.device = "cpu", template: Callable[[], dict[str, Any]] | None = None,
             ranks: Any = None) -> dict[str, Any]:
        """The checkpoint at `path`. A sharded one (a folder) is read by every rank at once, into
        `template()`'s tensors (the state now, of the model sharded alike); rank 0 reads the rest
        and hands it to the others, so every rank goes on, or skips the checkpoint, alike."""
        if not path.is_dir():
            summed = checksums.verify(path)
            state = torch.load(path, map_location=map_location, weights_only=True)
            if not summed:
                checksums.unsummed(path, run_id_of(state))
            return state
        if template is None or ranks is None:
            raise ValueError(f"{path} {NOT_SHARDED}")
        rest: dict[str, Any] | str | None = None
        if ranks.is_main:
            try:
                summed = checksums.verify(path)
                rest = read_rest(path)
                if not summed:
                    checksums.unsummed(path, run_id_of(rest))
            except Exception as exc:  # what went wrong, to every rank
                rest = f"{path / REST} does not load ({type(exc).__name__}: {exc})"
        rest = ranks.broadcast_object(rest)
        if isinstance(rest, str):
            raise ValueError(rest)
        return read_shards(path, rest, template())  # DCP raises on every rank if any rank's read failed


NOT_SHARDED = ("is a sharded checkpoint (torch.distributed.checkpoint): it resumes the same model sharded with "
               "FSDP2 under torchrun (AutoTrainer(..., shard=True)), or in one process alone")
