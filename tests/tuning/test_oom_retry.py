"""A batch's first OOM at the size the last batch completed at is retried once at that size
(CUDA's default, issue 45): a transient spike, a real OOM under RLIMIT_AS in a subprocess, fits on
the retry; nothing is halved, the weights are those of a run without the spike, and the journal
and `autotune report` say so. At a size that never completed a batch there is no retry."""

import pytest

from tests.conftest import journal, run_python

pytestmark = pytest.mark.slow

SPIKE = """
import torch
from torch import nn
from torch.utils.data import TensorDataset
from autotune import AutoTrainer
from autotune.memory.limits import cap_address_space, lift_address_space_cap

g = torch.Generator().manual_seed(0)
data = TensorDataset(torch.randn(64, 8, generator=g), torch.randint(0, 2, (64,), generator=g))
HEADROOM = 512 * 2**20
spikes, calls = [], []

def step(model, batch):
    calls.append(1)
    if len(calls) >= FROM and len(spikes) < SPIKES:  # from the FROM-th attempt, SPIKES attempts in a row:
        spikes.append(1)                             # something transient needs twice the headroom
        torch.empty(2 * HEADROOM, dtype=torch.uint8).fill_(1)
    return nn.functional.cross_entropy(model(batch[0]), batch[1])

def fit(run_dir, retries_same_size):
    torch.manual_seed(0)
    model = nn.Linear(8, 2)
    trainer = AutoTrainer(model, data, step_fn=step, batch_size=16, device="cpu", progress=False, monitor=False,
                          checkpoint_interval=None, run_dir=run_dir, optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
    trainer.tuner.recovery.retries_same_size = retries_same_size  # CUDA's default; CPU's is off
    cap_address_space(HEADROOM)
    try:
        result = trainer.fit(epochs=1)
    finally:
        lift_address_space_cap()
    trainer.close()
    return result, [p.detach().clone() for p in model.parameters()]

SPIKES, FROM = 0, 1
_, reference = fit("reference", False)
out = {}
# At the third batch (its size completed two), or at the first (a size that never completed one).
for name, retry, SPIKES, FROM in (("retried", True, 1, 3), ("halved", False, 1, 3), ("twice", True, 2, 3),
                                  ("first", True, 1, 1)):
    spikes.clear()
    calls.clear()
    result, weights = fit(name, retry)
    out[name] = {"ooms": result.ooms, "micro": result.micro_batch_size, "samples": result.samples_seen,
                 "same": all(torch.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(weights, reference))}
save(out)
"""


def test_a_transient_oom_fits_on_a_same_size_retry_and_the_report_says_so(tmp_path):
    proc, out = run_python(SPIKE, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "can't allocate memory" in "".join(r.get("message", "") for r in journal(tmp_path / "retried")
                                              if r["kind"] == "oom")  # a real OOM, not a raised one
    retried = out["retried"]
    assert retried == {"ooms": 1, "micro": 16, "samples": 64, "same": True}, out
    kinds = [r["kind"] for r in journal(tmp_path / "retried")]
    assert kinds.count("oom_retry") == 1 and "action" not in kinds  # no policy was asked: nothing halved
    assert out["halved"]["ooms"] == 1 and out["halved"]["same"]  # without the retry: the policies halve
    assert "oom_retry" not in [r["kind"] for r in journal(tmp_path / "halved")]
    # A second OOM of the same batch goes to the policies: one retry, then a smaller size.
    twice = [r for r in journal(tmp_path / "twice") if r["kind"] in ("oom", "oom_retry", "action")]
    assert [r["kind"] for r in twice][:4] == ["oom", "oom_retry", "oom", "action"], twice
    assert twice[3]["policy"] == "halve_on_oom" and "oom_retry" not in [r["kind"] for r in twice[4:]]
    assert out["twice"]["same"] and out["twice"]["samples"] == 64
    # A size that never completed a batch is too large, not unlucky: no retry, the policies at once.
    assert out["first"]["ooms"] == 1 and out["first"]["same"]
    assert [r["kind"] for r in journal(tmp_path / "first") if r["kind"] in ("oom", "oom_retry", "action")][:2] == [
        "oom", "action"]

    from autotune.observe.report import summarize, render

    assert summarize(tmp_path / "retried")["ooms"]["same_size_retries"] == 1
    assert "retried at the same micro-batch first (the cache emptied): 1, of which 1 fit" in render(
        summarize(tmp_path / "retried"))
    assert summarize(tmp_path / "twice")["ooms"]["same_size_fit"] == 0
