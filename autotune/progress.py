"""Where a run is: the counters every part reads and a checkpoint saves; what a fit did.

Owns the counters' shape; the step core advances `step`/`samples_seen`, the host the rest.
Touches nothing.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any


@dataclasses.dataclass
class Progress:
    """The run's counters. The step core advances `step` and `samples_seen` (when an optimizer
    step completes); the trainer advances the rest."""

    step: int = 0  # optimizer steps, across fit() calls
    epoch: int = 0  # epochs completed
    position: int = 0  # samples of the current epoch already trained (where a resume restarts)
    batches_done: int = 0  # batches of the current epoch already trained
    samples_seen: int = 0  # each sample counted once per epoch, when its optimizer step completed
    ooms: int = 0  # out-of-memory errors survived
    world: int = 1  # ranks of the job these counters are of (`position` is each rank's: the job's is position x world)
    epoch_world: int = 1  # ranks the current epoch began on: its order is padded for them (data/sampler.py)

    def state_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for field in dataclasses.fields(self):
            setattr(self, field.name, state[field.name])


@dataclasses.dataclass(frozen=True)
class FitResult:
    """What `AutoTrainer.fit` did."""

    samples_seen: int  # each sample counted once per epoch, when its optimizer step completed
    steps: int  # optimizer steps
    epochs: int  # epochs completed
    batch_size: int  # samples per optimizer step at the end
    micro_batch_size: int  # samples per forward/backward at the end
    ooms: int  # out-of-memory errors survived
    loss: float | None  # mean training loss over the last epoch's completed steps
    wall_seconds: float
    run_dir: Path
    metrics: dict[str, float] = dataclasses.field(default_factory=dict)  # the last evaluation's ("loss", ...)
    stopped: str | None = None  # why a callback's request_stop ended the fit early

    @property
    def samples_per_second(self) -> float:
        return self.samples_seen / self.wall_seconds if self.wall_seconds > 0 else 0.0
