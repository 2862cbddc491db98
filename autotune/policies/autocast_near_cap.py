"""autocast_near_cap: the first rung of the relief ladder: mixed precision.

When: at the smallest micro-batch, an OOM, or steps that demand >= `high` of the room
under the cap for `persist_steps` steps (see autotune/decisions/relief_trigger.py).
What: `UseAutocast`: forward passes under bf16 autocast where the device has bf16 (CPU,
CUDA from Ampere), else fp16 with a gradient scaler. Activations saved for backward take
half the memory. Once applied, it does nothing more.

Parameters:
    high: step demand (share of the room under the cap) that counts as near the cap (default 0.9).
    persist_steps: steps in a row near the cap before acting (default 5).
    settle_steps: steps after the previous relief before acting again (default 20).
    floor_micro_batch: act only at or below this micro-batch (default 1).

Owns: this policy's state (saved in checkpoints). Touches nothing: it reads a Snapshot and returns actions.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from autotune.common.actions import UseAutocast
from autotune.common.snapshot import Snapshot
from autotune.decisions.relief_trigger import NearCapRelief


@dataclasses.dataclass
class AutocastNearCap(NearCapRelief):
    """Relief rung 1: bf16 (or fp16 + scaler) autocast when memory stays near the cap."""

    name: ClassVar[str] = "autocast_near_cap"
    relief: ClassVar[str] = "autocast"

    def make(self, reason: str, snap: Snapshot) -> UseAutocast:
        return UseAutocast(reason=reason)
