"""Channel pruning frees memory for real: parameters, optimizer state and the step peak shrink;
outputs keep their shape; the optimizer state of the kept channels carries over exactly."""

import concurrent.futures

import pytest
import torch
import torchvision
from torch import nn

from autotune.relief.pruning import _cut, prune_channels, rebind_scheduler, rebuild_optimizer, tensor_bytes
from tests.conftest import run_python


def mlp():
    return nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10)), \
        torch.randn(16, 64)


def cnn():
    return nn.Sequential(nn.Conv2d(3, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.Conv2d(32, 64, 3, padding=1),
                         nn.BatchNorm2d(64), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 10)), \
        torch.randn(8, 3, 32, 32)


def resnet():
    return torchvision.models.resnet18(num_classes=10), torch.randn(4, 3, 64, 64)


def train_step(model, optimizer, x):
    loss = nn.functional.cross_entropy(model(x), torch.arange(len(x)) % 10)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.item()


@pytest.mark.parametrize("build", [mlp, cnn, resnet])
@pytest.mark.parametrize("optimizer_cls", [torch.optim.AdamW, lambda p: torch.optim.SGD(p, lr=0.01, momentum=0.9)])
def test_pruning_shrinks_parameters_and_carries_the_optimizer_state(build, optimizer_cls):
    torch.manual_seed(0)
    model, x = build()
    optimizer = optimizer_cls(model.parameters()) if optimizer_cls is not torch.optim.AdamW else \
        torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(2):
        train_step(model, optimizer, x)
    shape = model(x).shape
    params_before, state_before = tensor_bytes(list(model.parameters())), tensor_bytes(list(optimizer.state.values()))
    old_values = {id(p): p.detach().clone() for p in model.parameters()}
    old_state = {id(p): {k: v.clone() for k, v in optimizer.state[p].items() if isinstance(v, torch.Tensor)}
                 for p in model.parameters()}

    result = prune_channels(model, x, 0.25)
    optimizer = rebuild_optimizer(optimizer, result)

    assert model(x).shape == shape  # the output layer was left whole
    assert result.ignored and 0.3 < result.removed_fraction < 0.5  # 25% of channels in and out: ~44% of weights
    assert tensor_bytes(list(model.parameters())) < 0.7 * params_before
    assert tensor_bytes(list(optimizer.state.values())) < 0.7 * state_before
    assert set(map(id, model.parameters())) == {id(p) for g in optimizer.param_groups for p in g["params"]}
    for key, (old, new, cuts) in result.replaced.items():
        assert torch.equal(_cut(old_values[key], cuts), new.detach())  # kept weights are the old ones
        for name, value in old_state[key].items():
            if value.shape == old.shape:
                assert torch.equal(_cut(value, cuts), optimizer.state[new][name]), name  # and so is their state
    unchanged = [p for p in model.parameters() if id(p) in old_state]
    for p in unchanged:  # parameters no cut touched keep their state object as it was
        assert all(torch.equal(optimizer.state[p][k], v) for k, v in old_state[id(p)].items())
    for _ in range(3):
        assert torch.isfinite(torch.tensor(train_step(model, optimizer, x)))


def test_the_scheduler_follows_the_rebuilt_optimizer():
    model, x = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    train_step(model, optimizer, x)
    scheduler.step()
    optimizer = rebuild_optimizer(optimizer, prune_channels(model, x, 0.25))
    rebind_scheduler(scheduler, optimizer)
    assert optimizer.param_groups[0]["lr"] == 0.05  # the group's settings carried over
    train_step(model, optimizer, x)
    scheduler.step()
    assert optimizer.param_groups[0]["lr"] == 0.025


PEAK = """
import torch, torchvision
from torch import nn
from autotune.limits import fix_mmap_threshold
from autotune.demand import StepPeak
from autotune.relief.pruning import prune_channels, rebuild_optimizer
fix_mmap_threshold()  # big tensors mmapped: freed memory leaves the resident size
torch.set_num_threads(1)
torch.backends.mkldnn.enabled = False  # its scratchpad, sized for the largest conv seen, outlives the pruning
torch.manual_seed(0)
model, x = {build}
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
peak = StepPeak(torch.device("cpu"))

def step():
    loss = nn.functional.cross_entropy(model(x), torch.arange(len(x)) % 10)
    loss.backward(); optimizer.step(); optimizer.zero_grad(set_to_none=True)

def measure():
    # What a step adds to what stays resident (gradients, activations, temporaries), after
    # two warm steps: the optimizer state exists and the kernels' code is paged in (the
    # resident size counts library pages a first step touches).
    step(); step()
    before_step = peak.current()
    peak.start(); step()
    return peak.peak() - before_step

before = measure()
optimizer = rebuild_optimizer(optimizer, prune_channels(model, x, 0.5))
"""


PEAK_MODELS = {
    "mlp": "(nn.Sequential(nn.Linear(256, 4096), nn.ReLU(), nn.Linear(4096, 4096), nn.ReLU(), nn.Linear(4096, 10)), "
           "torch.randn(64, 256))",
    "cnn": "(nn.Sequential(nn.Conv2d(3, 64, 3, padding=1), nn.ReLU(), nn.Conv2d(64, 128, 3, padding=1), nn.ReLU(), "
           "nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(128, 10)), torch.randn(32, 3, 32, 32))",
    "resnet18": "(torchvision.models.resnet18(num_classes=10), torch.randn(16, 3, 32, 32))",
}


@pytest.mark.slow
def test_pruning_lowers_the_measured_step_peak(tmp_path):
    # One process per model, all at once: each measures its own resident peak.
    def peaks(name):
        folder = tmp_path / name
        folder.mkdir()
        script = PEAK.format(build=PEAK_MODELS[name]) + "after = measure()\nsave({'before': before, 'after': after})\n"
        proc, result = run_python(script, folder, timeout=300)
        assert proc.returncode == 0, f"{name}: {proc.stderr[-3000:]}"
        return name, result

    with concurrent.futures.ThreadPoolExecutor(len(PEAK_MODELS)) as pool:
        for name, result in pool.map(peaks, PEAK_MODELS):
            assert result["after"] < 0.7 * result["before"], (name, result)  # half the channels: well under


class Residual(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(32, 128), nn.Linear(128, 32)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))


def test_pruning_that_would_break_the_model_leaves_it_untouched():
    from autotune.relief.pruning import UnsafePruning

    model = nn.Sequential(Residual(), Residual(), nn.Linear(32, 4))  # the residual stream is the raw input
    shapes = [p.shape for p in model.parameters()]
    with pytest.raises(UnsafePruning, match="does not run"):
        prune_channels(model, torch.randn(2, 32), 0.3)
    assert [p.shape for p in model.parameters()] == shapes
    stem = nn.Sequential(nn.Linear(16, 32), Residual(), Residual(), nn.Linear(32, 4))  # a stem makes it prunable
    prune_channels(stem, torch.randn(2, 16), 0.3)
    assert stem(torch.randn(2, 16)).shape == (2, 4)
