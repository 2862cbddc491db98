"""The examples in examples/ run as documented."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # each example runs in its own interpreter

EXAMPLES = Path(__file__).parents[1] / "examples"


def run(script, tmp_path):
    proc = subprocess.run([sys.executable, str(EXAMPLES / script)], capture_output=True, text=True,
                          timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_plugin_policy_example_journals_its_actions(tmp_path):
    # the plug-in package is installed by `make install` (pip install -e examples/custom_policy)
    out = run("custom_policy/train.py", tmp_path)
    assert "done: 2048 samples" in out
    (journal,) = (tmp_path / "runs").glob("*/events.jsonl")
    actions = [json.loads(line) for line in journal.read_text().splitlines() if '"action"' in line]
    assert [a["policy"] for a in actions] == ["empty_cache_every_epoch"] * 2 and all(a["applied"] for a in actions)


def test_torchvision_example_trains(tmp_path):
    assert "512 samples" in run("torchvision_resnet.py", tmp_path)


def test_hf_causal_lm_example_trains_bf16_through_its_ooms(tmp_path):
    pytest.importorskip("transformers")
    proc = subprocess.run([sys.executable, str(EXAMPLES / "hf_causal_lm.py"), "--epochs", "1", "--samples", "64", "--budget-mib", "32",
                           "--run-dir", str(tmp_path / "run")], capture_output=True, text=True, timeout=300,
                          cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "done: 64 samples" in proc.stdout
    records = [json.loads(line) for line in (tmp_path / "run" / "events.jsonl").read_text().splitlines()]
    assert [r for r in records if r["kind"] == "oom"], proc.stdout
    assert [r["step"] for r in records if r["kind"] == "evaluate"] == [0, 1, 2]  # 0: the warm-up before the cap
    assert {r["kind"] for r in records} >= {"fit_start", "evaluate", "fit_end"}


def test_the_three_keep_your_trainer_examples_survive_their_ooms(tmp_path):
    # custom_loop.py, hf_trainer.py and lightning_module.py, side by side (each in its own interpreter).
    pytest.importorskip("transformers")
    pytest.importorskip("lightning")
    runs = {"custom_loop.py": ["--epochs", "1", "--run-dir", str(tmp_path / "loop")],
            "hf_trainer.py": ["--samples", "64", "--output-dir", str(tmp_path / "hf")],
            "lightning_module.py": ["--epochs", "1", "--root-dir", str(tmp_path / "pl")]}
    env = {**os.environ, "MALLOC_ARENA_MAX": "1"}  # what fits under the cap the same on every run (conftest.py)
    procs = {name: subprocess.Popen([sys.executable, str(EXAMPLES / name), *args], stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True, cwd=tmp_path, env=env)
             for name, args in runs.items()}
    for name, proc in procs.items():
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, (name, err[-3000:])
        assert "done:" in out and " 0 OOMs survived" not in out, (name, out)
    for folder in (tmp_path / "loop", tmp_path / "hf", *(tmp_path / "pl").glob("lightning_logs/version_*")):
        kinds = [json.loads(line)["kind"] for line in (folder / "events.jsonl").read_text().splitlines()]
        assert "oom" in kinds and kinds[-1] == "fit_end", folder
