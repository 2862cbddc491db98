"""Shared test helpers: running code in a subprocess under a real memory cap, and a GPU marker."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def run_python(script: str, tmp_path: Path, timeout: float = 120) -> tuple[subprocess.CompletedProcess, dict | None]:
    """Run `script` in a fresh interpreter. The script gets `OUT` (a path) and may write a JSON
    result there with `save(obj)`; returns the process and the parsed result (None if absent)."""
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
    env = {**os.environ, "MALLOC_ARENA_MAX": "1"}
    proc = subprocess.run([sys.executable, "-c", preamble + textwrap.dedent(script)], capture_output=True,
                          text=True, timeout=timeout, cwd=tmp_path, env=env)
    result = json.loads(out.read_text()) if out.exists() else None
    return proc, result


def journal(run_dir: Path) -> list[dict]:
    from autotune.journal import read_journal

    return list(read_journal(Path(run_dir) / "events.jsonl"))
