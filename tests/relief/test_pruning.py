"""Channel pruning frees memory for real: parameters, optimizer state and the step peak shrink;
outputs keep their shape; the optimizer stays the user's object, and the state of the kept channels
carries over exactly, so a scheduler the user steps keeps steering the parameters that train."""

import concurrent.futures

import pytest
import torch
import torchvision
from torch import nn

from autotune.common.actions import PruneChannels
from autotune.relief.pruning import _cut, prune_channels, remap_optimizer, tensor_bytes
from autotune.tuner import Tuner
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
    held = optimizer
    remap_optimizer(optimizer, result).apply()

    assert optimizer is held

    assert model(x).shape == shape  # the output layer was left whole
    assert result.ignored and 0.3 < result.removed_fraction < 0.5  # 25% of channels in and out: ~44% of weights
    assert tensor_bytes(list(model.parameters())) < 0.7 * params_before
    assert tensor_bytes(list(optimizer.state.values())) < 0.7 * state_before
    assert set(map(id, model.parameters())) == {id(p) for g in optimizer.param_groups for p in g["params"]}
    assert set(map(id, optimizer.state)) <= set(map(id, model.parameters()))  # no old entry holds its memory
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


def kept_rows(old: torch.Tensor, new: torch.Tensor) -> list[int]:
    """Which of `old`'s rows `new`'s are, found by value (each row of a random init is unique)."""
    return [next(i for i, row in enumerate(old) if torch.equal(row, kept)) for kept in new]


@pytest.mark.parametrize("schedule", [
    lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.0),
    lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda n: 1.0 if n < 3 else 0.0),
], ids=["StepLR", "LambdaLR"])
def test_a_scheduler_the_user_steps_steers_the_pruned_parameters_through_the_same_optimizer(tmp_path, schedule):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scheduler = schedule(optimizer)  # the user's: stepped by the user, as torchvision's reference does per epoch
    batch = (torch.randn(16, 8), torch.randint(0, 3, (16,)))
    with Tuner(model, optimizer, loss_fn=nn.functional.cross_entropy, device="cpu", run_dir=tmp_path / "run",
               monitor=False) as tuner:
        for _ in range(2):
            tuner.step(batch)
            scheduler.step()
        first, last = model[0], model[2]
        weight, bias, momentum = (first.weight.detach().clone(), first.bias.detach().clone(),
                                  {name: optimizer.state[p]["momentum_buffer"].clone()
                                   for name, p in model.named_parameters()})
        assert tuner.carry_out(PruneChannels(ratio=0.25))

        assert tuner.optimizer is optimizer  # on the old code: a new optimizer the scheduler knew nothing of
        assert first.weight.shape == (24, 8) and last.weight.shape == (3, 24)
        held = [p for group in optimizer.param_groups for p in group["params"]]
        assert [id(p) for p in held] == [id(p) for p in model.parameters()]  # the trained ones, in order
        rows = kept_rows(weight, first.weight.detach())
        assert torch.equal(first.bias.detach(), bias[rows])
        state = {name: optimizer.state[p]["momentum_buffer"] for name, p in model.named_parameters()}
        assert torch.equal(state["0.weight"], momentum["0.weight"][rows])  # the kept channels' momentum, sliced
        assert torch.equal(state["0.bias"], momentum["0.bias"][rows])
        assert torch.equal(state["2.weight"], momentum["2.weight"][:, rows])
        assert torch.equal(state["2.bias"], momentum["2.bias"])  # an uncut parameter's, as it was
        assert len(optimizer.state) == 4  # the old parameters' state is gone with them

        before = first.weight.detach().clone()
        tuner.step(batch)  # the schedule's third step: lr 0.1 still
        assert not torch.equal(first.weight.detach(), before)
        scheduler.step()  # from here the schedule sets lr 0
        assert [group["lr"] for group in tuner.optimizer.param_groups] == [0.0]
        weights = [p.detach().clone() for p in model.parameters()]
        tuner.step(batch)  # lr 0: SGD moves nothing, momentum or not
        assert all(torch.equal(p.detach(), w) for p, w in zip(model.parameters(), weights))


def test_state_not_shaped_like_its_parameter_is_cut_where_it_follows_it():
    # Adafactor keeps a row and a column factor per matrix (dimensions reduced to 1): each is cut
    # along the dimension it has in full, so the step after pruning runs on the kept channels' factors.
    torch.manual_seed(0)
    model, x = mlp()
    optimizer = torch.optim.Adafactor(model.parameters(), lr=1e-2)
    train_step(model, optimizer, x)
    old = {id(p): {k: v.clone() for k, v in optimizer.state[p].items()} for p in model.parameters()}
    result = prune_channels(model, x, 0.25)
    remap_optimizer(optimizer, result).apply()
    for key, (old_param, new, cuts) in result.replaced.items():
        state, kept = optimizer.state[new], dict(cuts)  # a dimension is cut once: its kept indices
        if new.dim() == 2:
            rows, cols = kept.get(0, range(old_param.shape[0])), kept.get(1, range(old_param.shape[1]))
            assert torch.equal(state["row_var"], old[key]["row_var"][list(rows)])  # (out, 1): cut by rows
            assert torch.equal(state["col_var"], old[key]["col_var"][:, list(cols)])  # (1, in): by columns
        else:
            assert torch.equal(state["variance"], old[key]["variance"][kept[0]])
        assert torch.equal(state["step"], old[key]["step"])
    assert torch.isfinite(torch.tensor(train_step(model, optimizer, x)))  # on the old code: a shape error


class FlatMomentum(torch.optim.Optimizer):
    """A momentum kept flat (as LBFGS keeps its history): its state follows no dimension of the parameter."""

    def __init__(self, params, lr=0.1):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    flat = self.state[p].setdefault("flat", torch.zeros(p.numel()))
                    p.sub_(group["lr"] * flat.mul_(0.9).add_(p.grad.flatten()).view_as(p))


def test_state_that_cannot_be_cut_starts_fresh_with_a_word(tmp_path, capfd):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 3))
    optimizer = FlatMomentum(model.parameters())
    batch = (torch.randn(16, 8), torch.randint(0, 3, (16,)))
    with Tuner(model, optimizer, loss_fn=nn.functional.cross_entropy, device="cpu", run_dir=tmp_path / "run",
               monitor=False) as tuner:
        tuner.step(batch)
        uncut = optimizer.state[model[2].bias]["flat"].clone()
        assert tuner.carry_out(PruneChannels(ratio=0.25))
        # A bias's flat state is shaped like it, and cut; the matrices' start afresh; the uncut bias keeps its own.
        assert set(optimizer.state) == {model[0].bias, model[2].bias}
        assert torch.equal(optimizer.state[model[2].bias]["flat"], uncut)
        assert "2 pruned parameter(s) start with fresh optimizer state: FlatMomentum's state is not shaped like " \
               "its parameter ((32, 8): flat; (3, 32): flat)" in capfd.readouterr().err
        assert torch.isfinite(tuner.step(batch))  # on the old code: the old flat state, a shape error here


PEAK = """
import torch, torchvision
from torch import nn
from autotune.memory.limits import fix_mmap_threshold
from autotune.memory.demand import StepPeak
from autotune.relief.pruning import prune_channels, remap_optimizer
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
remap_optimizer(optimizer, prune_channels(model, x, 0.5)).apply()
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
