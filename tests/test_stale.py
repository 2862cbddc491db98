"""stale.py: the shared memory a killed run leaves (the monitor's board, a sample cache) is removed at
the next start, never a live process's: a real run killed with SIGKILL, then another run."""

import signal
import subprocess
import sys
import time

import pytest

from autotune.stale import remove_stale_shared_memory, shared_memory_dir

RUN = """
import os, sys, time
from pathlib import Path
import torch
from autotune import Tuner
from autotune.data.cache import SampleCache
tuner = Tuner(torch.nn.Linear(2, 2), device="cpu", run_dir=sys.argv[1])
from autotune.stale import shared_memory_dir
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


def test_a_dead_processs_boards_and_caches_go_and_a_live_ones_stay(tmp_path):
    dead, live = _dead_pid(), subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        names = [f"autotune-{dead}-00ff.board", f"autotune-cache-{dead}-00ff", f"autotune-{live.pid}-00ff.board",
                 f"autotune-cache-{live.pid}-00ff", "autotune-notapid-00ff.board", "someone-elses"]
        for name in names:
            (tmp_path / name).write_bytes(b"x")
        assert remove_stale_shared_memory(tmp_path) == 2
        assert sorted(p.name for p in tmp_path.iterdir()) == sorted(names[2:])
    finally:
        live.kill()
        live.wait()


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
    done = subprocess.run([sys.executable, "-c", "import sys, torch\nfrom autotune import Tuner\n"
                           "Tuner(torch.nn.Linear(2, 2), device='cpu', run_dir=sys.argv[1]).close()",
                           str(tmp_path / "second")], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert not any(p.exists() for p in left), left
