"""Long runs survive: SIGKILL at many points then resume, SIGTERM, a corrupt checkpoint.

Each run is a real process. The training is deterministic (fixed seeds, dropout, SGD with
momentum, a StepLR schedule), so a run that is killed and resumed must end with the same
weights and the same samples_seen as the uninterrupted one.
"""

import concurrent.futures
import signal

import pytest
import torch

from tests.conftest import journal, run_python

pytestmark = pytest.mark.slow  # about 18 interpreters: runs killed at many points, then resumed

TRAIN = """
import os, signal, time, torch
from torch import nn
from torch.utils.data import TensorDataset
from autotune import AutoTrainer
from autotune.stops.preemption import Preempted

torch.manual_seed(0)
g = torch.Generator().manual_seed(0)
data = TensorDataset(torch.randn(200, 8, generator=g), torch.randint(0, 3, (200,), generator=g))
model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.3), nn.Linear(32, 3))

def step(model, batch):
    if KILL_AT is not None and trainer.step == KILL_AT:
        os.kill(os.getpid(), signal.SIGKILL)
    if SLOW:
        time.sleep(SLOW)
    x, y = batch
    return nn.functional.cross_entropy(model(x), y)

trainer = AutoTrainer(model, data, step_fn=step, batch_size=16, micro_batch_size=MICRO, device="cpu",
                      optimizer=lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
                      scheduler=lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=7, gamma=0.5),
                      checkpoint_every=EVERY, run_dir=RUN_DIR, progress=False, monitor=False)
try:
    result = trainer.fit(epochs=3, resume=RESUME)
except Preempted as exc:
    save({"preempted": str(exc)})
    raise
torch.save(model.state_dict(), RUN_DIR + "/final.pt")
save({"samples_seen": result.samples_seen, "steps": result.steps, "epochs": result.epochs})
"""


def run(tmp_path, run_dir, kill_at=None, resume=False, every=3, micro=None, slow=0):
    settings = (f"KILL_AT={kill_at}\nRESUME={resume}\nEVERY={every}\nMICRO={micro}\nSLOW={slow}\n"
                f"RUN_DIR={str(run_dir)!r}\n")
    return run_python(settings + TRAIN, tmp_path)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("reference")
    proc, result = run(tmp, tmp / "run")
    assert proc.returncode == 0, proc.stderr[-2000:]
    return result, torch.load(tmp / "run" / "final.pt", weights_only=True)


def assert_same(reference, run_dir, result):
    expected_result, expected_weights = reference
    weights = torch.load(run_dir / "final.pt", weights_only=True)
    for key in expected_weights:
        torch.testing.assert_close(weights[key], expected_weights[key], rtol=1e-6, atol=1e-7)
    assert result["samples_seen"] == expected_result["samples_seen"] == 600
    assert result["steps"] == expected_result["steps"]


# 13 steps an epoch (12 x 16 + 8): kill before any checkpoint, mid-epoch, right after an
# epoch boundary, and in the last epoch with micro-batches inside a step.
def test_sigkill_then_resume_ends_with_the_same_weights(tmp_path, reference):
    def kill_and_resume(case):
        kill_at, micro = case
        folder = tmp_path / f"kill{kill_at}"
        folder.mkdir()
        run_dir = folder / "run"
        proc, _ = run(folder, run_dir, kill_at=kill_at, micro=micro)
        assert proc.returncode == -signal.SIGKILL, (case, proc.stderr[-2000:])
        proc, result = run(folder, run_dir, resume=True, micro=micro)
        assert proc.returncode == 0, (case, proc.stderr[-2000:])
        assert_same(reference, run_dir, result)
        resumes = [r for r in journal(run_dir) if r["kind"] == "resume"]
        assert resumes[-1]["found"] is (kill_at >= 3), case  # checkpoints every 3 steps; none: a fresh start

    # The kills are at steps, not moments: the cases run two at a time without changing what they test.
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        list(pool.map(kill_and_resume, [(0, None), (5, None), (13, None), (30, 4)]))


def test_a_corrupt_newest_checkpoint_is_skipped(tmp_path, reference):
    run_dir = tmp_path / "run"
    proc, _ = run(tmp_path, run_dir, kill_at=20)
    assert proc.returncode == -signal.SIGKILL
    newest = sorted((run_dir / "checkpoints").glob("step-*.pt"))[-1]
    newest.write_bytes(newest.read_bytes()[: newest.stat().st_size // 2])
    proc, result = run(tmp_path, run_dir, resume=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert_same(reference, run_dir, result)
    resumed = [r for r in journal(run_dir) if r["kind"] == "resume"][-1]
    assert resumed["path"] != str(newest)


def test_sigterm_checkpoints_exits_143_and_resumes(tmp_path, reference):
    import subprocess
    import sys
    import textwrap
    import time

    run_dir = tmp_path / "run"
    settings = f"KILL_AT=None\nRESUME=False\nEVERY=1000\nMICRO=None\nSLOW=0.05\nRUN_DIR={str(run_dir)!r}\n"
    preamble = "import json\ndef save(obj):\n    json.dump(obj, open(RUN_DIR + '/result.json', 'w'))\n"
    proc = subprocess.Popen([sys.executable, "-c", settings + preamble + textwrap.dedent(TRAIN)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not (run_dir / "events.jsonl").exists():
        time.sleep(0.05)
    time.sleep(0.6)  # some steps in
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 143, stderr[-2000:]
    records = journal(run_dir)
    preempted = [r for r in records if r["kind"] == "preempted"]
    assert preempted and preempted[0]["signal"] == "SIGTERM"
    checkpoint = [r for r in records if r["kind"] == "checkpoint"][-1]
    assert checkpoint["reason"] == "signal SIGTERM" and 0 < checkpoint["step"] < 39
    # The user is told, on stderr, with no setup of their own: where it stopped and how to go on.
    told = [line for line in stderr.splitlines() if line.startswith("autotune: stopped by SIGTERM")]
    assert len(told) == 1, stderr[-2000:]
    assert f"at step {checkpoint['step']}" in told[0] and checkpoint["path"] in told[0]
    assert "continue with fit(..., resume=True)" in told[0]
    proc, result = run(tmp_path, run_dir, resume=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert_same(reference, run_dir, result)


def _start(run_dir, slow):
    import subprocess
    import sys
    import textwrap

    settings = f"KILL_AT=None\nRESUME=False\nEVERY=2\nMICRO=None\nSLOW={slow}\nRUN_DIR={str(run_dir)!r}\n"
    preamble = "import json\ndef save(obj):\n    json.dump(obj, open(RUN_DIR + '/result.json', 'w'))\n"
    return subprocess.Popen([sys.executable, "-c", settings + preamble + textwrap.dedent(TRAIN)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_started(run_dir):
    import time

    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not (run_dir / "events.jsonl").exists():
        time.sleep(0.02)


def test_sigkill_from_outside_at_an_arbitrary_moment(tmp_path, reference):
    import time

    def kill_and_resume(delay):
        folder = tmp_path / f"after{delay}"
        folder.mkdir()
        run_dir = folder / "run"
        proc = _start(run_dir, slow=0.02)
        _wait_started(run_dir)
        time.sleep(delay)  # anywhere: in a step, in a checkpoint write, between them
        proc.kill()
        proc.communicate(timeout=30)
        proc, result = run(folder, run_dir, resume=True)
        assert proc.returncode == 0, (delay, proc.stderr[-2000:])
        assert_same(reference, run_dir, result)

    # Two runs at once: the moment of the kill is arbitrary either way.
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        list(pool.map(kill_and_resume, [0.37, 1.53]))


def test_ctrl_c_three_times_aborts_at_once(tmp_path):
    import time

    run_dir = tmp_path / "run"
    proc = _start(run_dir, slow=0.5)  # long steps: the first SIGINT waits for the step to end
    _wait_started(run_dir)
    time.sleep(0.3)
    proc.send_signal(signal.SIGINT)
    time.sleep(0.05)
    assert proc.poll() is None, "the first SIGINT must only ask for a stop after the step, not end the process"
    proc.send_signal(signal.SIGINT)  # a second (a launcher forwarding it to the group): said, and the stop goes on
    time.sleep(0.05)
    assert proc.poll() is None, "a second SIGINT must not abandon the stop"
    proc.send_signal(signal.SIGINT)  # a third: a person who insists
    _, stderr = proc.communicate(timeout=30)
    assert "autotune: SIGINT again: the stop goes on" in stderr and "KeyboardInterrupt" in stderr, stderr[-2000:]
    assert not [r for r in journal(run_dir) if r["kind"] == "preempted"]
