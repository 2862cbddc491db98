"""batch.py's one path through a batch: a run whose unmeasured batch runs out of memory, that
sees a memory alarm and a due checkpoint, reacts to each and ends with the weights of the run
that never ran out of memory; a non-finite step is skipped and said."""

from __future__ import annotations

import json
import time

import torch
from torch import nn
from torch.utils.data import TensorDataset

from autotune import AutoTrainer
from autotune.monitor.board import Board
from autotune.tuning.presets import resolve_policies
from autotune.memory.demand import StepDemand
from autotune.common.snapshot import DeviceSample, StepMemory
from autotune.step.core import StepCore

# Fields that say when or how long, name a process or a file, or measure the process: not what a run decided.
VOLATILE = {"time", "wall_seconds", "seconds", "pid", "path", "lost_seconds", "write_seconds", "step_seconds",
            "background", "run_id",
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
    """What happens when: a memory alarm (two high samples) after steps 29 and 30, and (`refuse`)
    from step 44 on a real allocator refusal of any micro-batch over 8 (a tensor no machine can hold)."""

    def __init__(self, monitor: ScriptedMonitor, refuse: bool):
        self.monitor, self.refuse = monitor, refuse

    def step_fn(self, trainer_ref):
        def step(model, batch):
            x, y = batch
            if self.refuse and trainer_ref[0].step >= 44 and len(x) > 8:
                torch.empty(1 << 62, dtype=torch.uint8)  # DefaultCPUAllocator: can't allocate memory
            return nn.functional.cross_entropy(model(x), y)
        return step

    def on_step_end(self, trainer) -> None:
        if trainer.step in (29, 30):
            self.monitor.write(0.95)


def run(tmp_path, refuse: bool, monkeypatch) -> tuple[list[dict], dict[str, torch.Tensor], int]:
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(320, 8, generator=g), torch.randint(0, 3, (320,), generator=g))
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
    run_dir = tmp_path / ("refused" if refuse else "clean")
    monitor = ScriptedMonitor(tmp_path / f"{run_dir.name}.board")
    script = Script(monitor, refuse)
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
    unmeasured_ooms = [0]  # attempts that ran out of memory on a batch the cadence did not measure

    def watching(method):
        def watched(self, *args, **kwargs):
            result = method(self, *args, **kwargs)
            unmeasured_ooms[0] += result.failed_micro_batch is not None and not tuner.batches.measured
            return result
        return watched

    monkeypatch.setattr(StepCore, "attempt", watching(StepCore.attempt))
    # What a measured step needed, scripted: measured, it is the host's memory (other processes move
    # it), and fit_micro_batch's moves follow it. A MiB a sample, of 64 MiB.
    monkeypatch.setattr(StepDemand, "_measure", lambda self: StepMemory(self._micro, self._micro * 2**20, 64 * 2**20))
    trainer.fit(epochs=3)
    trainer.close()
    records = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    # What an empty_cache returned is the allocator's to say (its note), not a decision.
    decided = [{k: v for k, v in r.items() if k not in VOLATILE and not (k == "note" and r.get("action") == "empty_cache")}
               for r in records]
    return decided, {k: v.clone() for k, v in model.state_dict().items()}, unmeasured_ooms[0]


def test_an_oom_on_an_unmeasured_batch_an_alarm_and_a_checkpoint_end_with_the_weights_of_the_clean_run(
        tmp_path, monkeypatch):
    records, weights, unmeasured_ooms = run(tmp_path, True, monkeypatch)
    clean_records, clean_weights, clean_ooms = run(tmp_path, False, monkeypatch)
    assert unmeasured_ooms == 1 and clean_ooms == 0  # the OOM came in a batch the cadence did not measure
    kinds = [r["kind"] for r in records]
    assert "oom" in kinds and "oom" not in [r["kind"] for r in clean_records], kinds
    actions = [(r["policy"], r["action"], r["event"], r["step"]) for r in records if r["kind"] == "action"]
    assert ("halve_on_oom", "set_micro_batch", "oom", 44) in actions, actions
    assert any(policy == "empty_cache_on_pressure" and event == "memory_high" for policy, _, event, _ in actions), actions
    assert [r["step"] for r in records if r["kind"] == "checkpoint"][:2] == [25, 50]
    # Up to the OOM, every decision at the same step with the same figures.
    first_oom = kinds.index("oom")
    assert records[:first_oom] == clean_records[:first_oom]
    # The batch that ran out of memory was trained in halves: the same weights, to float tolerance.
    for name, weight in clean_weights.items():
        torch.testing.assert_close(weights[name], weight, rtol=1e-5, atol=1e-6, msg=name)


def test_a_skipped_step_is_journaled_on_an_unmeasured_batch(tmp_path):
    """A non-finite gradient on a batch the cadence does not measure is skipped and reported."""
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
    trainer.fit(epochs=2)
    trainer.close()
    records = [json.loads(line) for line in (tmp_path / "run" / "events.jsonl").read_text().splitlines()]
    assert [r["at_step"] for r in records if r["kind"] == "nonfinite"] == [20]
    assert all(torch.isfinite(p).all() for p in model.parameters())


def _reaches_into_the_attempts_side_state(source: str) -> list[str]:
    # What only an attempt may drive (step/core.py): rewind.py, norm_stats.py, and their calls.
    import ast

    found = []
    for node in ast.walk(ast.parse(source)):
        name = (node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name)
                else node.module or "" if isinstance(node, ast.ImportFrom) else "")
        if name.split(".")[-1] in {"rewind", "norms", "norm_stats", "Rewind", "BatchNormStats", "restore",
                                   "restore_buffers", "settle", "drop", "begin", "pause", "keep"}:
            found.append(f"{node.lineno}: {ast.unparse(node)[:60]}")
    return found


def _tuple_bound_parts(source: str) -> list[str]:
    # `core, stepper = self.core, self.stepper`: locals that hide whose call each is.
    import ast

    return [ast.unparse(node)[:60] for node in ast.walk(ast.parse(source)) if isinstance(node, ast.Assign)
            and isinstance(node.value, ast.Tuple) and any(isinstance(e, ast.Attribute) and isinstance(e.value, ast.Name)
                                                          and e.value.id == "self" for e in node.value.elts)
            and all(isinstance(t, ast.Tuple) and all(isinstance(e, ast.Name) for e in t.elts) for t in node.targets)]


def test_the_batch_loop_commits_or_rolls_back_an_attempt_and_touches_none_of_its_side_state():
    import inspect
    import textwrap

    from autotune.tuning import batch

    assert not _reaches_into_the_attempts_side_state(inspect.getsource(batch)), \
        _reaches_into_the_attempts_side_state(inspect.getsource(batch))
    assert not _tuple_bound_parts(textwrap.dedent(inspect.getsource(batch.BatchRunner.run)))
    # The scans see what they look for (batch.py's lines before the attempt owned its side state).
    old = ("def run(self, core, n):\n    core, stepper, knobs = self.core, self.stepper, self.knobs\n"
           "    core.rewind.restore()\n    core.norms.drop()\n    if self.core.norms.active:\n        self._settle_norms(n)\n")
    assert len(_reaches_into_the_attempts_side_state(old)) == 5
    assert len(_tuple_bound_parts(old)) == 1
