"""A stalled loader is named (issue 48, item 6): a `__getitem__` that blocks gets a warning naming
the batch and its samples, and a SIGTERM or Ctrl-C during the wait checkpoints the last completed
step and exits 143 / 130 within seconds, its workers (the stuck one too) gone with it. Real
processes, real signals; the resumed run ends with the weights of one that never stalled."""

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch

from autotune.ranks.distributed import Ranks, Solo
from autotune.training.batch_in_hand import BatchInHand
from autotune.stops.stall import FIRST_BATCH, HIGHEST, LOWEST, StallWatch

SCRIPT = """
import os, sys, time
import torch
from torch import nn
from torch.utils.data import Dataset
from autotune import AutoTrainer

run_dir, marker, workers, block = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4] == "1"

class Samples(Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, i):
        if block and i == 27:  # batch 4 of 8 (samples 24..31): a read that never returns
            with open(marker, "w") as f:
                f.write(str(os.getpid()))
            time.sleep(600)
        g = torch.Generator().manual_seed(i)
        return torch.randn(8, generator=g), torch.tensor(i % 2)

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
trainer = AutoTrainer(model, Samples(), loss_fn=nn.functional.cross_entropy, batch_size=8, shuffle=False,
                      num_workers=workers, device="cpu", monitor=False, progress=False, checkpoint_interval=None,
                      data_stall_seconds=1.0, run_dir=run_dir,
                      optimizer=lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9))
trainer.fit(epochs=1, resume=not block)
trainer.close()
torch.save(model.state_dict(), os.path.join(run_dir, "final.pt"))
"""


def _start(tmp_path: Path, run_dir: Path, workers: int, block: bool):
    script, marker, err = tmp_path / "train.py", tmp_path / "blocked.pid", tmp_path / f"stderr-{block}.txt"
    tmp_path.mkdir(exist_ok=True)
    script.write_text(SCRIPT)
    with open(err, "w") as stderr:
        process = subprocess.Popen([sys.executable, str(script), str(run_dir), str(marker), str(workers),
                                    "1" if block else "0"], stderr=stderr, cwd=Path(__file__).parents[2])
    return process, marker, err


def _wait_for(condition, seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, f"no {what} after {seconds} s"
        time.sleep(0.1)


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]


@pytest.mark.slow
@pytest.mark.parametrize("workers, signum, code", [(0, signal.SIGTERM, 143), (2, signal.SIGINT, 130)])
def test_a_blocking_getitem_is_named_and_a_signal_during_the_wait_checkpoints_and_stops(tmp_path, workers, signum,
                                                                                         code):
    run_dir = tmp_path / "run"
    process, marker, err = _start(tmp_path, run_dir, workers, block=True)
    if not workers:  # the weights' check once: with workers the same batches come, in the same order
        straight, _, straight_err = _start(tmp_path / "straight", tmp_path / "straight" / "run", workers, block=False)
    try:
        _wait_for(lambda: "no batch for" in err.read_text(), 90, "stall warning")
        text = err.read_text()
        assert "waiting for batch 4 of epoch 1, 24 samples into it" in text, text
        assert "the dataset's samples being fetched: [24, 25, 26, 27, 28, 29, 30, 31]" in text, text
        stuck = int(marker.read_text())
        signalled = time.monotonic()
        process.send_signal(signum)  # on the old code: a flag read after a step that never came
        assert process.wait(timeout=30) == code
        took = time.monotonic() - signalled
    finally:
        process.kill()
    text = err.read_text()
    assert f"stopped by {signal.Signals(signum).name} at step 3" in text, text
    assert took < 20, took  # within seconds: the stuck worker is stopped after torch's 5 s join
    if workers:
        assert stuck != process.pid
        _wait_for(lambda: not psutil.pid_exists(stuck) or psutil.Process(stuck).status() == psutil.STATUS_ZOMBIE,
                  10, "end of the stuck worker")
    records = _records(run_dir)
    (stalled,) = [r for r in records if r["kind"] == "data_stalled"]
    assert (stalled["batch"], stalled["position"], stalled["indices"]) == (3, 24, list(range(24, 32)))
    (preempted,) = [r for r in records if r["kind"] == "preempted"]
    assert preempted["checkpoint"].endswith("step-000000003.pt") and (run_dir / "checkpoints" / "step-000000003.pt").exists()
    if workers:
        return
    # Resumed without the block, the run ends where one that never stalled does.
    resumed, _, resumed_err = _start(tmp_path, run_dir, workers, block=False)
    assert resumed.wait(timeout=120) == 0, resumed_err.read_text()
    assert straight.wait(timeout=120) == 0, straight_err.read_text()
    ours = torch.load(run_dir / "final.pt", weights_only=True)
    theirs = torch.load(tmp_path / "straight" / "run" / "final.pt", weights_only=True)
    for name, weight in theirs.items():
        torch.testing.assert_close(ours[name], weight, rtol=1e-6, atol=1e-7, msg=name)


class _Journal:
    def __init__(self):
        self.records = []

    def write(self, kind, step, epoch, **fields):
        self.records.append({"kind": kind, "step": step, "epoch": epoch, **fields})


def test_the_threshold_follows_the_measured_batch_times_within_its_bounds():
    in_hand = BatchInHand(lambda *a: "", ranks=Solo(), folder=Path("."))
    watch = StallWatch(in_hand, lambda position: None, _Journal(), ranks=Solo())
    in_hand.new_fit()
    in_hand.start(0, 0, 0, 0, now=100.0)
    assert watch.threshold() == FIRST_BATCH  # the first batch starts the workers
    for gap, expected in ((0.5, LOWEST), (3.0, 60.0), (100.0, HIGHEST)):  # 20 x the mean gap, bounded
        in_hand.new_fit()
        for k in range(4):
            in_hand.start(0, 8 * k, k, k, now=k * gap)
        assert watch.threshold() == pytest.approx(expected), gap
    assert StallWatch(in_hand, lambda position: None, _Journal(), ranks=Solo(), seconds=3.0).threshold() == 3.0


def test_a_stall_is_named_once_per_batch_with_its_samples(capfd):
    in_hand = BatchInHand(lambda *a: "", ranks=Solo(), folder=Path("."))
    journal = _Journal()
    watch = StallWatch(in_hand, lambda position: list(range(position, position + 4)), journal, ranks=Solo(),
                       seconds=2.0)
    in_hand.start(1, 8, 2, 7, now=time.perf_counter())
    watch.check()
    assert journal.records == []  # not yet
    in_hand.start(1, 8, 2, 7, now=time.perf_counter() - 3)
    watch.check()
    watch.check()
    assert [(r["kind"], r["step"], r["batch"], r["indices"]) for r in journal.records] == \
        [("data_stalled", 7, 2, [8, 9, 10, 11])]
    assert "waiting for batch 3 of epoch 2, 8 samples into it; the dataset's samples being fetched: [8, 9, 10, 11]" \
        in capfd.readouterr().err
    assert watch.interrupts()  # alone, any wait is unwound by a stop signal
    two_ranks = StallWatch(in_hand, lambda position: None, journal, ranks=Ranks(0, 2, 0), seconds=60.0)
    assert not two_ranks.interrupts()  # under torchrun, only a stall (the others wait in the step's collectives)
    in_hand.done()
    assert not watch.interrupts()


@pytest.mark.slow
def test_a_stuck_worker_dies_with_its_trainer_killed_with_sigkill(tmp_path):
    process, marker, err = _start(tmp_path, tmp_path / "run", 2, block=True)
    try:
        _wait_for(lambda: "no batch for" in err.read_text(), 90, "stall warning")
        stuck = int(marker.read_text())
        assert stuck != process.pid and psutil.pid_exists(stuck)
        process.kill()  # SIGKILL: nothing of the trainer runs; on the old code the worker slept on for 10 min
        process.wait(timeout=30)
        _wait_for(lambda: not psutil.pid_exists(stuck) or psutil.Process(stuck).status() == psutil.STATUS_ZOMBIE,
                  10, "end of the stuck worker")
    finally:
        process.kill()
