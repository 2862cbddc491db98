"""norm_stats.py: BatchNorm's running statistics over a batch that runs in micro-batches."""

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from autotune import Tuner
from autotune.step.norm_stats import BatchNormStats


class TwoBranches(nn.Module):
    # BatchNorm2d and BatchNorm1d side by side, neither downstream of the other: a BatchNorm after
    # another sees inputs the first normalised per micro-batch, which no rule can make the batch's.
    def __init__(self, momentum):
        super().__init__()
        self.conv = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8, momentum=momentum), nn.ReLU(),
                                  nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.wide = nn.Sequential(nn.Flatten(), nn.BatchNorm1d(3 * 8 * 8, momentum=momentum), nn.Linear(192, 8))
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        return self.head(self.conv(x) + self.wide(x))


def _cnn(momentum=0.1):
    torch.manual_seed(0)
    return TwoBranches(momentum)


def _batches(steps=5):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(64, 3, 8, 8, generator=g) * 2 + 1, torch.randint(0, 4, (64,), generator=g))
            for _ in range(steps)]


@pytest.mark.parametrize("momentum", [0.1, None])  # None: BatchNorm's cumulative average
def test_running_statistics_at_micro_batch_16_of_64_are_a_whole_batch_loops(tmp_path, momentum, capfd):
    # lr 0: the weights stay put, so every BatchNorm sees the same inputs in both loops; what differs
    # is only how the running statistics are gathered (4 micro-batches of 16, or the batch of 64).
    plain = _cnn(momentum)
    for x, _ in _batches():
        plain(x)
    model = _cnn(momentum)
    with Tuner(model, torch.optim.SGD(model.parameters(), lr=0.0), loss_fn=nn.functional.cross_entropy,
               device="cpu", run_dir=tmp_path / "run", monitor=False, micro_batch_size=16, batch_size=64) as tuner:
        for batch in _batches():
            tuner.step(batch)
    for (name, mine), theirs in zip(model.state_dict().items(), plain.state_dict().values()):
        if "num_batches_tracked" in name:
            assert int(mine) == int(theirs) == 5, name
        else:
            torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-6, msg=name)
    (said,) = [r for r in map(json.loads, (tmp_path / "run" / "events.jsonl").read_text().splitlines())
               if r["kind"] == "numerics"]
    assert (said["micro_batch_size"], said["batch_size"], said["modules"]) == (16, 64, 2)
    assert capfd.readouterr().err.count("normalises each micro-batch over its own samples (micro-batch 16 now)") == 1


def test_a_batch_in_one_piece_is_left_to_batchnorm_itself(tmp_path):
    model = _cnn()
    with Tuner(model, torch.optim.SGD(model.parameters(), lr=0.0), loss_fn=nn.functional.cross_entropy,
               device="cpu", run_dir=tmp_path / "run", monitor=False) as tuner:
        tuner.step(_batches(1)[0])
        assert not tuner.core.norms.active and model.conv[1].momentum == 0.1
    assert int(model.conv[1].num_batches_tracked) == 1
    assert "numerics" not in (tmp_path / "run" / "events.jsonl").read_text()


@pytest.mark.parametrize("momentum", [0.1, None])  # None: InstanceNorm updates nothing, as F.instance_norm
def test_instance_norms_running_statistics_follow_the_same_rule(tmp_path, momentum):
    def model():
        torch.manual_seed(0)
        return nn.Sequential(nn.InstanceNorm2d(3, track_running_stats=True, momentum=momentum),
                             nn.Conv2d(3, 4, 3), nn.AdaptiveAvgPool2d(1), nn.Flatten())

    plain = model()
    for x, _ in _batches():
        plain(x)
    tuned = model()
    with Tuner(tuned, torch.optim.SGD(tuned.parameters(), lr=0.0), loss_fn=nn.functional.cross_entropy,
               device="cpu", run_dir=tmp_path / "run", monitor=False, micro_batch_size=16, batch_size=64) as tuner:
        for batch in _batches():
            tuner.step(batch)
    norm, theirs = tuned[0], plain[0]
    if momentum is not None:  # moved at all (else both stay at their start)
        assert not torch.allclose(theirs.running_mean, torch.zeros(3))
    torch.testing.assert_close(norm.running_mean, theirs.running_mean, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(norm.running_var, theirs.running_var, rtol=1e-5, atol=1e-6)
    assert int(norm.num_batches_tracked) == int(theirs.num_batches_tracked)


def _raw_features(steps=8):
    # A first-layer BatchNorm on raw features: a year-like offset with a tiny spread, a price-like
    # one, and a standard normal. Float32, as a user's data would be.
    g = torch.Generator().manual_seed(3)
    means, stds = torch.tensor([3000.0, 100.0, 0.0]), torch.tensor([0.05, 0.1, 1.0])
    return [(torch.randn(64, 3, generator=g) * stds + means, torch.randn(64, 1, generator=g)) for _ in range(steps)]


def test_running_statistics_far_from_zero_are_the_whole_batchs_in_float64(tmp_path):
    # The old rule, E[x^2] - E[x]^2 in float32, gave a running_var of 0.58-0.67 for the first
    # feature where the batches' own give 0.432: the variance cancelled away under the offset.
    batches = _raw_features()
    by_hand_mean, by_hand_var = torch.zeros(3, dtype=torch.float64), torch.ones(3, dtype=torch.float64)
    for x, _ in batches:
        x = x.double()
        by_hand_mean = 0.9 * by_hand_mean + 0.1 * x.mean(0)
        by_hand_var = 0.9 * by_hand_var + 0.1 * x.var(0)  # unbiased, as BatchNorm keeps it
    whole = nn.BatchNorm1d(3, momentum=0.1).double()
    for x, _ in batches:
        whole(x.double())
    torch.testing.assert_close(whole.running_mean, by_hand_mean, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(whole.running_var, by_hand_var, rtol=1e-12, atol=1e-12)

    torch.manual_seed(0)
    model = nn.Sequential(nn.BatchNorm1d(3, momentum=0.1), nn.Linear(3, 1))
    with Tuner(model, torch.optim.SGD(model.parameters(), lr=0.0), loss_fn=nn.functional.mse_loss, device="cpu",
               run_dir=tmp_path / "run", monitor=False, micro_batch_size=16, batch_size=64) as tuner:
        for batch in batches:
            tuner.step(batch)
    norm = model[0]
    assert int(norm.num_batches_tracked) == 8
    torch.testing.assert_close(norm.running_mean.double(), by_hand_mean, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(norm.running_var.double(), by_hand_var, rtol=2e-6, atol=0)


def test_instance_norm_far_from_zero_keeps_the_float64_statistics(tmp_path):
    # Each sample's own mean and variance (two-pass), averaged: no cancellation to lose digits to.
    g = torch.Generator().manual_seed(4)
    offset = torch.tensor([3000.0, 100.0, 0.0]).view(1, 3, 1, 1)
    spread = torch.tensor([0.05, 0.1, 1.0]).view(1, 3, 1, 1)
    batches = [(torch.randn(64, 3, 4, 4, generator=g) * spread + offset, torch.randn(64, 1, generator=g))
               for _ in range(8)]
    by_hand_mean, by_hand_var = torch.zeros(3, dtype=torch.float64), torch.ones(3, dtype=torch.float64)
    for x, _ in batches:
        x = x.double().flatten(2)
        by_hand_mean = 0.9 * by_hand_mean + 0.1 * x.mean(2).mean(0)
        by_hand_var = 0.9 * by_hand_var + 0.1 * x.var(2).mean(0)
    torch.manual_seed(0)
    model = nn.Sequential(nn.InstanceNorm2d(3, momentum=0.1, track_running_stats=True), nn.Flatten(), nn.Linear(48, 1))
    with Tuner(model, torch.optim.SGD(model.parameters(), lr=0.0), loss_fn=nn.functional.mse_loss, device="cpu",
               run_dir=tmp_path / "run", monitor=False, micro_batch_size=16, batch_size=64) as tuner:
        for batch in batches:
            tuner.step(batch)
    torch.testing.assert_close(model[0].running_mean.double(), by_hand_mean, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(model[0].running_var.double(), by_hand_var, rtol=2e-6, atol=0)


@settings(max_examples=30, deadline=None, derandomize=True, database=None)  # the same cases each run, no files
@given(offset=st.floats(-1e4, 1e4), log_spread=st.floats(-3, 2), positions=st.sampled_from([0, 1, 5]),
       pieces=st.lists(st.integers(1, 9), min_size=1, max_size=6), seed=st.integers(0, 2**16))
def test_any_split_gives_the_float64_mean_and_unbiased_variance(offset, log_spread, positions, pieces, seed):
    # The norm's moments, micro-batch by micro-batch, against the float64 statistics of the very
    # float32 values it was given (momentum 1: the running statistics are the batch's).
    g = torch.Generator().manual_seed(seed)
    if positions < 2:
        pieces = [max(piece, 2) for piece in pieces]  # BatchNorm refuses a single value per channel
    shape = (sum(pieces), 2) + ((positions,) if positions else ())
    x = (torch.randn(shape, generator=g, dtype=torch.float64) * 10 ** log_spread + offset).float()
    norm = nn.BatchNorm1d(2, momentum=1.0)
    stats = BatchNormStats(norm)
    stats.begin(split=True)
    for piece in x.split(pieces):
        norm(piece)
    stats.pause()
    stats.settle()
    dims = [0, *range(2, x.ndim)]
    exact = x.double()
    spread = float(exact.std(dims, correction=0).max())
    torch.testing.assert_close(norm.running_mean.double(), exact.mean(dims), rtol=1e-6, atol=1e-5 * spread + 1e-30)
    torch.testing.assert_close(norm.running_var.double(), exact.var(dims), rtol=1e-5, atol=1e-30)
    assert int(norm.num_batches_tracked) == 1
