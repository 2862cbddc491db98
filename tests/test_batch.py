"""batch.py's steady path: a batch that nothing can change skips the loop's machinery, and a run
that goes through it reacts as the full loop would, to an OOM, a memory alarm and a due checkpoint."""

from __future__ import annotations

import json
import time

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from autotune import AutoTrainer
from autotune.distributed import Solo
from autotune.monitor.board import Board
from autotune.presets import resolve_policies
from autotune.memory import StepDemand
from autotune.snapshot import DeviceSample, StepMemory
from autotune.step import Attempt, StepCore

# Fields that say when or how long, name a process or a file, or measure the process: not what a run decided.
VOLATILE = {"time", "wall_seconds", "seconds", "pid", "path", "lost_seconds", "write_seconds", "step_seconds",
            "background",
            "breakdown"}  # what the process held at an OOM: its resident bytes, measured


class ScriptedMonitor:
    """Stands in for the monitor process (none runs): a real sample board the test writes to,
    read through the trainer's own monitor link. It never dies."""

    idle, pid, returncode, restarts = False, None, None, 0

    def __init__(self, path):
        self._writer = Board(path, create=True)
        self.board = Board(path)  # the trainer's side, as MonitorProcess.board is
        self.written = 0

    def write(self, used_fraction: float) -> None:
        self.written += 1
        self._writer.write(DeviceSample(time=time.time(), used_bytes=int(used_fraction * 1000), cap_bytes=1000,
                                        total_bytes=1000, source="memory_cap"), None, self.written)

    def latest(self):
        return self.board.read_new()

    def settle(self) -> None:
        pass

    def alive(self) -> bool:
        return True

    def stop(self, wait: bool = True) -> None:
        self.board.close()
        self._writer.close(unlink=True)


class Script:
    """What happens when: a memory alarm (two high samples) after steps 29 and 30, and from step
    44 on a real allocator refusal of any micro-batch over 8 (a tensor no machine can hold)."""

    def __init__(self, monitor: ScriptedMonitor):
        self.monitor = monitor

    def step_fn(self, trainer_ref):
        def step(model, batch):
            x, y = batch
            if trainer_ref[0].step >= 44 and len(x) > 8:
                torch.empty(1 << 62, dtype=torch.uint8)  # DefaultCPUAllocator: can't allocate memory
            return nn.functional.cross_entropy(model(x), y)
        return step

    def on_step_end(self, trainer) -> None:
        if trainer.step in (29, 30):
            self.monitor.write(0.95)


def run(tmp_path, steady: bool, monkeypatch) -> tuple[list[dict], dict[str, torch.Tensor], int]:
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(320, 8, generator=g), torch.randint(0, 3, (320,), generator=g))
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
    run_dir = tmp_path / ("steady" if steady else "full")
    monitor = ScriptedMonitor(tmp_path / f"{run_dir.name}.board")
    script = Script(monitor)
    trainer_ref: list[AutoTrainer] = []
    # The default preset but the input's policies: whether a tiny model's loop waits on its data is a
    # matter of timing, and the two runs are compared decision by decision.
    policies = [p for p in resolve_policies("default") if p.name not in ("tune_workers", "cache_when_io_bound")]
    trainer = AutoTrainer(model, data, step_fn=script.step_fn(trainer_ref), batch_size=16, device="cpu",
                          policies=policies,
                          optimizer=lambda p: torch.optim.SGD(p, lr=0.1), run_dir=run_dir, monitor=False,
                          progress=False, checkpoint_every=25, checkpoint_interval=None, callbacks=[script])
    trainer_ref.append(trainer)
    tuner = trainer.tuner
    tuner.monitor_link.process = monitor  # the link reads it as it reads a monitor process
    tuner.cadence.interval = float("inf")  # which batches are measured: by count only, the same in both runs
    tuner.batches.steady_path = steady
    agreements = [0]  # the full loop's: one an attempt (the steady path has none)
    agree = Solo.agree

    def counted(self, mine, device):
        agreements[0] += 1
        return agree(self, mine, device)

    monkeypatch.setattr(Solo, "agree", counted)
    unmeasured_ooms = [0]  # attempts that ran out of memory on a batch the cadence did not measure

    def watching(method):
        def watched(self, *args, **kwargs):
            result = method(self, *args, **kwargs)
            failed = isinstance(result, Attempt) and result.failed_micro_batch is not None
            unmeasured_ooms[0] += failed and not tuner.batches.measured
            return result
        return watched

    # The loop's attempt, and the steady path's whole batch in one piece.
    monkeypatch.setattr(StepCore, "attempt", watching(StepCore.attempt))
    monkeypatch.setattr(StepCore, "whole_batch", watching(StepCore.whole_batch))
    # What a measured step needed, scripted: measured, it is the host's memory (other processes move
    # it), and fit_micro_batch's moves follow it. A MiB a sample, of 64 MiB.
    monkeypatch.setattr(StepDemand, "_measure", lambda self: StepMemory(self._micro, self._micro * 2**20, 64 * 2**20))
    trainer.fit(epochs=3)
    trainer.close()
    steady_batches = trainer.counters.batches_done + 60 - agreements[0]  # 3 epochs of 20 batches; batches_done: 0
    records = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    # What an empty_cache returned is the allocator's to say (its note), not a decision.
    decided = [{k: v for k, v in r.items() if k not in VOLATILE and not (k == "note" and r.get("action") == "empty_cache")}
               for r in records]
    return decided, {k: v.clone() for k, v in model.state_dict().items()}, (steady_batches, unmeasured_ooms[0])


def test_the_steady_path_reacts_to_an_oom_an_alarm_and_a_checkpoint_as_the_full_loop(tmp_path, monkeypatch):
    steady_records, steady_weights, steady_batches = run(tmp_path, True, monkeypatch)
    full_records, full_weights, full_batches = run(tmp_path, False, monkeypatch)
    # The steady run took the steady path for most batches, the other never; the OOM came in one.
    assert full_batches[0] <= 0 and steady_batches[0] > 30 and steady_batches[1] == 1
    kinds = [r["kind"] for r in steady_records]
    assert "oom" in kinds, kinds
    actions = [(r["policy"], r["action"], r["event"], r["step"]) for r in steady_records if r["kind"] == "action"]
    assert ("halve_on_oom", "set_micro_batch", "oom", 44) in actions, actions
    assert any(policy == "empty_cache_on_pressure" and event == "memory_high" for policy, _, event, _ in actions), actions
    assert [r["step"] for r in steady_records if r["kind"] == "checkpoint"][:2] == [25, 50]
    assert steady_records == full_records  # every decision, at the same step, with the same figures
    for name, weight in full_weights.items():
        assert torch.equal(steady_weights[name], weight), name


@pytest.mark.parametrize("steady", [True, False])
def test_a_skipped_step_is_journaled_either_way(tmp_path, steady):
    """A non-finite gradient on the steady path is skipped and reported as on the full loop."""
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(64, 4), torch.randint(0, 2, (64,)))
    model = nn.Linear(4, 2)
    calls = [0]

    def step(m, batch):
        calls[0] += 1
        loss = nn.functional.cross_entropy(m(batch[0]), batch[1])
        return loss * float("nan") if calls[0] == 20 else loss  # past the measured first batches

    trainer = AutoTrainer(model, data, step_fn=step, batch_size=4, device="cpu", run_dir=tmp_path / "run",
                          monitor=False, progress=False, checkpoint_interval=None)
    trainer.tuner.cadence.interval = float("inf")
    trainer.tuner.batches.steady_path = steady
    trainer.fit(epochs=2)
    trainer.close()
    records = [json.loads(line) for line in (tmp_path / "run" / "events.jsonl").read_text().splitlines()]
    assert [r["at_step"] for r in records if r["kind"] == "nonfinite"] == [20]
    assert all(torch.isfinite(p).all() for p in model.parameters())
