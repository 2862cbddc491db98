"""norm_stats.py: BatchNorm's running statistics over a batch that runs in micro-batches."""

import json

import pytest
import torch
from torch import nn

from autotune import Tuner


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
    assert capfd.readouterr().err.count("normalises each micro-batch of 16") == 1


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
