"""Files named after the process that made them, left behind when it was killed: the monitor's
sample boards and the sample caches in /dev/shm (`autotune-<pid>-<hex>.board`,
`autotune-cache-<pid>-<hex>`), a checkpoint's temporaries. They are removed at the next start,
once that process is gone, and never while it lives (this process's own included).

A board or a cache is claimed by its maker from its first moment to its removal
(`create_claimed`: a shared flock, taken under a name a sweep leaves alone for a minute, before
the file has its own). A PID says nothing across PID namespaces (containers that share /dev/shm
but not PIDs, `--ipc=host`), but the kernel drops a dead process's flocks in any namespace: a
claimed file stays, whatever its name's PID; an unclaimed one goes when its PID is not running
here, or runs here without the file mapped (another namespace's file whose PID a process here
has; an autotune from before the claims maps its board and cache for as long as it uses them).
Where flock does not work, the PID decides.

    alive(pid)                       whether a process is running (someone else's counts)
    create_claimed(path)             a new file, claimed: (its Claim, a descriptor to use and close)
    remove_stale(folder, pattern)    the files in `folder` whose name's pid (`pattern`'s first
                                     group) is not running (`claimed=True`: the rule above); how
                                     many went (another user's file, which this one may not
                                     remove, is left)
    remove_stale_shared_memory()     the boards and caches in /dev/shm no live process claims
    die_with_parent(parent, _)       a DataLoader worker's init (the loaders autotune builds): the
                                     kernel kills the worker when its trainer ends, however it ends
                                     (kill -9, a second SIGTERM), so a worker stuck in __getitem__
                                     does not outlive it (Linux: PR_SET_PDEATHSIG; elsewhere nothing)

Owns the claims this process holds. Touches those files of dead processes only, and the workers'
death signal.
"""

from __future__ import annotations

import ctypes
import fcntl
import os
import re
import signal
import sys
import tempfile
import time
from pathlib import Path

from autotune.common.notices import warn

BOARD = re.compile(r"^autotune-(\d+)-[0-9a-f]+\.board$")
CACHE = re.compile(r"^autotune-cache-(\d+)-[0-9a-f]+$")
MADE = re.compile(r"^\.autotune-(?:cache-)?(\d+)-[0-9a-f]+(?:\.board)?\.new$")  # one being made (create_claimed)


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


class Claim:
    """This process's claim on a file it made (`create_claimed`): while it is held no sweep, in
    any PID namespace, removes the file. `release()` once the file is removed (more calls, or
    calls in a child made by fork, do nothing); a claim let go of by the garbage collector is
    released too."""

    def __init__(self, fd: int | None):
        self._fd, self._owner = fd, os.getpid()

    def release(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None and self._owner == os.getpid():
            os.close(fd)

    def __del__(self) -> None:
        self.release()


def _claim(fd: int) -> None:
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError:
        return  # no flock on this filesystem (the file is new: nobody else can hold it): the PID decides there


def create_claimed(path: Path, mode: int = 0o600) -> tuple[Claim, int]:
    """A new file at `path` (FileExistsError when there is one), claimed before it has that name,
    so no sweep ever sees it unclaimed: its `Claim` (keep it while the file is in use, release it
    after removing the file) and a read-write descriptor of it, for the caller to use and close."""
    made = path.with_name(f".{path.name}.new")  # `MADE` until named: swept by the same rule
    fd = os.open(made, os.O_CREAT | os.O_EXCL | os.O_RDWR, mode)
    try:
        _claim(fd)
        try:
            os.link(made, path)
        except FileExistsError:
            raise
        except OSError:  # no hard links on this filesystem: the name is random, a rename will do
            os.rename(made, path)
    except BaseException:
        os.close(fd)
        raise
    finally:
        made.unlink(missing_ok=True)
    return Claim(os.dup(fd)), fd


def _maps(pid: int, st: os.stat_result) -> bool:
    """Whether process `pid`, running here, maps the file `st` describes; True where that cannot
    be read (no /proc, another user's process): the PID's word stands."""
    if not alive(pid):
        return False
    if not os.path.exists(f"/proc/{os.getpid()}/maps"):
        return True
    try:
        with open(f"/proc/{pid}/maps") as f:
            lines = f.read().splitlines()
    except FileNotFoundError:
        return False  # ended meanwhile
    except OSError:
        return True
    for line in lines:
        fields = line.split(maxsplit=5)  # address perms offset major:minor inode path
        if len(fields) >= 5 and fields[4] == str(st.st_ino) and ":" in fields[3]:
            major, minor = (int(part, 16) for part in fields[3].split(":"))
            if (major, minor) == (os.major(st.st_dev), os.minor(st.st_dev)):
                return True
    return False


def _unclaimed(path: Path, pid: int) -> bool:
    """Whether `path`, named after `pid`, is no live process's (the module docstring's rule)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except FileNotFoundError:
        return False
    except OSError:  # another user's file: it cannot be tried
        return not alive(pid)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False  # claimed: its maker lives, whatever namespace its PID is in
        except OSError:
            return not alive(pid)  # no flock on this filesystem
        return not _maps(pid, os.fstat(fd))
    finally:
        os.close(fd)


def _older_than(path: Path, seconds: float) -> bool:
    try:
        return time.time() - path.stat().st_mtime > seconds
    except FileNotFoundError:
        return False


def remove_stale(folder: Path, pattern: re.Pattern[str], claimed: bool = False, min_age: float = 0.0) -> int:
    """Remove the files in `folder` whose name matches `pattern` and whose pid (its first group) is
    not running (`claimed`: files made by `create_claimed`, which stay while claimed, see the
    module docstring; `min_age`: and last changed that many seconds ago); returns how many went.
    Another user's file, which this user may not remove (/dev/shm is sticky), is left to its
    owner's next sweep."""
    removed = 0
    if not folder.is_dir():
        return removed
    for path in folder.iterdir():
        match = pattern.match(path.name)
        if not match or (min_age and not _older_than(path, min_age)):
            continue
        pid = int(match.group(1))
        if _unclaimed(path, pid) if claimed else not alive(pid):
            try:
                path.unlink(missing_ok=True)
            except OSError:
                continue  # another user's (in sticky /dev/shm), or a folder: left as it is
            removed += 1
    return removed


def remove_stale_shared_memory(folder: Path | None = None) -> int:
    """The sample boards and caches no live process claims (kill -9, a stuck run's SIGTERM); how many went."""
    folder = shared_memory_dir() if folder is None else folder
    # One being made is claimed a moment after it is: a minute old, its maker was killed in between.
    return (remove_stale(folder, BOARD, claimed=True) + remove_stale(folder, CACHE, claimed=True)
            + remove_stale(folder, MADE, claimed=True, min_age=60.0))


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
