"""run_lock.py: one writer per run folder, with real processes: a second process is refused before it
writes anything, naming the folder and the holder's PID; a holder killed with SIGKILL leaves a lock the
next process takes over with a word; a closed run leaves the folder free and says nothing."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from autotune.run_lock import LOCK_NAME, RunDirInUse, take

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
from autotune.run_lock import RunDirInUse
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
    return subprocess.run([sys.executable, "-c", SECOND, str(run_dir)], capture_output=True, text=True, timeout=120)


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
