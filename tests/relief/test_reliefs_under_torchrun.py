"""The relief ladder under torchrun: every rank changes its model the same way at the same step.

Only rank 0's policies decide reliefs (a rank's memory figures are its own; the models must
stay the same). Here a scripted policy asks for each rung on rank 0 only; both gloo ranks must
apply autocast, activation checkpointing and pruning at the same steps, keep identical weights,
and train on.
"""

import json

import pytest
import torch

from tests.conftest import torchrun

pytestmark = pytest.mark.slow

SCRIPT = r'''
import json, os, sys, torch
from torch import nn
from torch.utils.data import TensorDataset
from autotune import AutoTrainer, Event
from autotune.common.actions import CheckpointActivations, PruneChannels, UseAutocast

run_dir = sys.argv[1]
rank = int(os.environ["RANK"])
torch.backends.mkldnn.enabled = False  # see tests/relief/test_ladder_e2e.py: oneDNN caches per shape

class Rank0Ladder:
    """Asks for one rung at steps 2, 4 and 6, on rank 0 only."""
    name = "rank0_ladder"
    events = frozenset({Event.BATCH_END})
    plan = {2: UseAutocast(reason="scripted"), 4: CheckpointActivations(reason="scripted"),
            6: PruneChannels(ratio=0.25, reason="scripted")}

    def decide(self, event, snap):
        action = self.plan.get(snap.step) if rank == 0 else None
        return [action] if action else []

    def state_dict(self):
        return {}

    def load_state_dict(self, state):
        return None

torch.manual_seed(0)
g = torch.Generator().manual_seed(0)
data = TensorDataset(torch.randn(512, 16, generator=g), torch.randint(0, 4, (512,), generator=g))
model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(),
                      nn.Linear(64, 4))
trainer = AutoTrainer(model, data, loss_fn=nn.functional.cross_entropy, batch_size=32, device="cpu",
                      optimizer=lambda p: torch.optim.AdamW(p, lr=1e-2), run_dir=run_dir, policies=[Rank0Ladder()],
                      progress=False, monitor=False, checkpoint_interval=None)
result = trainer.fit(epochs=2)
torch.save(trainer.model.state_dict(), os.path.join(run_dir, f"rank{rank}.pt"))
with open(os.path.join(run_dir, f"rank{rank}.json"), "w") as f:
    json.dump({"reliefs": trainer.reliefs, "samples": result.samples_seen, "loss": result.loss,
               "autocast": trainer.core.autocast is not None}, f)
'''


def test_every_rank_applies_rank_0s_reliefs_at_the_same_step(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    run_dir = tmp_path / "run"
    # The shared launcher: one thread a rank, a hang killed, and gloo's known abort at exit (after
    # both ranks wrote their results) run once more.
    torchrun(script, [str(run_dir)], [run_dir / f"rank{r}.json" for r in (0, 1)], timeout=240)
    ranks = [json.loads((run_dir / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0]["reliefs"] == ranks[1]["reliefs"] == ["autocast", "checkpointing", "pruning"]
    assert ranks[0]["autocast"] and ranks[1]["autocast"]
    assert ranks[0]["samples"] == ranks[1]["samples"] == 1024
    weights = [torch.load(run_dir / f"rank{r}.pt", weights_only=True) for r in (0, 1)]
    for key in weights[0]:
        torch.testing.assert_close(weights[0][key], weights[1][key], rtol=0, atol=0)  # still one model
    assert weights[0]["2.weight"].shape[0] < 64 and weights[0]["6.weight"].shape == (4, weights[0]["4.weight"].shape[0])
    records = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    # Asked for at the end of steps 2, 4, 6 on rank 0; agreed in the next step; applied at its end.
    assert [(r["step"], r["relief"]) for r in records if r["kind"] == "relief"] == \
        [(3, "autocast"), (5, "checkpointing"), (7, "pruning")]
    assert not any(r["kind"] == "relief_failed" for r in records)
