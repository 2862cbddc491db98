"""The examples in examples/ run as documented."""

import importlib.util
import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.conftest import python

pytestmark = pytest.mark.slow  # each example runs in its own interpreter

EXAMPLES = Path(__file__).parents[1] / "examples"
HAS = {name: importlib.util.find_spec(name) is not None for name in ("transformers", "lightning", "accelerate")}


@pytest.fixture(scope="module")
def examples(tmp_path_factory):
    """Every example at once, each in its own interpreter and folder: {script: (process, folder)}.
    Most of an example's time is its interpreter starting, on one core: side by side they share the two."""
    tmp = tmp_path_factory.mktemp("examples")
    runs = {"custom_policy/train.py": [], "torchvision_resnet.py": []}  # the plug-in: installed by `make install`
    if HAS["transformers"]:
        runs["hf_causal_lm.py"] = ["--epochs", "1", "--samples", "64", "--run-dir", "run"]  # its cap measured here
        runs["custom_loop.py"] = ["--epochs", "1", "--run-dir", "run"]
        runs["hf_trainer.py"] = ["--samples", "64", "--output-dir", "run"]
    if HAS["transformers"] and HAS["lightning"]:
        runs["lightning_module.py"] = ["--epochs", "1", "--root-dir", "run"]
    if HAS["accelerate"]:
        runs["accelerate_loop.py"] = ["--epochs", "1", "--run-dir", "run"]
    # One malloc arena (conftest.python's): what fits under a cap the same on every run. One OpenMP thread each:
    # seven processes with two each on two cores spin in libgomp's barriers against each other (51 s -> 33 s).
    env = {"OMP_NUM_THREADS": "1"}
    folders = {script: tmp / script.replace("/", "-").removesuffix(".py") for script in runs}
    with ThreadPoolExecutor(len(runs)) as pool:
        for folder in folders.values():
            folder.mkdir()
        started = {script: pool.submit(python, [str(EXAMPLES / script), *args], folders[script], env, 300)
                   for script, args in runs.items()}
        return {script: (run.result(), folders[script]) for script, run in started.items()}


def run(examples, script):
    proc, folder = examples[script]
    assert proc.returncode == 0, (script, proc.stderr[-3000:])
    return proc.stdout, folder


def test_plugin_policy_example_journals_its_actions(examples):
    out, folder = run(examples, "custom_policy/train.py")
    assert "done: 2048 samples" in out
    (journal,) = (folder / "runs").glob("*/events.jsonl")
    actions = [json.loads(line) for line in journal.read_text().splitlines() if '"action"' in line]
    assert [a["policy"] for a in actions] == ["empty_cache_every_epoch"] * 2 and all(a["applied"] for a in actions)


def test_torchvision_example_trains(examples):
    assert "512 samples" in run(examples, "torchvision_resnet.py")[0]


@pytest.mark.skipif(not HAS["transformers"], reason="needs transformers")
def test_hf_causal_lm_example_trains_bf16_through_its_ooms(examples):
    out, folder = run(examples, "hf_causal_lm.py")
    assert "done: 64 samples" in out
    records = [json.loads(line) for line in (folder / "run" / "events.jsonl").read_text().splitlines()]
    assert [r for r in records if r["kind"] == "oom"], out
    assert [r["step"] for r in records if r["kind"] == "evaluate"] == [0, 1, 2]  # 0: the warm-up before the cap
    assert {r["kind"] for r in records} >= {"fit_start", "evaluate", "fit_end"}


@pytest.mark.skipif(not (HAS["transformers"] and HAS["lightning"]), reason="needs transformers and lightning")
def test_the_three_keep_your_trainer_examples_survive_their_ooms(examples):
    # custom_loop.py, hf_trainer.py and lightning_module.py, each in its own interpreter.
    for script in ("custom_loop.py", "hf_trainer.py", "lightning_module.py"):
        out, folder = run(examples, script)
        assert "done:" in out and " 0 OOMs survived" not in out, (script, out)
        run_dirs = [folder / "run"] if script != "lightning_module.py" else [
            *(folder / "run").glob("lightning_logs/version_*")]
        assert run_dirs, (script, "no run folder")
        for run_dir in run_dirs:
            kinds = [json.loads(line)["kind"] for line in (run_dir / "events.jsonl").read_text().splitlines()]
            assert "oom" in kinds and kinds[-1] == "fit_end", run_dir


@pytest.mark.skipif(not HAS["accelerate"], reason="needs accelerate")
def test_the_accelerate_example_survives_its_ooms_with_the_plain_loops_weights(examples):
    import re

    out, folder = run(examples, "accelerate_loop.py")
    found = re.search(r"(\d+) OOMs survived.*weights vs the plain Accelerate loop: (\S+) apart", out)
    assert found and int(found.group(1)) >= 1, out
    assert float(found.group(2)) < 1e-5, out
