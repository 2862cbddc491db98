"""A run that fits must also resume under the same memory cap: settled near its RLIMIT_AS cap (an
OOM at micro-batch 256, trained on at a smaller one), killed with SIGKILL, resumed under the same
cap, it ends with the weights of the run that was never killed. Loading the checkpoint (weights,
AdamW's state, random states) must not need more room than training does. The model's state is
a large part of its memory on purpose (19 MB of weights, twice that of AdamW state)."""

import pytest
import torch

from tests.conftest import journal, run_python, skip_if_uncalibrated

pytestmark = pytest.mark.slow  # three interpreters, each calibrating its cap with real OOMs

TRAIN = """
import os, signal, torch
from torch import nn
from torch.utils.data import TensorDataset
from autotune import AutoTrainer
from autotune.memory.limits import adam_state_bytes, calibrate_headroom, cap_address_space, fix_mmap_threshold

fix_mmap_threshold()  # freed blocks go back to the OS: the address space follows live memory
# The resumed run may train at other micro-batch sizes (see the test), so its gradients differ from
# the whole run's in rounding. AdamW divides by sqrt(v) + eps: a gradient that is rounding noise
# (~1e-9, dead ReLUs) becomes a full lr-sized step of either sign at the default eps=1e-8 (0.016
# apart after 8 steps, seen in a full suite). eps=1e-4 keeps noise noise (128 vs 256: 3e-8 apart).
EPS = 1e-4
torch.manual_seed(0)
g = torch.Generator().manual_seed(0)
data = TensorDataset(torch.randn(2048, 32, generator=g), torch.randint(0, 4, (2048,), generator=g))
model = nn.Sequential(nn.Linear(32, 16384), nn.ReLU(), nn.Linear(16384, 256), nn.ReLU(), nn.Linear(256, 4))

def step(model, batch):
    if KILL_AT is not None and trainer.step == KILL_AT:
        os.kill(os.getpid(), signal.SIGKILL)
    x, y = batch
    return nn.functional.cross_entropy(model(x), y)

trainer = AutoTrainer(model, data, step_fn=step, batch_size=512, device="cpu", run_dir=RUN_DIR, progress=False,
                      monitor=False, checkpoint_every=1, optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3, eps=EPS))

def probe(rows):
    x, y = data[:rows]
    try:
        nn.functional.cross_entropy(model(x), y).backward()
    finally:
        model.zero_grad(set_to_none=True)

if HEADROOM is None:  # the first run measures; the others take its figure, so the cap is the same
    grads = sum(p.numel() * 4 for p in model.parameters())  # held across micro-batches
    calibration = calibrate_headroom(probe, fits=64, fails=512, extra_bytes=adam_state_bytes(model) + grads)
    if calibration.headroom_bytes is None:
        save({"uncalibrated": str(calibration)})
        raise SystemExit(0)
    headroom = calibration.headroom_bytes
else:
    probe(2)  # the same warm-up as a calibrating run ends with
    headroom = HEADROOM
cap_address_space(headroom)
result = trainer.fit(epochs=2, resume=RESUME)
torch.save(model.state_dict(), RUN_DIR + "/final.pt")
save({"headroom": headroom, "calibration": str(calibration) if HEADROOM is None else None, "micro": result.micro_batch_size, "ooms": result.ooms, "samples": result.samples_seen})
"""


def train(tmp_path, run_dir, headroom=None, kill_at=None, resume=False):
    settings = f"HEADROOM={headroom}\nKILL_AT={kill_at}\nRESUME={resume}\nRUN_DIR={str(run_dir)!r}\n"
    return run_python(settings + TRAIN, tmp_path, timeout=300)


def test_a_run_settled_near_its_cap_is_killed_and_resumes_under_the_same_cap(tmp_path):
    proc, whole = train(tmp_path, tmp_path / "whole")
    assert proc.returncode == 0, proc.stderr[-3000:]
    skip_if_uncalibrated(whole)
    assert whole["ooms"] >= 1 and whole["micro"] < 512 and whole["samples"] == 4096, whole  # settled below its cap
    proc, _ = train(tmp_path, tmp_path / "killed", headroom=whole["headroom"], kill_at=5)
    assert proc.returncode == -9, proc.stderr[-3000:]
    proc, resumed = train(tmp_path, tmp_path / "killed", headroom=whole["headroom"], resume=True)
    assert proc.returncode == 0, proc.stderr[-3000:]  # the load fitted under the cap training fits under
    assert [r["step"] for r in journal(tmp_path / "killed") if r["kind"] == "resume"] == [5]
    # The sizes it tries after the resume may differ (its memory is laid out afresh, and the policies
    # may grow the micro-batch back: 512 fitted once after a resume on a loaded machine); what it learns may not.
    assert resumed["samples"] == 4096
    weights = torch.load(tmp_path / "killed" / "final.pt", weights_only=True)
    for key, value in torch.load(tmp_path / "whole" / "final.pt", weights_only=True).items():
        torch.testing.assert_close(weights[key], value, rtol=1e-5, atol=1e-6)
