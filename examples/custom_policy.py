"""A custom policy: return cached memory at the end of every epoch, and log why.

A policy is a small dataclass: `name`, the `events` it listens to, and `decide`, which
gets a frozen Snapshot and returns actions. It never touches the model or optimizer;
autotune applies the actions and journals them. Use it directly, as below, or ship it in
a package with an entry point so presets can name it:

    [project.entry-points."autotune.policies"]
    empty_cache_every_epoch = "my_package.policies:EmptyCacheEveryEpoch"

    python examples/custom_policy.py
"""

import dataclasses
from typing import ClassVar

import torch
from torch import nn
from torch.utils.data import TensorDataset

from autotune import AutoTrainer, EmptyCache, Event, Snapshot
from autotune.policies import HalveOnOOM


@dataclasses.dataclass
class EmptyCacheEveryEpoch:
    """Return cached memory to the device (or the OS) at every epoch end."""

    name: ClassVar[str] = "empty_cache_every_epoch"
    events: ClassVar[frozenset] = frozenset({Event.EPOCH_END})
    every: int = 1  # epochs between clean-ups

    def decide(self, event: Event, snap: Snapshot):
        if snap.epoch % self.every:
            return []
        return [EmptyCache(reason=f"epoch {snap.epoch} ended")]

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        return None


if __name__ == "__main__":
    data = TensorDataset(torch.randn(1024, 32), torch.randint(0, 4, (1024,)))
    model = nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 4))
    trainer = AutoTrainer(model, data, loss_fn=nn.functional.cross_entropy, batch_size=128, device="cpu",
                          policies=[HalveOnOOM(), EmptyCacheEveryEpoch()], progress=False)
    result = trainer.fit(epochs=2)
    print(f"done: {result.samples_seen} samples; see {result.run_dir}/events.jsonl for the empty_cache actions")
