"""Reading files that a crash, a user or an attacker may have replaced: regular files only, opened
without blocking on a FIFO and never read from a device (a link to /dev/zero never ends).

Owns nothing; used by the journal's reader and the checkpoint files' checks. Touches only the file it
is asked to open.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import IO


class NotAFile(ValueError):
    """A run's file (the journal, samples.jsonl, a checkpoint's sum) that is not a regular file: a
    FIFO would block the reader, a device (a link to /dev/zero) never ends, a directory has no lines."""


def open_regular(path: Path) -> IO[bytes] | None:
    """`path` opened for reading in binary, or None where there is none; `NotAFile`, naming it,
    unless it is a regular file (opened without blocking: a FIFO's open waits for a writer)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise NotAFile(f"{path} is {kind(mode)}, not a regular file: not read")
    os.set_blocking(fd, True)
    return os.fdopen(fd, "rb")


def kind(mode: int) -> str:
    """What a file that is not a regular one is, in words, from its `st_mode`."""
    return ("a directory" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode)
            else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "a socket")
