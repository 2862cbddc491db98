"""Autocast and activation checkpointing lower the measured step demand where activations
dominate, and applying them twice changes nothing."""

import concurrent.futures

import pytest
import torch
import torchvision
from torch import nn

from autotune.step.precision import autocast_plan
from autotune.common.model_blocks import repeated_blocks
from autotune.relief.checkpointing import checkpoint_blocks
from tests.conftest import run_python

MEASURE = """
import torch
from torch import nn
from autotune.memory.limits import fix_mmap_threshold
from autotune.memory.demand import StepPeak
from autotune.step.precision import autocast_plan
from autotune.relief.checkpointing import checkpoint_blocks
fix_mmap_threshold()  # big tensors mmapped: freed memory leaves the resident size
torch.set_num_threads(1)
torch.manual_seed(0)

WIDTH = 32  # narrow: the hidden activations (the memory) stay, the matmuls (slow in bf16 here) shrink

class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(WIDTH, 1024), nn.Linear(1024, WIDTH)

    def forward(self, x):
        return x + self.down(nn.functional.gelu(self.up(x)))

model = nn.Sequential(*[Block() for _ in range(6)], nn.Linear(WIDTH, 10))
x, y = torch.randn(2048, WIDTH), torch.randint(0, 10, (2048,))
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
plan = autocast_plan(torch.device("cpu")) if RELIEF == "autocast" else None
if RELIEF == "checkpointing":
    assert checkpoint_blocks(model) and checkpoint_blocks(model) == []  # a second time: nothing more
peak = StepPeak(torch.device("cpu"))

def step():
    if plan is not None:
        with plan.context():
            loss = nn.functional.cross_entropy(model(x), y)
    else:
        loss = nn.functional.cross_entropy(model(x), y)
    loss.backward(); optimizer.step(); optimizer.zero_grad(set_to_none=True)
    return loss.item()

step(); step()  # warm: kernels paged in
before = peak.current()
peak.start(); loss = step()
save({"demand": peak.peak() - before, "loss": loss})
"""


def demand(tmp_path, relief):
    folder = tmp_path / str(relief)
    folder.mkdir()
    proc, result = run_python(f"RELIEF = {relief!r}\n" + MEASURE, folder, timeout=200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return result


@pytest.mark.slow
def test_checkpointing_and_autocast_each_lower_the_step_demand(tmp_path):
    # Three processes at once: each measures its own resident peak, so they need not wait for each other.
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        plain, checkpointed, autocast = pool.map(lambda r: demand(tmp_path, r), (None, "checkpointing", "autocast"))
    assert checkpointed["demand"] < 0.6 * plain["demand"], (plain, checkpointed)
    assert autocast["demand"] < 0.8 * plain["demand"], (plain, autocast)
    assert abs(checkpointed["loss"] - plain["loss"]) < 1e-4  # recomputation changes nothing
    assert abs(autocast["loss"] - plain["loss"]) < 0.05  # bf16: close, not equal


def test_repeated_blocks_are_found_in_common_models():
    names = [n for n, _ in repeated_blocks(torchvision.models.resnet18())]
    assert names == [f"layer{i}.{j}" for i in range(1, 5) for j in range(2)]
    encoder = nn.TransformerEncoder(nn.TransformerEncoderLayer(32, 4, 64, batch_first=True), 3)
    assert [n for n, _ in repeated_blocks(encoder)] == ["layers.0", "layers.1", "layers.2"]
    flat = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4), nn.ReLU())
    assert repeated_blocks(flat) == [] and checkpoint_blocks(flat) == ["the model's 4 layers in 2 segments"]
    assert checkpoint_blocks(nn.Linear(4, 4)) == []  # nothing to checkpoint


def test_checkpointed_gradients_equal_the_plain_ones():
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=4).eval()  # eval: BatchNorm uses fixed statistics
    x = torch.randn(2, 3, 32, 32)
    model(x).sum().backward()
    plain = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    checkpoint_blocks(model)
    model(x).sum().backward()
    for a, b in zip(plain, (p.grad for p in model.parameters())):
        torch.testing.assert_close(a, b)


def test_the_autocast_plan_per_device():
    cpu = autocast_plan(torch.device("cpu"))
    assert cpu.dtype is torch.bfloat16 and not cpu.needs_scaler
    assert autocast_plan(torch.device("meta")) is None


@pytest.mark.gpu
def test_the_autocast_plan_on_cuda():
    plan = autocast_plan(torch.device("cuda"))
    assert plan.needs_scaler == (plan.dtype is torch.float16)


def test_the_autocast_relief_is_skipped_with_a_word_where_its_kernels_could_crash(tmp_path, monkeypatch, capfd):
    # Where bf16 kernels would be compiled under a hard cap (onednn.py says why), the relief is counted as
    # done, so the ladder goes on to its next one, and the forward stays fp32; said on stderr and journaled.
    import json

    from autotune import Tuner
    from autotune.common.actions import UseAutocast

    monkeypatch.setattr("autotune.tuning.relief_ladder.builds_bf16_kernels_under_a_hard_cap",
                        lambda: "this CPU has native bf16 (amx_bf16), ...")
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
    with Tuner(model, torch.optim.SGD(model.parameters(), lr=0.1), loss_fn=nn.functional.cross_entropy,
               device="cpu", monitor=False, run_dir=tmp_path / "run") as tuner:
        tuner.step((torch.randn(8, 8), torch.randint(0, 2, (8,))))
        assert tuner.carry_out(UseAutocast("at the floor"))
        assert tuner.reliefs == ["autocast"] and tuner.core.autocast is None
        tuner.step((torch.randn(8, 8), torch.randint(0, 2, (8,))))
    (relief,) = [json.loads(line) for line in (tmp_path / "run" / "events.jsonl").read_text().splitlines()
                 if json.loads(line)["kind"] == "relief"]
    assert relief["note"].startswith("skipped: this CPU has native bf16")
    assert "memory relief: autocast (at the floor); skipped: this CPU has native bf16" in capfd.readouterr().err
