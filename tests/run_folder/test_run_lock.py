"""run_lock.py: one writer per run folder, with real processes: a second process is refused before it
writes anything, naming the folder and the holder's PID; a holder killed with SIGKILL leaves a lock the
next process takes over with a word; a closed run leaves the folder free and says nothing. Neither a
deleted lock file nor a forked child that exits undoes a hold; a filesystem without flock gets a PID
file; a folder moved under a run stops it at its next checkpoint."""

import errno
import fcntl
import os
import signal
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import python

from autotune.run_folder.run_lock import LOCK_NAME, PID_NAME, RunDirInUse, RunDirLost, _started, still_held, take

HOLDER = """
import sys, time
from pathlib import Path
import torch
from autotune import Tuner
tuner = Tuner(torch.nn.Linear(2, 2), device="cpu", run_dir=sys.argv[1], monitor=False)
Path(sys.argv[2]).write_text("holding")
time.sleep(120)
"""

SECOND = """
import sys, torch
from autotune import Tuner
from autotune.run_folder.run_lock import RunDirInUse
try:
    tuner = Tuner(torch.nn.Linear(2, 2), device="cpu", run_dir=sys.argv[1], monitor=False)
except RunDirInUse as exc:
    print("refused:", exc)
    sys.exit(3)
tuner.close()
print("took it")
"""


def _start_holder(tmp_path: Path, run_dir: Path) -> subprocess.Popen:
    ready = tmp_path / "ready"
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(run_dir), str(ready)], stderr=subprocess.PIPE,
                              text=True)
    deadline = time.monotonic() + 120
    while not ready.exists():
        assert holder.poll() is None, holder.stderr.read()
        assert time.monotonic() < deadline, "the holder never started"
        time.sleep(0.1)
    return holder


def _second(run_dir: Path) -> subprocess.CompletedProcess:
    return python(["-c", SECOND, str(run_dir)], run_dir.parent, {}, timeout=120)


@pytest.mark.slow  # three interpreters, one killed
def test_a_second_process_is_refused_and_a_killed_holders_lock_is_taken_over(tmp_path):
    run_dir = tmp_path / "run"
    holder = _start_holder(tmp_path, run_dir)
    try:
        before = sorted(p.name for p in run_dir.iterdir())
        refused = _second(run_dir)
        assert refused.returncode == 3, refused.stderr[-2000:]
        assert f"{run_dir} is being written by another process (PID {holder.pid})" in refused.stdout
        assert sorted(p.name for p in run_dir.iterdir()) == before  # the refused one wrote nothing
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    # The kernel let go of the dead holder's lock; its PID still in the file says it never closed.
    took = _second(run_dir)
    assert took.returncode == 0 and "took it" in took.stdout, took.stderr[-2000:]
    assert f"(PID {holder.pid}) ended without closing it" in took.stderr
    # That run closed: the next one takes the folder without a word.
    again = _second(run_dir)
    assert again.returncode == 0 and "ended without closing" not in again.stderr, again.stderr[-2000:]
    assert (run_dir / LOCK_NAME).read_text() == ""


def test_in_one_process_a_second_tuner_shares_the_hold_until_the_last_closes(tmp_path):
    first, second = take(tmp_path / "run"), take(tmp_path / "run")
    first.release()
    assert (tmp_path / "run" / LOCK_NAME).read_text().strip() == str(os.getpid())  # still held
    second.release()
    second.release()  # once is enough
    assert (tmp_path / "run" / LOCK_NAME).read_text() == ""


@pytest.mark.slow
def test_the_refusal_names_the_folder(tmp_path):
    holder = _start_holder(tmp_path, tmp_path / "run")
    try:
        try:
            take(tmp_path / "run")
        except RunDirInUse as exc:
            assert str(tmp_path / "run") in str(exc) and str(holder.pid) in str(exc)
        else:
            raise AssertionError("a held folder was taken")
    finally:
        holder.kill()
        holder.wait()


# Issue 56: a lock no delete, fork or filesystem undoes. These holders import autotune.run_folder.run_lock
# alone (no torch): a fraction of a second each.
LIGHT_HOLDER = """
import errno, fcntl, os, sys, time
from pathlib import Path
if sys.argv[3] == "no flock":  # as Lustre without -o flock answers
    def _no_flock(*args):
        raise OSError(errno.ENOLCK, "No locks available")
    fcntl.flock = _no_flock
from autotune.run_folder.run_lock import take
lock = take(Path(sys.argv[1]))
if sys.argv[3] == "fork":  # a helper that ends normally: its atexit runs, and it even releases
    child = os.fork()
    if child == 0:
        lock.release()
        sys.exit(0)
    assert os.waitpid(child, 0)[1] == 0
Path(sys.argv[2]).write_text("holding")
time.sleep(60)
"""

LIGHT_SECOND = """
import errno, fcntl, sys
from pathlib import Path
if sys.argv[2] == "no flock":
    def _no_flock(*args):
        raise OSError(errno.ENOLCK, "No locks available")
    fcntl.flock = _no_flock
from autotune.run_folder.run_lock import RunDirInUse, take
try:
    lock = take(Path(sys.argv[1]))
except RunDirInUse as exc:
    print("refused:", exc)
    sys.exit(3)
lock.release()
print("took it")
"""


def _light_holder(tmp_path: Path, run_dir: Path, how: str = "") -> subprocess.Popen:
    ready = tmp_path / "ready"
    ready.unlink(missing_ok=True)
    holder = subprocess.Popen([sys.executable, "-c", LIGHT_HOLDER, str(run_dir), str(ready), how],
                              stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not ready.exists():
        assert holder.poll() is None, holder.stderr.read()
        assert time.monotonic() < deadline, "the holder never started"
        time.sleep(0.02)
    return holder


def _light_second(run_dir: Path, how: str = "") -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", LIGHT_SECOND, str(run_dir), how], capture_output=True, text=True,
                          timeout=60)


def _stop(holder: subprocess.Popen) -> str:
    holder.kill()
    return holder.communicate()[1]


def test_deleting_the_lock_file_under_a_live_holder_lets_no_second_writer_in(tmp_path):
    # On 98d9912 the second made a new .lock, locked it and went on beside the first.
    run_dir = tmp_path / "run"
    holder = _light_holder(tmp_path, run_dir)
    try:
        (run_dir / LOCK_NAME).unlink()  # "a stale lock", thinks the user
        refused = _light_second(run_dir)
        assert refused.returncode == 3, refused.stdout + refused.stderr
        assert f"{run_dir} is being written by another process (PID unknown: {run_dir / LOCK_NAME}, which names " \
               "it, was deleted)" in refused.stdout
        assert not (run_dir / LOCK_NAME).exists()  # the refused one wrote nothing
    finally:
        _stop(holder)
    took = _light_second(run_dir)  # once the holder is gone the folder is free
    assert took.returncode == 0, took.stderr


def test_a_forked_child_that_exits_normally_leaves_its_parents_hold(tmp_path):
    # On 98d9912 the child's release (and its atexit) emptied the file and unlocked the flock it
    # shares with its parent: the second took the folder beside the first.
    run_dir = tmp_path / "run"
    holder = _light_holder(tmp_path, run_dir, "fork")
    try:
        refused = _light_second(run_dir)
        assert refused.returncode == 3, refused.stdout + refused.stderr
        assert f"(PID {holder.pid})" in refused.stdout
        assert (run_dir / LOCK_NAME).read_text() == f"{holder.pid}\n"
    finally:
        _stop(holder)


def test_without_flock_a_pid_file_holds_the_folder_with_a_word(tmp_path):
    # On 98d9912 every run failed at construction: OSError [Errno 37] No locks available.
    run_dir = tmp_path / "run"
    holder = _light_holder(tmp_path, run_dir, "no flock")
    try:
        refused = _light_second(run_dir, "no flock")
        assert refused.returncode == 3, refused.stdout + refused.stderr
        assert f"is being written by another process (PID {holder.pid})" in refused.stdout
    finally:
        said = _stop(holder)  # SIGKILL: its PID file stays
    assert said.count("does not lock files") == 1 and "No locks available" in said
    assert (run_dir / PID_NAME).read_text().split()[:2] == [str(holder.pid), socket.gethostname()]
    took = _light_second(run_dir, "no flock")
    assert took.returncode == 0, took.stderr
    assert f"(PID {holder.pid}) ended without closing it" in took.stderr
    assert not (run_dir / PID_NAME).exists() and (run_dir / LOCK_NAME).read_text() == ""  # closed: let go


def _no_flock(monkeypatch, only_folders=False):
    real = fcntl.flock

    def flock(fd, operation):
        if only_folders and not stat.S_ISDIR(os.fstat(fd if isinstance(fd, int) else fd.fileno()).st_mode):
            return real(fd, operation)
        raise OSError(errno.EBADF if only_folders else errno.ENOLCK, "refused")  # NFS: EBADF on a folder

    monkeypatch.setattr(fcntl, "flock", flock)


def test_a_pid_file_of_a_live_process_is_taken_over_only_when_that_pid_is_another_process_now(tmp_path, monkeypatch):
    _no_flock(monkeypatch)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        host = socket.gethostname()
        (run_dir / PID_NAME).write_text(f"{other.pid} {host} {_started(other.pid)}\n")
        with pytest.raises(RunDirInUse, match=f"another process \\(PID {other.pid}\\)"):
            take(run_dir)
        (run_dir / PID_NAME).write_text(f"{other.pid} {host} another-boot:1\n")  # its PID, given again since
        take(run_dir).release()
        (run_dir / PID_NAME).write_text(f"{other.pid} elsewhere x:1\n")
        with pytest.raises(RunDirInUse, match=f"PID {other.pid} on elsewhere, which this host cannot check"):
            take(run_dir)
    finally:
        other.kill()
        other.wait()


def test_a_folder_moved_or_made_again_under_a_run_stops_it_at_its_next_checkpoint(tmp_path):
    run_dir, moved = tmp_path / "run", tmp_path / "moved"
    lock = take(run_dir)
    try:
        assert still_held(run_dir)
        run_dir.rename(moved)
        run_dir.mkdir()  # a new run could take this one
        with pytest.raises(RunDirLost, match=f"{run_dir} was moved or deleted and made again"):
            still_held(run_dir)
        assert not still_held(run_dir)  # said once; nothing written there after
        again = take(run_dir)  # this folder is a new one: held anew
        assert still_held(run_dir)
        again.release()
    finally:
        lock.release()
    assert (moved / LOCK_NAME).read_text() == ""


def test_where_the_lock_file_is_the_lock_deleting_it_stops_the_run_at_its_next_checkpoint(tmp_path, monkeypatch):
    _no_flock(monkeypatch, only_folders=True)  # NFS: a folder cannot be flocked, a file can
    run_dir = tmp_path / "run"
    lock = take(run_dir)
    try:
        assert still_held(run_dir)
        (run_dir / LOCK_NAME).unlink()
        with pytest.raises(RunDirLost, match=f"{run_dir / LOCK_NAME}, which held it on this filesystem, was deleted"):
            still_held(run_dir)
    finally:
        lock.release()


class _MoveTheFolder:
    """What a user does by hand: the run folder moved away, and made again (a new run could take it)."""

    def __init__(self, run_dir, at_step):
        self.run_dir, self.at_step = run_dir, at_step

    def on_step_end(self, trainer):
        if trainer.step == self.at_step:
            self.run_dir.rename(self.run_dir.with_name("moved"))
            self.run_dir.mkdir()


def test_a_run_whose_folder_is_moved_stops_before_writing_a_checkpoint_into_the_new_one(tmp_path):
    import torch
    from torch.utils.data import TensorDataset

    from autotune import AutoTrainer

    run_dir = tmp_path / "run"
    data = TensorDataset(torch.randn(64, 4), torch.randn(64, 1))
    trainer = AutoTrainer(torch.nn.Linear(4, 1), data, loss_fn=torch.nn.functional.mse_loss, batch_size=8,
                          device="cpu", progress=False, monitor=False, checkpoint_interval=None, checkpoint_every=2,
                          run_dir=run_dir, callbacks=[_MoveTheFolder(run_dir, 3)])
    with pytest.raises(RunDirLost, match="was moved or deleted and made again"):
        trainer.fit(epochs=1)
    trainer.close()
    assert [p.name for p in (tmp_path / "moved" / "checkpoints").glob("step-*.pt")] == ["step-000000002.pt"]
    assert not (run_dir / "checkpoints").exists() or not list((run_dir / "checkpoints").iterdir())


def test_without_flock_of_processes_starting_at_once_one_takes_the_folder(tmp_path):
    # The PID file is made whole by a hard link, and a dead holder's is moved aside and checked to be
    # the one read before it is replaced: never two holders, whichever order the calls interleave in.
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / PID_NAME).write_text(f"{_dead_pid()} {socket.gethostname()} \n")  # killed: to be taken over
    ready = [tmp_path / f"ready{i}" for i in range(4)]
    starts = [subprocess.Popen([sys.executable, "-c", LIGHT_HOLDER, str(run_dir), str(r), "no flock"],
                               stderr=subprocess.PIPE, text=True) for r in ready]
    try:
        deadline = time.monotonic() + 60
        while not all(r.exists() or p.poll() is not None for p, r in zip(starts, ready)):
            assert time.monotonic() < deadline
            time.sleep(0.02)
        (holder,) = [p for p, r in zip(starts, ready) if r.exists()]
        for refused in (p for p in starts if p is not holder):
            assert refused.wait() == 1 and "RunDirInUse" in refused.stderr.read()
        assert (run_dir / PID_NAME).read_text().split()[0] == str(holder.pid)
    finally:
        for p in starts:
            p.kill()
            p.wait()


def _dead_pid() -> int:
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    return int(done.stdout)


@pytest.mark.parametrize("planted", ["symlink", "directory", "fifo"])
def test_a_lock_file_that_is_not_a_file_is_refused_by_name_and_never_written_through(tmp_path, planted):
    # A .lock planted in a shared runs folder: a link made the run empty the file it points to (as root, any
    # file); a directory or a FIFO ended the run with a bare os error.
    from autotune.run_folder.run_lock import NotALockFile, take

    run_dir, victim = tmp_path / "run", tmp_path / "victim.txt"
    run_dir.mkdir()
    victim.write_text("important data\n")
    {"symlink": lambda p: p.symlink_to(victim), "directory": lambda p: p.mkdir(),
     "fifo": lambda p: os.mkfifo(p)}[planted](run_dir / ".lock")
    what = {"symlink": "a symbolic link", "directory": "a directory", "fifo": "a FIFO"}[planted]
    with pytest.raises(NotALockFile, match=f"{run_dir / '.lock'} is {what}, not the lock file autotune makes"):
        take(run_dir)
    assert victim.read_text() == "important data\n"
