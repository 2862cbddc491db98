"""autocast_near_cap: the first rung of the relief ladder: mixed precision.

When: at the smallest micro-batch, an OOM, or steps that demand >= `high` of the room
under the cap for `persist_steps` steps (see autotune/relief/trigger.py).
What: `UseAutocast`: forward passes under bf16 autocast where the device has bf16 (CPU,
CUDA from Ampere), else fp16 with a gradient scaler. Activations saved for backward take
half the memory. Once applied, it does nothing more.

Parameters:
    high: step demand (share of the room under the cap) that counts as near the cap (default 0.9).
    persist_steps: steps in a row near the cap before acting (default 5).
    settle_steps: steps after the previous relief before acting again (default 20).
    floor_micro_batch: act only at or below this micro-batch (default 1).
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, Sequence

from autotune.actions import Action, UseAutocast
from autotune.events import Event
from autotune.relief.trigger import NearCap
from autotune.snapshot import Snapshot


@dataclasses.dataclass
class AutocastNearCap:
    """Relief rung 1: bf16 (or fp16 + scaler) autocast when memory stays near the cap."""

    name: ClassVar[str] = "autocast_near_cap"
    events: ClassVar[frozenset[Event]] = frozenset({Event.BATCH_END, Event.OOM})

    high: float = 0.9
    persist_steps: int = 5
    settle_steps: int = 20
    floor_micro_batch: int = 1

    def __post_init__(self) -> None:
        self._trigger = NearCap(self.name, self.high, self.persist_steps, self.settle_steps, self.floor_micro_batch)

    def decide(self, event: Event, snap: Snapshot) -> Sequence[Action]:
        if "autocast" in snap.reliefs:
            return []
        reason = self._trigger.due(event, snap)
        return [UseAutocast(reason=reason)] if reason else []

    def state_dict(self) -> dict[str, Any]:
        return {"streak": self._trigger.streak}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._trigger.streak = state.get("streak", 0)
