"""checkpoint_near_cap: the second rung of the relief ladder: activation checkpointing.

When: at the smallest micro-batch, an OOM, or steps that demand >= `high` of the room
under the cap for `persist_steps` steps (see autotune/relief/trigger.py).
What: `CheckpointActivations`: the model's repeated blocks (ResNet blocks, transformer layers, or a
flat Sequential in segments) keep only their inputs and recompute the rest in backward:
much less activation memory for about one more forward. Once applied, it does nothing more.

Parameters:
    high: step demand (share of the room under the cap) that counts as near the cap (default 0.9).
    persist_steps: steps in a row near the cap before acting (default 5).
    settle_steps: steps after the previous relief before acting again (default 20).
    floor_micro_batch: act only at or below this micro-batch (default 1).
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, Sequence

from autotune.actions import Action, CheckpointActivations
from autotune.events import Event
from autotune.relief.trigger import NearCap
from autotune.snapshot import Snapshot


@dataclasses.dataclass
class CheckpointNearCap:
    """Relief rung 2: activation checkpointing of repeated blocks when memory stays near the cap."""

    name: ClassVar[str] = "checkpoint_near_cap"
    events: ClassVar[frozenset[Event]] = frozenset({Event.BATCH_END, Event.OOM})

    high: float = 0.9
    persist_steps: int = 5
    settle_steps: int = 20
    floor_micro_batch: int = 1

    def __post_init__(self) -> None:
        self._trigger = NearCap(self.name, self.high, self.persist_steps, self.settle_steps, self.floor_micro_batch)

    def decide(self, event: Event, snap: Snapshot) -> Sequence[Action]:
        if "checkpointing" in snap.reliefs:
            return []
        reason = self._trigger.due(event, snap)
        return [CheckpointActivations(reason=reason)] if reason else []

    def state_dict(self) -> dict[str, Any]:
        return {"streak": self._trigger.streak}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._trigger.streak = state.get("streak", 0)
