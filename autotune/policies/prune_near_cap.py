"""prune_near_cap: the last rung of the relief ladder: structured pruning that frees memory.

When: at the smallest micro-batch, an OOM, or steps that demand >= `high` of the room
under the cap for `persist_steps` steps (see autotune/decisions/relief_trigger.py); after the cheaper
rungs in the preset have been applied (one relief per trigger, in preset order).
What: `PruneChannels(step_ratio)`: Torch-Pruning removes `step_ratio` of the channels of
every Linear/Conv layer but the output layers (outputs keep their shape), by L2 magnitude.
Parameters, gradients, optimizer state and activations all shrink; the same optimizer
object keeps the state of the kept channels (remapped in place: a scheduler on it keeps
working), and a checkpoint is written before. Again on the next trigger, until `max_ratio` of the channels are gone.
The pruning is first tried on a memory-free (meta) copy: if it would break the model (e.g.
a residual stream that starts at the raw input), or if pruning itself runs out of memory,
the model is left as it was and this policy asks no more.
Not `torch.nn.utils.prune`: its masks make a step need *more* memory.

Parameters:
    step_ratio: share of the remaining channels removed per trigger (default 0.1).
    max_ratio: the most of the original channels ever removed (default 0.5).
    high: step demand (share of the room under the cap) that counts as near the cap (default 0.9).
    persist_steps: steps in a row near the cap before acting (default 5).
    settle_steps: steps after the previous relief before acting again (default 20).
    floor_micro_batch: act only at or below this micro-batch (default 1).

Owns: this policy's state (saved in checkpoints). Touches nothing: it reads a Snapshot and returns actions.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from autotune.common.actions import PruneChannels
from autotune.common.snapshot import Snapshot
from autotune.common.validate import check_fraction
from autotune.decisions.relief_trigger import NearCapRelief


@dataclasses.dataclass
class PruneNearCap(NearCapRelief):
    """Relief rung 3: remove channels in bounded steps when memory stays near the cap."""

    name: ClassVar[str] = "prune_near_cap"
    relief: ClassVar[str] = "pruning"

    step_ratio: float = 0.1
    max_ratio: float = 0.5

    def __post_init__(self) -> None:
        super().__post_init__()
        check_fraction(self.name, "step_ratio", self.step_ratio)
        check_fraction(self.name, "max_ratio", self.max_ratio)
        if self.step_ratio >= 1:
            raise ValueError(f"{self.name}: step_ratio must be below 1, got {self.step_ratio!r}")

    def _done(self, snap: Snapshot) -> float:
        return 1 - (1 - self.step_ratio) ** snap.reliefs.count("pruning")  # channels removed so far

    def wanted(self, snap: Snapshot) -> bool:
        return self._done(snap) + 1e-9 < self.max_ratio  # again on the next trigger, up to max_ratio

    def make(self, reason: str, snap: Snapshot) -> PruneChannels:
        done = self._done(snap)
        ratio = min(self.step_ratio, 1 - (1 - self.max_ratio) / (1 - done))  # never past max_ratio in all
        return PruneChannels(ratio=round(ratio, 4), reason=f"{reason}; {done:.0%} of channels pruned so far")
