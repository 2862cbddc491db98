"""When a memory relief is due: the rule the three relief policies share.

A relief changes the model or its numerics, so it is the last resort after the free
remedies (a smaller micro-batch with gradient accumulation). It is due only at the
smallest micro-batch (`floor_micro_batch`), and then when either
- an OOM happened there (nothing else can make room: without a relief the run would stop), or
- `persist_steps` steps in a row demanded at least `high` of the room under the cap
  (`Snapshot.step_demand`: the step peak, not the raw device figure, which the CUDA
  caching allocator and RLIMIT_AS's virtual size keep high without any step needing it),
and at least `settle_steps` steps after the previous relief, so its effect is measured first.
"""

from __future__ import annotations

import dataclasses

from autotune.events import Event
from autotune.snapshot import Snapshot
from autotune.validate import check_fraction, check_int


@dataclasses.dataclass
class NearCap:
    """The shared trigger of the relief policies (see the module docstring)."""

    owner: str
    high: float = 0.9
    persist_steps: int = 5
    settle_steps: int = 20
    floor_micro_batch: int = 1
    streak: int = 0

    def __post_init__(self) -> None:
        check_fraction(self.owner, "high", self.high)
        check_int(self.owner, "persist_steps", self.persist_steps, 1)
        check_int(self.owner, "settle_steps", self.settle_steps, 0)
        check_int(self.owner, "floor_micro_batch", self.floor_micro_batch, 1)

    def due(self, event: Event, snap: Snapshot) -> str | None:
        """Why a relief is due now, or None."""
        if event is Event.OOM:
            failed = snap.failed_micro_batch or snap.micro_batch_size
            if failed <= self.floor_micro_batch:
                return f"out of memory at micro-batch {failed}, the smallest: nothing else can make room"
            return None
        if event is not Event.BATCH_END:
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
