"""stale.py: the shared memory a killed run leaves (the monitor's board, a sample cache) is removed at
the next start, never a live process's: a real run killed with SIGKILL, then another run. A file its
maker claims stays whatever PID its name says (another PID namespace's); an unclaimed one goes unless
the process its name names maps it."""

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from tests.conftest import python

from autotune.common.stale import remove_stale_shared_memory, shared_memory_dir

RUN = """
import os, sys, time
from pathlib import Path
import torch
from autotune import Tuner
from autotune.data.cache import SampleCache
tuner = Tuner(torch.nn.Linear(2, 2), device="cpu", run_dir=sys.argv[1])
from autotune.common.stale import shared_memory_dir
while not list(shared_memory_dir().glob(f"autotune-{os.getpid()}-*.board")):  # the monitor starts at a later batch
    tuner.step((torch.randn(4, 2), torch.randn(4, 2)), lambda m, b: ((m(b[0]) - b[1]) ** 2).mean())
    time.sleep(0.05)
cache = SampleCache(4, 1 << 16)
Path(sys.argv[2]).write_text(str(cache.path))
time.sleep(120)
"""


def _dead_pid() -> int:
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    return int(done.stdout)


MAPS = """
import mmap, os, sys
from pathlib import Path
maps = []
for name in sys.argv[2:]:  # as an autotune from before the claims made its board and cache: mapped, not locked
    with open(Path(sys.argv[1]) / name.format(pid=os.getpid()), "w+b") as f:
        f.write(b"x")
        f.flush()
        maps.append(mmap.mmap(f.fileno(), 1))
print("ready", flush=True)
sys.stdin.read()
"""

CLAIMS = """
import sys
from pathlib import Path
from autotune.common.stale import create_claimed
claims = [create_claimed(Path(sys.argv[1]) / name)[0] for name in sys.argv[2:]]
print("ready", flush=True)
sys.stdin.read()
"""


def _holding(script: str, folder, *names) -> subprocess.Popen:
    holder = subprocess.Popen([sys.executable, "-c", script, str(folder), *names], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline() == "ready\n"
    return holder


def test_a_dead_processs_boards_and_caches_go_and_a_live_ones_stay(tmp_path):
    dead, idle = _dead_pid(), subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    mapping = _holding(MAPS, tmp_path, "autotune-{pid}-00ff.board", "autotune-cache-{pid}-00ff")
    try:
        # A live process that does not map a file named after it is not its maker: the name's PID is
        # another namespace's (a container sharing /dev/shm), or was given again (98d9912 kept these).
        names = [f"autotune-{dead}-00ff.board", f"autotune-cache-{dead}-00ff", f".autotune-cache-{dead}-00ff.new",
                 f"autotune-{idle.pid}-00ff.board", f"autotune-cache-{idle.pid}-00ff", "autotune-notapid-00ff.board",
                 "someone-elses"]
        for name in names:
            (tmp_path / name).write_bytes(b"x")
        (tmp_path / f".autotune-{dead}-00ff.board.new").write_bytes(b"x")  # being made: claimed a moment later
        os.utime(tmp_path / names[2], (time.time() - 61,) * 2)
        assert remove_stale_shared_memory(tmp_path) == 5  # the third: killed while it was being made, a minute ago
        assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
            names[5:] + [f"autotune-{mapping.pid}-00ff.board", f"autotune-cache-{mapping.pid}-00ff",
                         f".autotune-{dead}-00ff.board.new"])
    finally:
        for process in (idle, mapping):
            process.kill()
            process.wait()


def test_a_claimed_file_stays_whatever_pid_its_name_says(tmp_path):
    # A container that shares /dev/shm but not PIDs (--ipc=host) sees another's boards and caches
    # named after PIDs it does not have: 98d9912 removed them under their live makers.
    foreign = _dead_pid()
    names = [f"autotune-{foreign}-00ff.board", f"autotune-cache-{foreign}-00ff"]
    maker = _holding(CLAIMS, tmp_path, *names)
    try:
        assert remove_stale_shared_memory(tmp_path) == 0
        assert sorted(p.name for p in tmp_path.iterdir()) == sorted(names)
    finally:
        maker.kill()
        maker.wait()
    assert remove_stale_shared_memory(tmp_path) == 2  # its maker gone, the kernel dropped its claims
    assert not list(tmp_path.iterdir())


def test_boards_and_caches_are_claimed_by_their_makers_until_closed(tmp_path):
    from autotune.data.cache import SampleCache
    from autotune.monitor.board import Board

    foreign = _dead_pid()
    board = Board(tmp_path / f"autotune-{foreign}-00ff.board", create=True)
    cache = SampleCache(4, 1 << 16, directory=str(tmp_path))
    as_if_foreign = tmp_path / f"autotune-cache-{foreign}-00ff"
    os.link(cache.path, as_if_foreign)  # the same file, under another namespace's PID
    assert remove_stale_shared_memory(tmp_path) == 0
    board.close(unlink=True)
    cache.close()
    assert remove_stale_shared_memory(tmp_path) == 1  # the claim went with the close
    assert not list(tmp_path.iterdir())


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="needs root to sweep as another user")
def test_another_users_file_is_left_to_them_not_a_crash(tmp_path):
    # /dev/shm is sticky: a file of another user's dead process cannot be removed; 98d9912 raised
    # PermissionError at the Tuner's start.
    folder = Path(tempfile.mkdtemp(dir="/tmp"))
    try:
        os.chmod(folder, 0o1777)
        name = f"autotune-cache-{_dead_pid()}-00ff"
        (folder / name).write_bytes(b"x")
        os.chmod(folder / name, 0o600)
        script = ("import os, sys\nfrom pathlib import Path\nfrom autotune.common.stale import remove_stale_shared_memory\n"
                  "os.setuid(65534)\nprint(remove_stale_shared_memory(Path(sys.argv[1])))")
        sweep = subprocess.run([sys.executable, "-c", script, str(folder)], capture_output=True, text=True, timeout=60)
        assert sweep.returncode == 0 and sweep.stdout == "0\n", sweep.stderr
        assert (folder / name).exists()
    finally:
        shutil.rmtree(folder)


@pytest.mark.slow  # two runs in their own interpreters, one killed
def test_a_sigkilled_runs_shared_memory_is_gone_once_the_next_run_starts(tmp_path):
    ready = tmp_path / "ready"
    run = subprocess.Popen([sys.executable, "-c", RUN, str(tmp_path / "first"), str(ready)], stderr=subprocess.PIPE,
                           text=True)
    deadline = time.monotonic() + 120
    while not ready.exists():
        assert run.poll() is None, run.stderr.read()[-2000:]
        assert time.monotonic() < deadline
        time.sleep(0.1)
    left = [p for p in shared_memory_dir().iterdir() if p.name.startswith(f"autotune-{run.pid}-")]
    left.append(shared_memory_dir() / ready.read_text().rsplit("/", 1)[-1])
    assert len(left) == 2 and all(p.exists() for p in left), left  # its board and its cache
    run.send_signal(signal.SIGKILL)
    run.wait()
    assert all(p.exists() for p in left)  # nothing removes them when it dies
    done = python(["-c", "import sys, torch\nfrom autotune import Tuner\n"
                   "Tuner(torch.nn.Linear(2, 2), device='cpu', run_dir=sys.argv[1]).close()", str(tmp_path / "second")],
                  tmp_path, {}, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert not any(p.exists() for p in left), left
