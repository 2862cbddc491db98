"""Shared test helpers: running code in a subprocess under a real memory cap, and a GPU marker."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import psutil
import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def run_python(script: str, tmp_path: Path, timeout: float = 120,
               env: dict[str, str] | None = None) -> tuple[subprocess.CompletedProcess, dict | None]:
    """Run `script` in a fresh interpreter (with `env` added to the environment). The script gets
    `OUT` (a path) and may write a JSON result there with `save(obj)`; returns the process and the
    parsed result (None if absent)."""
    out = tmp_path / "result.json"
    preamble = textwrap.dedent(f"""
        import faulthandler, json, sys
        faulthandler.dump_traceback_later({timeout - 10}, exit=True)  # a hang shows where it is
        OUT = {str(out)!r}
        def save(obj):
            with open(OUT, "w") as f:
                json.dump(obj, f)
    """)
    # One malloc arena: a refused allocation then leaves no reserved heap behind, so what
    # fits under the cap is the same on every run (see autotune.limits.single_malloc_arena).
    proc = subprocess.run([sys.executable, "-c", preamble + textwrap.dedent(script)], capture_output=True,
                          text=True, timeout=timeout, cwd=tmp_path, env={**os.environ, "MALLOC_ARENA_MAX": "1", **(env or {})})
    result = json.loads(out.read_text()) if out.exists() else None
    return proc, result


def journal(run_dir: Path) -> list[dict]:
    """The run's journal records, once any checkpoint this process writes in the background is on disk
    (its line is written then)."""
    from autotune.checkpoint import wait_for_writes
    from autotune.journal import read_journal

    wait_for_writes()

    return list(read_journal(Path(run_dir) / "events.jsonl"))


TEARDOWN_ABORT = "terminate called without an active exception"


def torchrun(script: Path, args: list[str], results: list[Path], timeout: float = 240,
             expect_success: bool = True) -> subprocess.CompletedProcess:
    """`script` under torchrun, two ranks on CPU (gloo), with a real malloc arena per process.
    Asserts it succeeded (`expect_success`); `results` are the files each rank writes at its end.
    A job still running after `timeout` seconds hung: it is killed, ranks and all, and the test fails."""
    env = {**os.environ, "MALLOC_ARENA_MAX": "1", "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
               "--standalone",  # rendezvous on a port the OS picks: no race for a free one
               str(script), *args]
    proc = _run_job(command, env, timeout)
    if proc.returncode != 0 and TEARDOWN_ABORT in proc.stderr and all(path.exists() for path in results):
        # Both ranks finished and wrote their results, then one aborted in C++ at interpreter exit
        # (gloo's teardown; pytorch#179291 describes the mechanism): seen about once in 40 runs here.
        # A known open bug, in the issue notes; the run is repeated once, afresh, and must then be clean.
        for path in results:
            path.unlink()
        proc = _run_job(command, env, timeout)
    if expect_success:
        assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


def _run_job(command: list[str], env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) as job:
        try:
            stdout, stderr = job.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            # torchrun starts each rank in a session of its own: the ranks are killed one by one,
            # or they would stay waiting in their collective (and hold the pipes open).
            for process in [*psutil.Process(job.pid).children(recursive=True), psutil.Process(job.pid)]:
                process.kill()
            stdout, stderr = job.communicate()
            pytest.fail(f"the torchrun job hung (killed after {timeout:.0f} s): {stderr[-3000:]}")
    return subprocess.CompletedProcess(command, job.returncode, stdout, stderr)
