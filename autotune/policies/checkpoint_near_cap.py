"""checkpoint_near_cap: the second rung of the relief ladder: activation checkpointing.

When: at the smallest micro-batch, an OOM, or steps that demand >= `high` of the room
under the cap for `persist_steps` steps (see autotune/decisions/relief_trigger.py).
What: `CheckpointActivations`: the model's repeated blocks (ResNet blocks, transformer layers, or a
flat Sequential in segments) keep only their inputs and recompute the rest in backward:
much less activation memory for about one more forward. Once applied, it does nothing more.

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

from autotune.common.actions import CheckpointActivations
from autotune.common.snapshot import Snapshot
from autotune.decisions.relief_trigger import NearCapRelief


@dataclasses.dataclass
class CheckpointNearCap(NearCapRelief):
    """Relief rung 2: activation checkpointing of repeated blocks when memory stays near the cap."""

    name: ClassVar[str] = "checkpoint_near_cap"
    relief: ClassVar[str] = "checkpointing"

    def make(self, reason: str, snap: Snapshot) -> CheckpointActivations:
        return CheckpointActivations(reason=reason)
