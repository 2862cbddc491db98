"""The GPU check's driver on a machine without a GPU (benchmarks/gpu_check.py, issue 45): it stops
at once with a clear word and a results file; its dry run imports every step; a package the
machine lacks, with no wheel for it, is named before anything runs."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import python

ROOT = Path(__file__).parents[1]
CHECK = ROOT / "benchmarks" / "gpu_check.py"

needs_no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: the check would run")


def check(*args, out: Path) -> subprocess.CompletedProcess:
    return python([str(CHECK), "--out", str(out), *args], ROOT, {}, timeout=300)


@needs_no_cuda
def test_without_cuda_it_stops_at_once_and_says_so(tmp_path):
    proc = check(out=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert "gpu-check needs a CUDA device" in proc.stderr and "--dry-run" in proc.stderr
    assert "gpu-check needs a CUDA device" in (tmp_path / "gpu_check.md").read_text()
    assert json.loads((tmp_path / "gpu_check.json").read_text())["steps"] == []


@pytest.mark.slow
def test_the_dry_run_imports_every_step_and_writes_its_results(tmp_path):
    proc = check("--dry-run", out=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    steps = json.loads((tmp_path / "gpu_check.json").read_text())["steps"]
    sys.path.insert(0, str(CHECK.parent))
    try:
        import gpu_check
    finally:
        sys.path.remove(str(CHECK.parent))
    assert [s["key"] for s in steps] == [s.key for s in gpu_check.STEPS]
    assert all(s["status"] == "passed" for s in steps), [(s["key"], s["output_tail"][-500:]) for s in steps]
    assert "dry run" in (tmp_path / "gpu_check.md").read_text()


def test_a_missing_package_without_a_wheel_is_named_before_anything_runs(tmp_path, monkeypatch, capsys):
    sys.path.insert(0, str(CHECK.parent))
    try:
        import gpu_check
    finally:
        sys.path.remove(str(CHECK.parent))
    monkeypatch.setitem(gpu_check.PACKAGES, "autotune_no_such_module", "no-such-dist")
    monkeypatch.setattr(sys, "argv", ["gpu_check.py", "--out", str(tmp_path), "--wheels", str(tmp_path / "none")])
    assert gpu_check.main() == 3
    said = capsys.readouterr().err
    assert "lacks autotune_no_such_module (no-such-dist)" in said and "make gpu-wheels" in said
    assert "lacks autotune_no_such_module" in (tmp_path / "gpu_check.md").read_text()


def test_the_wheels_gathered_are_what_a_gpu_machine_lacks_at_the_tested_versions():
    proc = subprocess.run([sys.executable, str(CHECK), "--wheel-specs"], capture_output=True, text=True, timeout=60)
    specs = dict(spec.split("==") for spec in proc.stdout.split())
    assert set(specs) == {"loguru", "apscheduler", "tzlocal", "torch-pruning"}
    import loguru

    assert specs["loguru"] == loguru.__version__
