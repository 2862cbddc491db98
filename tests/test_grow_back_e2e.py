"""grow_back end to end under a real RLIMIT_AS cap: the run ends near the largest micro-batch
that really fits (found here by probing subprocesses), from far below and from far above."""

import concurrent.futures

import pytest

from tests.conftest import journal, run_python

pytestmark = pytest.mark.slow

MODEL = """
import torch
from torch import nn
from torch.utils.data import TensorDataset
from autotune.limits import cap_address_space
torch.manual_seed(0)
g = torch.Generator().manual_seed(0)
data = TensorDataset(torch.randn(8192, 32, generator=g), torch.randint(0, 4, (8192,), generator=g))
model = nn.Sequential(nn.Linear(32, 8192), nn.ReLU(), nn.Linear(8192, 4))
optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
nn.functional.cross_entropy(model(data[:2][0]), data[:2][1]).backward()  # warm up, then cap
model.zero_grad(set_to_none=True)
BUDGET = 72 * 2**20
"""

PROBE = MODEL + """
cap_address_space(BUDGET)
try:
    for _ in range(2):  # two steps: the momentum buffers exist for the second
        x, y = data[:SIZE]
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    save({"fits": True})
except RuntimeError as exc:
    save({"fits": False, "error": str(exc)[:100]})
"""

TRAIN = MODEL + """
from autotune import AutoTrainer
from autotune.policies import GrowBack, HalveOnOOM
trainer = AutoTrainer(model, data, loss_fn=nn.functional.cross_entropy, optimizer=optimizer, batch_size=2048,
                      micro_batch_size=START, device="cpu", run_dir=RUN_DIR, progress=False, monitor=False,
                      # headroom 0.95: at the default 0.9 growth stops where a step demands 90% of its room,
                      # which here is 10% below the largest size, on the test's own bound (568 of 632 once)
                      policies=[HalveOnOOM(), GrowBack(calm_steps=2, search_calm_steps=1, headroom=0.95)])
cap_address_space(BUDGET)
result = trainer.fit(epochs=3)
save({"micro": result.micro_batch_size, "ooms": result.ooms, "samples": result.samples_seen})
"""


def fits(tmp_path, *sizes):
    """Whether each size fits, probed in fresh processes at once (each under its own cap)."""
    def probe(size):
        folder = tmp_path / f"size{size}"
        folder.mkdir(exist_ok=True)
        proc, result = run_python(f"SIZE={size}\n" + PROBE, folder)
        assert proc.returncode == 0, proc.stderr[-2000:]
        return result["fits"]
    with concurrent.futures.ThreadPoolExecutor(len(sizes)) as pool:
        return list(pool.map(probe, sizes))


@pytest.fixture(scope="module")
def largest(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("probe")
    # 256 fits, 1024 does not (checked below; the largest was 632 on the 2-core CI machine): a
    # narrower start than 16..2048 saves two rounds of probes
    lo, hi = 256, 1024
    assert fits(tmp, lo, hi) == [True, False]
    while hi - lo > max(2, lo // 50):  # to within 2%: two probes a round, the interval in thirds
        third = max(1, (hi - lo) // 3)
        a, b = lo + third, min(hi - 1, lo + 2 * third)
        fits_a, fits_b = fits(tmp, a, b)
        lo, hi = (b, hi) if fits_b else (a, b) if fits_a else (lo, a)
    return lo


def train(tmp_path, start):
    run_dir = tmp_path / "run"
    proc, result = run_python(f"START={start!r}\nRUN_DIR={str(run_dir)!r}\n" + TRAIN, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return result, journal(run_dir)


def test_from_far_below_it_grows_to_within_10_percent(tmp_path, largest):
    result, records = train(tmp_path, start=max(1, largest // 8))
    assert result["samples"] == 8192 * 3
    # within 10% of the largest size a fresh process fits (the probe is itself within 2%)
    assert abs(result["micro"] - largest) <= 0.1 * largest, (result, largest)


def test_from_far_above_it_shrinks_grows_back_and_settles(tmp_path, largest):
    result, records = train(tmp_path, start="auto")  # "auto": start at the whole batch, 2048
    assert result["samples"] == 8192 * 3
    # within 10% of the largest size a fresh process fits (the probe is itself within 2%)
    assert abs(result["micro"] - largest) <= 0.1 * largest, (result, largest)
    # no more OOMs than a binary search needs: halvings down, then probes within the gap
    halvings = (2048 // largest).bit_length()
    assert result["ooms"] <= halvings + 4, result
    # settled: after the last OOM, at most the probes that stay below it and then no change
    last_oom = max(i for i, r in enumerate(records) if r["kind"] == "oom")
    changes = [r for r in records[last_oom:] if r["kind"] == "action" and r["applied"]]
    assert len(changes) <= 4 and records[-1]["micro_batch_size"] == result["micro"]
