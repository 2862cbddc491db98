"""The suite's own promises (docs/development.md): every test runs under a time limit (pytest-timeout,
configured in pyproject.toml), and a test that hangs waiting on other processes fails within its limit,
with its stack, and leaves none of those processes behind."""

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).parents[1]


def test_every_test_runs_under_a_time_limit_that_interrupts_the_test_itself(pytestconfig):
    limit = float(pytestconfig.getini("timeout") or 0)
    assert 0 < limit <= 600, f"pyproject.toml's [tool.pytest.ini_options] timeout is {limit!r} s"
    # SIGALRM: the test fails with its own stack and the session goes on (the thread method ends the process).
    assert pytestconfig.getini("timeout_method") == "signal"


def test_a_test_hung_on_a_torchrun_job_fails_in_its_time_with_its_stack_and_the_jobs_processes_killed(tmp_path):
    pid_file = tmp_path / "pid"
    hung = tmp_path / "test_hung.py"
    # A stand-in for a torchrun launcher whose ranks never finish: a process that waits for ever.
    hung.write_text(textwrap.dedent(f"""
        import os, sys
        import pytest
        from tests.conftest import _run_job

        @pytest.mark.timeout(2)
        def test_hangs():
            forever = "import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(600)"
            _run_job([[sys.executable, "-c", forever]], dict(os.environ), timeout=600)
    """))
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
                           "-c", str(ROOT / "pyproject.toml"), "--rootdir", str(ROOT), str(hung)],
                          cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])})
    took = time.monotonic() - started
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]
    assert "Timeout (>2.0s) from pytest-timeout" in done.stdout and "in _run_job" in done.stdout, done.stdout[-3000:]
    assert took < 60, took
    pid = int(pid_file.read_text())
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE, "the job was left running"
