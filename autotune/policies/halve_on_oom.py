"""halve_on_oom: on an out-of-memory error, halve the micro-batch and retry the same batch.

When: `Event.OOM`, with the micro-batch size that just failed.
What: `SetMicroBatch(max(min_micro_batch, failed // 2))`, or back to the last size that
completed a batch when that lies between the half and the failing size (a probe of
grow_back that failed returns to the size known to work, not below it). With `keep_effective_batch`
(the default) the trainer accumulates gradients over the smaller micro-batches, so the
optimizer still sees the whole batch and nothing is skipped.
Gives up: when the failing size is already `min_micro_batch`, it returns nothing and the
trainer raises `autotune.OutOfMemory` with the memory figures.
Remembers: the smallest size that ever failed (`ceiling`), so a policy that grows the
micro-batch back can avoid it; it survives checkpoints.

Parameters:
    min_micro_batch: the smallest micro-batch worth trying (default 1).

Owns: this policy's state (saved in checkpoints). Touches nothing: it reads a Snapshot and returns actions.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, Sequence

from autotune.actions import Action, SetMicroBatch
from autotune.events import Event
from autotune.snapshot import Snapshot
from autotune.validate import check_int


@dataclasses.dataclass
class HalveOnOOM:
    """Halve the micro-batch on OOM and retry the same batch, down to `min_micro_batch`."""

    name: ClassVar[str] = "halve_on_oom"
    events: ClassVar[frozenset[Event]] = frozenset({Event.OOM})

    min_micro_batch: int = 1
    ceiling: int | None = dataclasses.field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        check_int(self.name, "min_micro_batch", self.min_micro_batch, 1)

    def decide(self, event: Event, snap: Snapshot) -> Sequence[Action]:
        failed = snap.failed_micro_batch or snap.micro_batch_size
        self.ceiling = failed if self.ceiling is None else min(self.ceiling, failed)
        if failed <= self.min_micro_batch:
            return []
        new_size = max(self.min_micro_batch, failed // 2)
        good = snap.last_good_micro_batch
        if good is not None and new_size < good < failed:
            return [SetMicroBatch(good, reason=f"out of memory at micro-batch {failed}; back to {good}, "
                                               "the last size that completed a batch")]
        return [SetMicroBatch(new_size, reason=f"out of memory at micro-batch {failed}; halving to {new_size}")]

    def state_dict(self) -> dict[str, Any]:
        return {"ceiling": self.ceiling}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.ceiling = state.get("ceiling")
