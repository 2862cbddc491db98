"""torch.compile: a compiled model trains through OOM-driven micro-batch changes, with a bounded
number of compiles, the same weights as eager, and the checkpointing relief on top."""

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from autotune import AutoTrainer
from autotune.common.actions import CheckpointActivations
from tests.conftest import journal

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def data(n=48):
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(n, 8, generator=g), torch.randint(0, 3, (n,), generator=g))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x):
        return x + torch.tanh(self.fc(x))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.inp, self.blocks, self.out = nn.Linear(8, 16), nn.ModuleList([Block(), Block()]), nn.Linear(16, 3)

    def forward(self, x):
        x = self.inp(x)
        for block in self.blocks:
            x = block(x)
        return self.out(x)


def need(t, limit):
    """`t`, plus (above `limit` samples) more memory than any machine has: a real allocator refusal."""
    if t.shape[0] > limit:
        return t + torch.zeros(1 << 55, dtype=torch.uint8)[0]
    return t


def step_oom_in(phase, limit):
    def step(model, micro):
        x, y = micro
        if phase == "forward":
            x = need(x, limit)
        out = model(x)
        if phase == "backward":
            out.register_hook(lambda g: need(g, limit))  # runs in backward, before the compiled graph's own
        return nn.functional.cross_entropy(out, y)
    return step


def train(tmp_path, name, model, step, **kwargs):
    run = AutoTrainer(model, data(), step_fn=step, batch_size=16, device="cpu", progress=False, monitor=False,
                      optimizer=lambda p: torch.optim.SGD(p, lr=0.1), run_dir=tmp_path / name, shuffle=False,
                      **kwargs)
    return run, run.fit(epochs=2)


@pytest.mark.parametrize("phase", ["forward", "backward"])
def test_a_compiled_model_survives_ooms_with_few_compiles_and_the_eager_weights(tmp_path, phase):
    torch._dynamo.reset()
    net = Net()
    compiled = torch.compile(net, backend="aot_eager")
    run, result = train(tmp_path, phase, compiled, step_oom_in(phase, 4))
    eager = Net()
    train(tmp_path, "eager", eager, step_oom_in(phase, 100), micro_batch_size=4)
    assert result.ooms >= 1 and result.micro_batch_size <= 4 and result.samples_seen == 96
    for a, b in zip(net.parameters(), eager.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    fit_end = [r for r in journal(tmp_path / phase) if r["kind"] == "fit_end"][-1]
    assert 1 <= fit_end["compiles"] <= 4  # sizes 16, 8, 4 (and fit_micro_batch's moves) share a dynamic graph


def test_compile_true_and_the_checkpointing_relief_on_a_compiled_model(tmp_path):
    torch._dynamo.reset()
    net = Net()
    run = AutoTrainer(net, data(), loss_fn=nn.functional.cross_entropy, batch_size=16, device="cpu",
                      progress=False, monitor=False, optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
                      run_dir=tmp_path / "run", shuffle=False, compile={"backend": "aot_eager"})
    run.fit(epochs=1)
    assert run.tuner.carry_out(CheckpointActivations(reason="test"))
    run.fit(epochs=2)
    eager = Net()
    reference = AutoTrainer(eager, data(), loss_fn=nn.functional.cross_entropy, batch_size=16, device="cpu",
                            progress=False, monitor=False, optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
                            run_dir=tmp_path / "eager", shuffle=False)
    reference.fit(epochs=2)
    for a, b in zip(net.parameters(), eager.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert run.reliefs == ["checkpointing"]
