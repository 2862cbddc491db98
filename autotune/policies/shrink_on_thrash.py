"""shrink_on_thrash: shrink the micro-batch before the OOM comes, when the CUDA caching
allocator keeps having to free its cache and retry (`num_alloc_retries` growing).

When: `Event.BATCH_MEASURED`, with allocator figures (CUDA only; on CPU there are none).
What: after `steps` consecutive measured steps each with new allocator retries,
`SetMicroBatch(max(1, int(micro * factor)))`. Retries are slow (a cache flush and a
synchronisation each) and usually precede an OOM by a few steps.

Parameters:
    steps: consecutive steps with new retries that trigger a shrink (default 2).
    factor: the new micro-batch as a fraction of the current one (default 0.75).

Owns: this policy's state (saved in checkpoints). Touches nothing: it reads a Snapshot and returns actions.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, Sequence

from autotune.common.actions import Action, SetMicroBatch
from autotune.common.events import Event
from autotune.common.snapshot import Snapshot
from autotune.common.validate import check_int


@dataclasses.dataclass
class ShrinkOnThrash:
    """Shrink the micro-batch after consecutive steps with new CUDA allocator retries."""

    name: ClassVar[str] = "shrink_on_thrash"
    events: ClassVar[frozenset[Event]] = frozenset({Event.BATCH_MEASURED})

    steps: int = 2
    factor: float = 0.75
    last_retries: int | None = dataclasses.field(default=None, init=False, repr=False)
    streak: int = dataclasses.field(default=0, init=False, repr=False)

    def __post_init__(self) -> None:
        check_int(self.name, "steps", self.steps, 1)
        if not 0 < self.factor < 1:
            raise ValueError(f"shrink_on_thrash: factor must be in (0, 1), got {self.factor!r}")

    def decide(self, event: Event, snap: Snapshot) -> Sequence[Action]:
        if snap.allocator is None:
            return []
        retries = snap.allocator.num_alloc_retries
        new = self.last_retries is not None and retries > self.last_retries
        self.last_retries = retries
        self.streak = self.streak + 1 if new else 0
        if self.streak < self.steps or snap.micro_batch_size <= 1:
            return []
        self.streak = 0
        target = max(1, int(snap.micro_batch_size * self.factor))
        return [SetMicroBatch(target, reason=f"allocator retries in {self.steps} steps in a row; "
                                             f"{snap.micro_batch_size} -> {target} before an OOM")]

    def state_dict(self) -> dict[str, Any]:
        return {"last_retries": self.last_retries, "streak": self.streak}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.last_retries, self.streak = state.get("last_retries"), state.get("streak", 0)
