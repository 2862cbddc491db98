"""Files named after the process that made them, left behind when it was killed: the monitor's
sample boards and the sample caches in /dev/shm (`autotune-<pid>-<hex>.board`,
`autotune-cache-<pid>-<hex>`), a checkpoint's temporaries. They are removed at the next start,
once that process is gone, and never while it lives (this process's own included).

    alive(pid)                       whether a process is running (someone else's counts)
    remove_stale(folder, pattern)    the files in `folder` whose name's pid (`pattern`'s first
                                     group) is not running; how many went
    remove_stale_shared_memory()     the boards and caches of dead processes in /dev/shm
    die_with_parent(parent, _)       a DataLoader worker's init (the loaders autotune builds): the
                                     kernel kills the worker when its trainer ends, however it ends
                                     (kill -9, a second SIGTERM), so a worker stuck in __getitem__
                                     does not outlive it (Linux: PR_SET_PDEATHSIG; elsewhere nothing)

Owns nothing. Touches those files of dead processes only, and the workers' death signal.
"""

from __future__ import annotations

import ctypes
import os
import re
import signal
import sys
import tempfile
from pathlib import Path

from autotune.notices import warn

BOARD = re.compile(r"^autotune-(\d+)-[0-9a-f]+\.board$")
CACHE = re.compile(r"^autotune-cache-(\d+)-[0-9a-f]+$")


SHM_DIR_VARIABLE = "AUTOTUNE_SHM_DIR"


def shared_memory_dir() -> Path:
    """Where boards and caches are made: $AUTOTUNE_SHM_DIR when set (a bigger tmpfs than a
    container's 64 MiB /dev/shm, or a small one in a test), else /dev/shm when writable, else
    the temporary folder."""
    chosen = os.environ.get(SHM_DIR_VARIABLE)
    if chosen:
        if os.path.isdir(chosen) and os.access(chosen, os.W_OK):
            return Path(chosen)
        warn(f"{SHM_DIR_VARIABLE}={chosen!r} is not a folder this process can write to: boards and caches go to "
             "the default place (/dev/shm)", key=SHM_DIR_VARIABLE)
    shm = Path("/dev/shm")
    return shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())


def alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def remove_stale(folder: Path, pattern: re.Pattern[str]) -> int:
    """Remove the files in `folder` whose name matches `pattern` and whose pid (its first group) is
    not running; returns how many went."""
    removed = 0
    if not folder.is_dir():
        return removed
    for path in folder.iterdir():
        match = pattern.match(path.name)
        if match and not alive(int(match.group(1))):
            path.unlink(missing_ok=True)
            removed += 1
    return removed


def remove_stale_shared_memory(folder: Path | None = None) -> int:
    """The sample boards and caches of dead processes (kill -9, a stuck run's SIGTERM); how many went."""
    folder = shared_memory_dir() if folder is None else folder
    return remove_stale(folder, BOARD) + remove_stale(folder, CACHE)


_PR_SET_PDEATHSIG = 1


def die_with_parent(parent: int, worker_id: int) -> None:
    """In a DataLoader worker (`worker_init_fn`, with `parent` bound: the trainer's PID): SIGKILL
    once the trainer's thread that started the worker ends. A trainer gone before this ran
    (the worker was reparented) ends the worker now."""
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) != 0:
        return  # a sandbox refusing prctl: the worker lives as torch made it
    if os.getppid() != parent:
        os._exit(1)
