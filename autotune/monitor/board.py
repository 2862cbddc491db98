"""The latest sample, shared between the monitor process and the trainer: a seqlock over
a small memory-mapped file (in /dev/shm when there is one).

The file's page is reserved when it is made (shared_memory.reserve): a full /dev/shm is then an
error at creation, never SIGBUS at a later write. `create_board` then makes it in the run folder
instead, with a word on stderr: the monitor (another process) keeps working through it.

The writer makes the sequence number odd, writes the fields, and makes it even again.
A reader copies the fields between two reads of the sequence number and keeps the copy
only if both reads are equal and even. A read costs microseconds and never waits: after
a few torn reads it answers None ("no new figure this time").

Owns the board file. Touches nothing else (stale boards of dead processes in the folder it falls back to).
"""

from __future__ import annotations

import mmap
import os
import struct
from pathlib import Path

from autotune.common.notices import warn
from autotune.common.shared_memory import reserve
from autotune.common.snapshot import DeviceSample
from autotune.common.stale import BOARD, create_claimed, remove_stale, shared_memory_dir

_MAGIC = 0x41544D31  # "ATM1"
_HEADER = struct.Struct("<IIQ")  # magic, layout version, sequence number
_PAYLOAD = struct.Struct("<dqqqqQi4x")  # time, used, cap, total, process bytes, samples taken, source
SIZE = _HEADER.size + _PAYLOAD.size
SOURCES = ("", "cuda", "nvml", "rlimit_as", "cgroup", "memory_cap", "host")
_SEQ_OFFSET = 8
_SEQ = struct.Struct("<Q")


def _encode(value: int | None) -> int:
    return -1 if value is None else int(value)


def _decode(value: int) -> int | None:
    return None if value < 0 else value


def default_path(folder: Path | None = None) -> Path:
    """A new board's path in `folder` (default: the shared-memory folder), named after this process
    (stale.py removes it once the process is gone)."""
    return (shared_memory_dir() if folder is None else folder) / f"autotune-{os.getpid()}-{os.urandom(4).hex()}.board"


def create_board(fallback: Path | None = None) -> Board:
    """A new board in shared memory; where it cannot be made there (no room, no permission), in
    the `fallback` folder (the run folder), said once on stderr. Raises OSError when neither can
    hold it (or there is no fallback)."""
    if fallback is not None:
        remove_stale(fallback, BOARD, claimed=True)  # what earlier runs, killed, left in the run folder
    try:
        return Board(default_path(), create=True)
    except OSError as exc:
        if fallback is None:
            raise
        why = exc
    board = Board(default_path(fallback), create=True)
    warn(f"the monitor's sample board could not be made in {shared_memory_dir()} ({why.strerror or why}; a "
         "container's /dev/shm is 64 MiB unless `docker run --shm-size` says more; AUTOTUNE_SHM_DIR picks another "
         f"folder): it is in the run folder instead ({board.path}), and the monitor works as before",
         key="board in the run folder")
    return board


class Board:
    """A seqlocked slot for one `DeviceSample` (plus the process's own bytes)."""

    def __init__(self, path: Path, create: bool = False):
        self.path = Path(path)
        # Its maker claims it while it lives (stale.py): no sweep, in any PID namespace, removes it.
        self._claim, fd = create_claimed(self.path) if create else (None, os.open(self.path, os.O_RDWR))
        try:
            if create:
                os.ftruncate(fd, SIZE)
                reserve(fd, 0, SIZE, self.path)  # a full tmpfs: an error here, not SIGBUS at the first write
            elif os.fstat(fd).st_size < SIZE:
                raise ValueError(f"{self.path} is not an autotune sample board (too small)")
            self._map = mmap.mmap(fd, SIZE)
        except BaseException:
            if create:
                self.path.unlink(missing_ok=True)  # a board that could not be made leaves no file
                self._claim.release()
            raise
        finally:
            os.close(fd)
        if create:
            _HEADER.pack_into(self._map, 0, _MAGIC, 1, 0)
        elif struct.unpack_from("<I", self._map, 0)[0] != _MAGIC:
            raise ValueError(f"{self.path} is not an autotune sample board")
        self._seq = struct.unpack_from("<Q", self._map, _SEQ_OFFSET)[0]
        self._last_read = 0

    # -- the monitor's side
    def write(self, sample: DeviceSample, process_bytes: int | None, samples_taken: int) -> None:
        self._seq += 1  # odd: a write is in progress
        struct.pack_into("<Q", self._map, _SEQ_OFFSET, self._seq)
        source = SOURCES.index(sample.source) if sample.source in SOURCES else 0
        _PAYLOAD.pack_into(self._map, _HEADER.size, sample.time, _encode(sample.used_bytes),
                           _encode(sample.cap_bytes), _encode(sample.total_bytes), _encode(process_bytes),
                           samples_taken, source)
        self._seq += 1  # even: consistent again
        struct.pack_into("<Q", self._map, _SEQ_OFFSET, self._seq)

    # -- the trainer's side
    def read(self, tries: int = 4) -> tuple[int, DeviceSample, int | None] | None:
        """(sequence, sample, process bytes), or None if nothing was written yet or every try was torn."""
        for _ in range(tries):
            before = struct.unpack_from("<Q", self._map, _SEQ_OFFSET)[0]
            if before == 0:
                return None
            if before % 2:
                continue
            fields = _PAYLOAD.unpack_from(self._map, _HEADER.size)
            if struct.unpack_from("<Q", self._map, _SEQ_OFFSET)[0] != before:
                continue
            when, used, cap, total, process, _taken, source = fields
            sample = DeviceSample(time=when, used_bytes=_decode(used), cap_bytes=_decode(cap),
                                  total_bytes=_decode(total), source=SOURCES[source] if source < len(SOURCES) else "")
            return before, sample, _decode(process)
        return None

    def changed(self) -> bool:
        """Whether a sample was written since the last one `read_new` returned (one read)."""
        return _SEQ.unpack_from(self._map, _SEQ_OFFSET)[0] != self._last_read

    def read_new(self) -> tuple[DeviceSample, int | None] | None:
        """The sample if it is newer than the last one this reader returned, else None (most
        calls, between two samples: one read of the sequence number, under a microsecond)."""
        if not self.changed():
            return None
        got = self.read()
        if got is None or got[0] == self._last_read:
            return None
        self._last_read = got[0]
        return got[1], got[2]

    def close(self, unlink: bool = False) -> None:
        self._map.close()
        if unlink:
            self.path.unlink(missing_ok=True)
        if self._claim is not None:
            self._claim.release()
