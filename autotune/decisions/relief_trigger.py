"""What the three relief policies share: when a relief is due, and giving up on one that failed.

A relief changes the model or its numerics, so it is the last resort after the free
remedies (a smaller micro-batch with gradient accumulation). It is due only at the
smallest micro-batch (`floor_micro_batch`), and then when either
- an OOM happened there (nothing else can make room: without a relief the run would stop), or
- `persist_steps` measured steps in a row demanded at least `high` of the room under the cap
  (`Snapshot.step_demand`: the step peak, not the raw device figure, which the CUDA
  caching allocator and RLIMIT_AS's virtual size keep high without any step needing it; near
  the cap every step is measured, see cadence.py),
and at least `settle_steps` steps after the previous relief, so its effect is measured first.

A relief policy is this skeleton plus what differs: `relief` (its name in `Snapshot.reliefs`),
`make(reason, snap)` (the action), and `wanted(snap)` where "not applied yet" is not the rule.
A relief that could not be carried out (`relief_failed`) is not asked for again in this run.

Owns: each relief policy's streak and its giving up. Touches nothing (it returns actions).
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, Sequence

from autotune.common.actions import Action, Relief
from autotune.common.events import Event
from autotune.common.snapshot import Snapshot
from autotune.common.validate import check_fraction, check_int
from autotune.decisions.policy import PolicyBase


@dataclasses.dataclass
class NearCapRelief(PolicyBase):
    """The skeleton of a relief policy (see the module docstring)."""

    events: ClassVar[frozenset[Event]] = frozenset({Event.BATCH_MEASURED, Event.OOM})
    relief: ClassVar[str]

    high: float = 0.9
    persist_steps: int = 5
    settle_steps: int = 20
    floor_micro_batch: int = 1

    streak: int = dataclasses.field(default=0, init=False, repr=False)  # steps in a row near the cap
    gave_up: str | None = dataclasses.field(default=None, init=False, repr=False)  # why the relief failed

    def __post_init__(self) -> None:
        check_fraction(self.name, "high", self.high)
        check_int(self.name, "persist_steps", self.persist_steps, 1)
        check_int(self.name, "settle_steps", self.settle_steps, 0)
        check_int(self.name, "floor_micro_batch", self.floor_micro_batch, 1)

    def make(self, reason: str, snap: Snapshot) -> Relief:
        raise NotImplementedError

    def wanted(self, snap: Snapshot) -> bool:
        """Whether this relief may still help (default: it is not applied yet)."""
        return self.relief not in snap.reliefs

    def decide(self, event: Event, snap: Snapshot) -> Sequence[Action]:
        if self.gave_up is not None or not self.wanted(snap):
            return []
        reason = self.due(event, snap)
        return [self.make(reason, snap)] if reason else []

    def due(self, event: Event, snap: Snapshot) -> str | None:
        """Why a relief is due now, or None."""
        if event is Event.OOM:
            failed = snap.failed_micro_batch or snap.micro_batch_size
            if failed <= self.floor_micro_batch:
                return f"out of memory at micro-batch {failed}, the smallest: nothing else can make room"
            return None
        if event is not Event.BATCH_MEASURED:
            return None
        demand = snap.step_demand
        if snap.micro_batch_size > self.floor_micro_batch or demand is None or demand < self.high:
            self.streak = 0
            return None
        self.streak += 1
        if self.streak < self.persist_steps:
            return None
        if snap.last_relief_step is not None and snap.step - snap.last_relief_step < self.settle_steps:
            return None
        self.streak = 0
        return (f"{self.persist_steps} steps in a row at micro-batch {snap.micro_batch_size} demanded >= "
                f"{self.high:.0%} of the room under the cap (last {demand:.0%})")

    def relief_failed(self, action: Action, why: str) -> None:
        self.gave_up = why  # e.g. pruning would break this model: the ladder ends here

    def state_dict(self) -> dict[str, Any]:
        return {"streak": self.streak, "gave_up": self.gave_up}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.streak, self.gave_up = state.get("streak", 0), state.get("gave_up")
