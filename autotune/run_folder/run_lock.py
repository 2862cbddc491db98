"""One writer per run folder, held by the process that writes the run (rank 0 under torchrun) from
its Tuner's start to its close, or to the process's end.

    hold_run_dir(run_dir, ranks)   before anything is written: a second process is refused
                                   (`RunDirInUse`, naming the folder and the holder's PID) on every
                                   rank; a lock whose holder died without letting go (kill -9) is
                                   taken over, said once on stderr; the shared
                                   memory of killed runs is removed (stale.py)
    still_held(run_dir)            at each checkpoint (rank 0): `RunDirLost` once the hold was
                                   undone (the folder moved or deleted; the lock file, where it is
                                   the lock, deleted), so nothing is written into another run's
    RunLock.release()              at close: the PID cleared, the lock let go (at exit too)

The lock is an flock on the run folder itself (its own descriptor): deleting `RUN_DIR/.lock`,
which only names the holder's PID, undoes nothing. The `.lock` file is flocked too, as an older
autotune's lock, so that an older autotune and this one refuse each other. The kernel lets go of an
flock when its holder dies, so a lock that can be taken is free, whatever the file says; the PID
in it only tells whether the last holder ended without closing. A filesystem that refuses an
flock on a folder (NFS) leaves the `.lock` file's; one that refuses both (Lustre without
`-o flock`) gets a PID file, `RUN_DIR/.lock.pid` (PID, host, the process's start), made with a hard
link (atomic on NFS too) and taken over once that process is gone from this host, said once on stderr.

A hold is this process's: a child made by fork forgets it (closes its copies, never unlocks), and
release in any other process than the one that took it does nothing. Within one process a second
Tuner on the same folder shares the hold (a notebook cell run again builds its trainer while the
old one is still bound): the refusal is for another process.

Owns `RUN_DIR/.lock`, `RUN_DIR/.lock.pid` and this process's holds. Touches the shared memory of
dead processes (at a run's start, through stale.py).
"""

from __future__ import annotations

import atexit
import errno
import fcntl
import os
import socket
import stat
from pathlib import Path
from typing import Any

from autotune.common.files import kind
from autotune.common.notices import warn
from autotune.common.stale import alive, remove_stale_shared_memory

LOCK_NAME = ".lock"
PID_NAME = ".lock.pid"


class RunDirInUse(RuntimeError):
    """Another process is writing this run folder (its PID in the message): raised by the Tuner or
    AutoTrainer before anything is written, on every rank. Wait for that run to end, or use another
    `run_dir`. A holder killed with SIGKILL lets go of the folder (the kernel drops its lock)."""


class RunDirLost(RuntimeError):
    """This run's hold on its folder was undone while it ran (the folder was moved or deleted, or
    the lock file that held it was): raised at the next checkpoint, before anything is written,
    since another run may now write there. The message says what changed."""


def _flock(fd: int) -> bool | OSError:
    """True: taken; False: another holds it; an OSError: this filesystem has no flock (ENOLCK,
    EOPNOTSUPP, EINVAL, NFS's EBADF on a folder): the caller falls back rather than fail every run."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    except OSError as exc:
        return exc
    return True


def _identity(path: Path | int) -> tuple[int, int] | None:
    try:
        st = os.fstat(path) if isinstance(path, int) else os.stat(path)
    except FileNotFoundError:
        return None
    return st.st_dev, st.st_ino


class NotALockFile(RunDirInUse):
    """The run folder's `.lock` (or `.lock.pid`) is not a file autotune makes: a symbolic link, a
    directory, a FIFO, a device. It is neither followed nor written (a link planted in a shared
    folder would have a run empty the file it points to); the message names it."""


# Never through a symbolic link, never blocking on a FIFO: what is opened is checked to be a plain file.
_OPEN_FLAGS = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


def _open_lock_file(path: Path, flags: int) -> int:
    """`path` opened with `flags` (and `_OPEN_FLAGS`), refused (`NotALockFile`, naming it) unless a
    regular file."""
    try:
        fd = os.open(path, flags | _OPEN_FLAGS, 0o644)
    except OSError as exc:
        if exc.errno not in (errno.ELOOP, errno.EISDIR):
            raise
        what = "a symbolic link" if exc.errno == errno.ELOOP else "a directory"
        raise _not_a_lock_file(path, what) from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise _not_a_lock_file(path, kind(mode))
    os.set_blocking(fd, True)
    return fd


def _not_a_lock_file(path: Path, what: str) -> NotALockFile:
    return NotALockFile(f"{path} is {what}, not the lock file autotune makes: refused, neither followed nor written. "
                        "Remove it (no run's lock is a link, a folder or a FIFO) and start again")


def _read(path: Path) -> str:
    try:
        fd = _open_lock_file(path, os.O_RDONLY)
    except FileNotFoundError:
        return ""
    with os.fdopen(fd, "rb") as f:
        return f.read(200).decode(errors="replace").strip()


class _Hold:
    """What this process holds on one folder; every field is for the process in `owner` only."""

    def __init__(self, run_dir: Path, key: str):
        self.run_dir, self.key, self.names = run_dir, key, {os.path.abspath(run_dir)}
        self.owner, self.holders, self.lost = os.getpid(), 0, False
        self.folder = _identity(run_dir)  # the folder as it was taken: moved or made again, it is another
        self.dir_fd: int | None = None  # flocked: the lock
        self.lock_fd: int | None = None  # RUN_DIR/.lock: the PID's text; the lock where dir_fd is None
        self.lock_flocked = False
        self.pid_file: tuple[int, int] | None = None  # RUN_DIR/.lock.pid's identity, where nothing flocks

    def undone(self) -> str | None:
        """What undid this hold, or None while it holds."""
        now = _identity(self.run_dir)
        if now is None:
            return f"{self.run_dir} was deleted"
        if now != self.folder:
            return f"{self.run_dir} was moved or deleted and made again"
        if self.dir_fd is not None:
            return None  # the folder's own lock: deleting .lock undoes nothing
        if self.lock_flocked and _identity(self.run_dir / LOCK_NAME) != _identity(self.lock_fd):
            return f"{self.run_dir / LOCK_NAME}, which held it on this filesystem, was deleted or replaced"
        if self.pid_file is not None and _identity(self.run_dir / PID_NAME) != self.pid_file:
            return f"{self.run_dir / PID_NAME}, which held it on this filesystem, was deleted or replaced"
        return None

    def let_go(self) -> None:
        if self.owner != os.getpid():
            return
        if self.pid_file is not None and _identity(self.run_dir / PID_NAME) == self.pid_file:
            (self.run_dir / PID_NAME).unlink(missing_ok=True)
        self.pid_file = None
        if self.lock_fd is not None:
            os.ftruncate(self.lock_fd, 0)  # cleared first: a PID left in it says its holder ended without closing
        self._close(unlock=True)

    def forget(self) -> None:
        """In a child made by fork: close the copies, never unlock (the lock is the parent's:
        an flock belongs to the open file, which parent and child share)."""
        self.owner = -1
        self._close(unlock=False)

    def _close(self, unlock: bool) -> None:
        for fd, flocked in ((self.lock_fd, self.lock_flocked), (self.dir_fd, True)):  # dir_fd is kept only flocked
            if fd is not None:
                if unlock and flocked:
                    fcntl.flock(fd, fcntl.LOCK_UN)
                os.close(fd)
        self.lock_fd = self.dir_fd = None


_holds: dict[str, _Hold] = {}  # this process's, by the folder's resolved path


class RunLock:
    """This process's hold on a run folder; `release()` once (more calls, or calls in a child made
    by fork, do nothing)."""

    def __init__(self, hold: _Hold | None):
        self._hold = hold  # None: nothing held

    def release(self) -> None:
        hold, self._hold = self._hold, None
        if hold is None or hold.owner != os.getpid():
            return
        hold.holders -= 1
        if hold.holders <= 0:
            if _holds.get(hold.key) is hold:
                del _holds[hold.key]
            hold.let_go()


def _release_all() -> None:
    for key in list(_holds):
        _holds.pop(key).let_go()  # only the owner's: a forked child's copies were forgotten at the fork


def _forget_in_child() -> None:
    for hold in _holds.values():
        hold.forget()
    _holds.clear()


atexit.register(_release_all)
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)


def _refusal(run_dir: Path, holder: str) -> RunDirInUse:
    return RunDirInUse(f"{run_dir} is being written by another process (PID {holder}): a run folder takes one "
                       "writer. Wait for that run to end, or give this one another run_dir")


def _holder(run_dir: Path) -> str:
    # What .lock says: read without creating it, so a refused process writes nothing.
    if not (run_dir / LOCK_NAME).exists():
        return f"unknown: {run_dir / LOCK_NAME}, which names it, was deleted"
    return _read(run_dir / LOCK_NAME) or "unknown"


def take(run_dir: Path) -> RunLock:
    """Hold `run_dir` for this process (creating it); `RunDirInUse` when another process does."""
    run_dir.mkdir(parents=True, exist_ok=True)
    key = str(run_dir.resolve())
    hold = _holds.get(key)
    if hold is not None and hold.undone() is None:
        hold.holders += 1
        hold.names.add(os.path.abspath(run_dir))
        return RunLock(hold)
    hold = _holds[key] = _acquire(run_dir, key)  # an undone one is left to its trainers' next checkpoint
    hold.holders = 1
    return RunLock(hold)


def _acquire(run_dir: Path, key: str) -> _Hold:
    hold = _Hold(run_dir, key)
    try:
        try:
            hold.dir_fd = os.open(run_dir, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
        except OSError:
            dir_taken: bool | OSError = OSError("the folder cannot be opened")
        else:
            dir_taken = _flock(hold.dir_fd)
            if dir_taken is False:
                raise _refusal(run_dir, _holder(run_dir))
        if dir_taken is not True and hold.dir_fd is not None:
            os.close(hold.dir_fd)
            hold.dir_fd = None
        hold.lock_fd = _open_lock_file(run_dir / LOCK_NAME, os.O_RDWR | os.O_CREAT)  # never truncated before it is ours
        file_taken = _flock(hold.lock_fd)
        if file_taken is False:  # an autotune from before the folder's own lock holds it
            raise _refusal(run_dir, _holder(run_dir))
        hold.lock_flocked = file_taken is True
        # Read through the locked descriptor: on NFS an flock is a POSIX lock, which closing any other
        # descriptor of the file in this process would let go of.
        previous = os.pread(hold.lock_fd, 200, 0).decode(errors="replace").strip()
        if hold.dir_fd is None and not hold.lock_flocked:
            warn(f"{run_dir}: this filesystem does not lock files (flock: {file_taken}); the run folder is held by "
                 f"a PID file instead, {run_dir / PID_NAME}, which a process on this host only takes once its "
                 "holder is gone. Delete it by hand only when no run writes this folder",
                 key=f"run lock pid file {key}")
            previous = _take_pid_file(run_dir, hold) or previous
    except BaseException:
        hold._close(unlock=False)  # closing lets go of what was taken: these descriptors are the only ones
        raise
    if previous and previous.split()[0] != str(os.getpid()):
        warn(f"{run_dir}: the process that last wrote this run (PID {previous.split()[0]}) ended without closing "
             "it (killed?); this process takes the folder over", key=f"run lock {key}")
    os.ftruncate(hold.lock_fd, 0)
    os.pwrite(hold.lock_fd, f"{os.getpid()}\n".encode(), 0)
    return hold


def _started(pid: int) -> str:
    """When process `pid` started (this boot's id and its start in clock ticks), so that a PID the
    system gave again to another process is not taken for the holder; "" where /proc cannot say."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return ""
    return f"{boot}:{stat[stat.rindex(')') + 2:].split()[19]}"


def _take_pid_file(run_dir: Path, hold: _Hold) -> str | None:
    """Where nothing flocks: make RUN_DIR/.lock.pid ours, taking over one whose process is gone
    from this host; the PID of a holder taken over, or None. `RunDirInUse` while it lives."""
    path, host = run_dir / PID_NAME, socket.gethostname()
    previous = None
    for _ in range(8):
        made = _create_exclusive(path, f"{os.getpid()} {host} {_started(os.getpid())}\n")
        if made is not None:
            hold.pid_file = made
            return previous
        seen = _identity(path)
        text = _read(path).split()
        if seen is None:
            continue  # let go of between the two calls: try again
        if len(text) not in (2, 3) or not text[0].isdigit():
            raise RunDirInUse(f"{run_dir} is held by {path}, which does not name a process ({' '.join(text)!r}): "
                              "delete it if no run writes this folder")
        pid, started = int(text[0]), text[2] if len(text) == 3 else ""
        if text[1] != host:
            raise RunDirInUse(f"{run_dir} is being written by another process (PID {pid} on {text[1]}, which "
                              f"this host cannot check): a run folder takes one writer. Delete {path} only if that "
                              "run has ended")
        if pid != os.getpid() and alive(pid) and (not started or _started(pid) in ("", started)):
            raise _refusal(run_dir, str(pid))
        # Gone: moved aside, then checked to be the file just read (another may have taken over between).
        aside = path.with_name(f"{PID_NAME}.{os.getpid()}.dead")
        try:
            os.rename(path, aside)
        except FileNotFoundError:
            continue
        if _identity(aside) != seen:
            # A new holder's: put back. Where yet another was made meanwhile, the link fails and the
            # holder whose file this is finds it replaced at its next checkpoint, and stops.
            try:
                os.link(aside, path)
            except FileExistsError:
                warn(f"{run_dir}: two processes took {path} at once; the one made first stops at its next "
                     "checkpoint", key=f"run lock pid file race {run_dir}")
        else:
            previous = str(pid)
        aside.unlink(missing_ok=True)
    raise RunDirInUse(f"{run_dir}: {path} kept changing hands while this process tried to take it; try again")


def _create_exclusive(path: Path, text: str) -> tuple[int, int] | None:
    """`path` made holding `text`, whole from its first moment (a hard link to a written file): its
    identity, or None when it exists."""
    new = path.with_name(f"{path.name}.{os.getpid()}.new")
    new.write_text(text)
    try:
        made = _identity(new)
        try:
            os.link(new, path)
        except FileExistsError:
            return None
        except OSError:  # no hard links on this filesystem: made and written, a moment empty
            try:
                fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                return None
            with os.fdopen(fd, "w") as f:
                f.write(text)
            made = _identity(path)
        return made
    finally:
        new.unlink(missing_ok=True)


def _find(run_dir: Path) -> _Hold | None:
    hold = _holds.get(str(run_dir.resolve()))
    if hold is None:
        name = os.path.abspath(run_dir)
        hold = next((h for h in _holds.values() if name in h.names), None)
    return hold


def still_held(run_dir: Path) -> bool:
    """Before a checkpoint is written into `run_dir` (rank 0): True while this process's hold on it
    is intact, or where it holds nothing there (another rank, a folder no lock was taken on).
    The first time the hold is found undone: `RunDirLost`, naming what changed; False after
    (nothing is written there, and the error was raised once)."""
    hold = _find(run_dir)
    if hold is None or hold.owner != os.getpid():
        return True
    if hold.lost:
        return False
    why = hold.undone()
    if why is None:
        return True
    hold.lost = True
    raise RunDirLost(f"this run's hold on its folder was undone: {why}. Another run may now write there, so this "
                     "one stops before writing anything more into it (its checkpoints so far went with the folder). "
                     "Never move or delete a run folder, or its lock file, while a run writes it")


def hold_run_dir(run_dir: Path, ranks: Any) -> RunLock:
    """Rank 0 holds `run_dir` (`take`); under torchrun its refusal reaches every rank, so none goes on
    to wait in a collective for a rank 0 that stopped. The other ranks hold nothing (a RunLock
    whose `release` does nothing)."""
    lock, refusal = RunLock(None), None
    if ranks.is_main:
        try:
            lock = take(run_dir)
        except RunDirInUse as exc:
            refusal = str(exc)
        remove_stale_shared_memory()  # the sample boards and caches of runs killed before they could
    refusal = ranks.broadcast_object(refusal)  # alone: its own
    if refusal is not None:
        raise RunDirInUse(refusal)
    return lock
