"""grow_back: after calm steps, grow the micro-batch back toward the batch, by binary search.

When: `Event.BATCH_MEASURED` (and `Event.OOM`, to learn the failing size and restart the count).
What: while no failure is known, a step is calm when it demanded less than `headroom` of
the room it had (its peak over the cap, less what was in use before training:
`Snapshot.step_demand`), or when that is not measured. After `calm_steps` calm steps
below the batch size it asks for more:
  - no recent failure known: double it (up to the batch size), but no further than the
    size the last step's demand predicts would just fit (demand grows with the batch);
  - a size failed recently: halfway between the current size (known to work) and the
    failing one, so the search converges in log2 steps; once the gap is within `margin`
    of the current size it stops, and the run stays at the largest size that fits.
While a failure bound is known, probes need only `search_calm_steps` calm steps: the
lower bound is already known to work. A failing size is not retried for
`forget_failure_steps` steps (memory needs change over a run, so it is retried then).
Started with `micro_batch_size="auto"` the run begins at the batch size and this search
finds the largest size that fits in a few probes on real batches; nothing is skipped.

Parameters:
    calm_steps: calm steps before doubling (default 10).
    search_calm_steps: calm steps before a binary-search probe (default 2).
    headroom: before any failure, a step is calm below this share of its room (default 0.9).
    margin: stop searching when the gap is within this fraction of the size (default 0.1).
    forget_failure_steps: steps after which a failed size may be tried again (default 2000).

Owns: this policy's state (saved in checkpoints). Touches nothing: it reads a Snapshot and returns actions.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, Sequence

from autotune.common.actions import Action, SetMicroBatch
from autotune.common.events import Event
from autotune.common.snapshot import Snapshot
from autotune.common.validate import check_fraction, check_int


@dataclasses.dataclass
class GrowBack:
    """Grow the micro-batch back after calm steps: double, then binary-search below the last failure."""

    name: ClassVar[str] = "grow_back"
    events: ClassVar[frozenset[Event]] = frozenset({Event.BATCH_MEASURED, Event.OOM})

    calm_steps: int = 10
    search_calm_steps: int = 2
    headroom: float = 0.9
    margin: float = 0.1
    forget_failure_steps: int = 2000

    failed: int | None = dataclasses.field(default=None, init=False, repr=False)
    failed_step: int | None = dataclasses.field(default=None, init=False, repr=False)
    calm: int = dataclasses.field(default=0, init=False, repr=False)

    def __post_init__(self) -> None:
        for name in ("calm_steps", "search_calm_steps", "forget_failure_steps"):
            check_int(self.name, name, getattr(self, name), 1)
        check_fraction(self.name, "headroom", self.headroom)
        if not 0 <= self.margin < 1:
            raise ValueError(f"grow_back: margin must be in [0, 1), got {self.margin!r}")

    def _recent_failure(self, step: int) -> int | None:
        if self.failed is None or self.failed_step is None or step - self.failed_step >= self.forget_failure_steps:
            return None
        return self.failed

    def decide(self, event: Event, snap: Snapshot) -> Sequence[Action]:
        if event is Event.OOM:
            size = snap.failed_micro_batch or snap.micro_batch_size
            known = self._recent_failure(snap.step)
            self.failed = size if known is None else min(known, size)
            self.failed_step = snap.step
            self.calm = 0
            return []
        micro, batch = snap.micro_batch_size, snap.batch_size
        failed = self._recent_failure(snap.step)
        demand = snap.step_demand
        # Doubling blind needs room to spare; below a known failure the probe is bounded by
        # it, and an OOM there only costs a retry of the same batch, so the room may be tight.
        if failed is None and demand is not None and demand >= self.headroom:
            self.calm = 0
            return []
        if micro >= batch:
            return []
        self.calm += 1
        if failed is not None and failed - micro <= max(1, int(self.margin * micro)):
            return []  # converged: the largest size that fits, within the margin
        if self.calm < (self.search_calm_steps if failed is not None else self.calm_steps):
            return []
        self.calm = 0
        if failed is None:
            target = min(batch, micro * 2)
            if demand:  # demand grows about linearly with the micro-batch: do not jump past the edge
                target = min(target, int(micro / demand))
            if target <= micro:
                return []
            return [SetMicroBatch(target, reason=f"{self.calm_steps} calm steps at {micro} (demand "
                                                 f"{demand if demand is None else round(demand, 2)}); growing to {target}")]
        target = min(batch, (micro + failed) // 2)
        return [SetMicroBatch(target, reason=f"{micro} works, {failed} failed at step {self.failed_step}; "
                                             f"trying {target}")]

    def state_dict(self) -> dict[str, Any]:
        return {"failed": self.failed, "failed_step": self.failed_step, "calm": self.calm}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.failed, self.failed_step, self.calm = state.get("failed"), state.get("failed_step"), state.get("calm", 0)
