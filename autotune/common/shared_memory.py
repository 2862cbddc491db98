"""Room for a shared mapping that is really there before anything is written through it.

A file in /dev/shm (tmpfs) made with `ftruncate` is sparse: its pages are found only when first
written. When the filesystem is full by then (a container's /dev/shm is 64 MiB), a write through
a mapping of the file is SIGBUS, which kills the process with no word and no checkpoint. A
`write()` or `posix_fallocate` into the same full filesystem is an ENOSPC error instead, which can
be caught. `reserve` allocates a range of the file first, so the only writes through the mapping
land on pages that exist.

    reserve(fd, offset, length, path)   allocate [offset, offset + length) of the file, or raise
                                        NoRoom (ENOSPC, EDQUOT or ENOMEM: the filesystem or the
                                        memory cgroup has no room) or the OSError as it came

Owns nothing. Touches only the file whose descriptor it is given.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

# What a full tmpfs (ENOSPC), a quota (EDQUOT) or a memory cgroup at its limit (ENOMEM: tmpfs pages
# are charged to it) answer.
_NO_ROOM = frozenset({errno.ENOSPC, errno.EDQUOT, errno.ENOMEM})
# A filesystem that cannot allocate ahead (some FUSE and network filesystems): zeros are written instead.
_NOT_SUPPORTED = frozenset({errno.EOPNOTSUPP, errno.ENOTSUP, errno.EINVAL, errno.ENOSYS})
_ZEROS = 1 << 20


class NoRoom(OSError):
    """The filesystem (or the memory cgroup its pages are charged to) has no room for the range."""


def no_room(exc: BaseException) -> bool:
    """Whether `exc` says the filesystem has no room (as opposed to a permission or a bad path)."""
    return isinstance(exc, OSError) and exc.errno in _NO_ROOM


def reserve(fd: int, offset: int, length: int, path: Path | str) -> None:
    """Allocate bytes [offset, offset + length) of the file open as `fd` (`path` names it in errors).

    Raises NoRoom when there is no room for them, and any other OSError as it came.
    """
    if length <= 0:
        return
    try:
        if hasattr(os, "posix_fallocate"):
            try:
                os.posix_fallocate(fd, offset, length)
                return
            except OSError as exc:
                if exc.errno not in _NOT_SUPPORTED:
                    raise
        _write_zeros(fd, offset, length)
    except OSError as exc:
        if exc.errno in _NO_ROOM:
            raise NoRoom(exc.errno, f"no room for {length} bytes at offset {offset} ({os.strerror(exc.errno)})",
                         str(path)) from None
        raise


def _write_zeros(fd: int, offset: int, length: int) -> None:
    # Only for a range nothing was written to yet (the callers reserve before they write).
    zeros = bytes(min(length, _ZEROS))
    end = offset + length
    while offset < end:
        offset += os.pwrite(fd, zeros[:end - offset], offset)
