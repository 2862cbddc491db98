"""halve_on_oom: on an out-of-memory error, halve the micro-batch and retry the same batch.

When: `Event.OOM`, with the micro-batch size that just failed.
What: `SetMicroBatch(max(min_micro_batch, failed // 2))`, or back to the last size that
completed a batch when that lies between the half and the failing size (a probe of
grow_back that failed returns to the size known to work, not below it). A size that had just
completed a batch measured to need nearly all the room (`EDGE_DEMAND`) is at the edge of it,
not far past it, when it fails on the next batch (one batch needs a little more than another:
fragments, kernels for a new shape): a tenth smaller, not half. Should that fail too, the size
that failed is no longer the last good one, and it halves; so it does where the last batch
needed much less (the need jumped: longer sequences, say). With `keep_effective_batch`
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

from autotune.common.actions import Action, SetMicroBatch
from autotune.common.events import Event
from autotune.common.snapshot import Snapshot
from autotune.common.validate import check_int

# A size at the edge steps back by the tolerance the sizing aims for (within 10% of the largest);
# at the edge: its last batch needed this share of the room or more (fit_micro_batch aims at 0.95).
EDGE_STEP = 0.9
EDGE_DEMAND = 0.85


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
        good = snap.last_good_micro_batch
        memory = snap.step_memory
        at_edge = (memory is not None and memory.micro_batch_size == failed and memory.room_bytes > 0
                   and memory.need_bytes >= EDGE_DEMAND * memory.room_bytes)
        if good == failed and at_edge and failed > self.min_micro_batch:
            new_size = max(self.min_micro_batch, min(failed - 1, int(failed * EDGE_STEP)))
            return [SetMicroBatch(new_size, reason=f"out of memory at micro-batch {failed}, whose last batch needed "
                                                   f"{memory.need_bytes / memory.room_bytes:.0%} of the room: at "
                                                   f"its edge, {new_size}")]
        new_size = max(self.min_micro_batch, failed // 2)
        if good is not None and new_size < good < failed:
            return [SetMicroBatch(good, reason=f"out of memory at micro-batch {failed}; back to {good}, "
                                               "the last size that completed a batch")]
        return [SetMicroBatch(new_size, reason=f"out of memory at micro-batch {failed}; halving to {new_size}")]

    def state_dict(self) -> dict[str, Any]:
        return {"ceiling": self.ceiling}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.ceiling = state.get("ceiling")
