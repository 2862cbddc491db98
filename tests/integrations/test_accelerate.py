"""An Accelerate loop with gradient accumulation 2 (a prepared model, optimizer and DataLoader,
`accelerator.accumulate`), trained through `Tuner.step` or `Tuner.accumulate` with OOMs injected
in 30% of micro-batches, ends with the weights of the same loop without autotune (SGD, 1e-6).
The OOMs land on batches where Accelerate holds gradients back and on its sync batches alike;
`step_count` counts the optimizer steps Accelerate took, not the calls."""

import pytest

from tests.conftest import run_python

pytest.importorskip("accelerate")
pytestmark = pytest.mark.slow  # an interpreter a case (Accelerate's state is one per process)

SCRIPT = """
import json
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from accelerate import Accelerator
from autotune import Tuner

accelerator = Accelerator(gradient_accumulation_steps=2, cpu=True)

def build():
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(320, 8, generator=g), torch.randn(320, 1, generator=g))
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    return accelerator.prepare(model, optimizer, DataLoader(data, batch_size=32))

def loss_of(model, batch):
    x, y = batch
    return nn.functional.mse_loss(model(x), y)

model, optimizer, loader = build()
for epoch in range(2):
    for batch in loader:
        with accelerator.accumulate(model):
            accelerator.backward(loss_of(model, batch))
            optimizer.step()
            optimizer.zero_grad()
plain = {k: v.clone() for k, v in model.state_dict().items()}

model, optimizer, loader = build()
with Tuner(model, optimizer, device="cpu", inject_oom=0.3, seed=SEED, monitor=False, run_dir=RUN_DIR) as tuner:
    for epoch in range(2):
        for batch in loader:
            with accelerator.accumulate(model):
                if MODE == "step":
                    tuner.step(batch, lambda m, b: loss_of(m, b) / 2)
                else:  # the loop steps its own optimizer
                    tuner.accumulate(batch, lambda m, b: loss_of(m, b) * len(b[0]) / len(batch[0]) / 2)
                    optimizer.step()
                    optimizer.zero_grad()
    ooms, steps, samples = tuner.ooms, tuner.step_count, tuner.samples_seen
fit_end = [r for r in map(json.loads, open(RUN_DIR + "/events.jsonl")) if r["kind"] == "fit_end"]
apart = max((model.state_dict()[k] - v).abs().max().item() for k, v in plain.items())
save({"apart": apart, "ooms": ooms, "steps": steps, "samples": samples, "fit_end_step": fit_end[-1]["step"]})
"""


@pytest.mark.parametrize("mode", ["step", "accumulate"])
def test_an_accelerate_loop_with_accumulation_ends_with_the_plain_loops_weights(tmp_path, mode):
    proc, result = run_python(f"MODE={mode!r}\nSEED=1\nRUN_DIR={str(tmp_path / 'run')!r}\n" + SCRIPT, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert result["ooms"] >= 5  # on sync batches and between them
    assert result["apart"] < 1e-6, result
    if mode == "step":  # optimizer steps, not calls: Accelerate steps every second one (was 20, 20)
        assert (result["steps"], result["fit_end_step"]) == (10, 10), result
        assert result["samples"] == 2 * 320, result  # every sample trained, held back or stepped
