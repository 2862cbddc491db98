"""empty_cache_on_pressure: when memory is tight and the allocator holds what it does not
use, hand cached memory back (CUDA: `gc.collect()` + `torch.cuda.empty_cache()`; CPU:
`gc.collect()` + glibc `malloc_trim(0)`).

When: `Event.MEMORY_PRESSURE` (new CUDA allocator retries, or fragmentation) or
`Event.MEMORY_HIGH` (the only signal on CPU), with memory at or above `threshold` of the cap.
What: `EmptyCache`. It costs a device synchronisation, so it runs at most once every
`cooldown_steps` steps. What it returned is measured and journaled by the action itself.

Parameters:
    threshold: fraction of the cap at or above which high memory triggers it (default 0.9).
    cooldown_steps: steps between two clean-ups at least (default 50).

Owns: this policy's state (saved in checkpoints). Touches nothing: it reads a Snapshot and returns actions.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, Sequence

from autotune.common.actions import Action, EmptyCache
from autotune.common.events import Event
from autotune.common.snapshot import Snapshot
from autotune.common.validate import check_fraction, check_int


@dataclasses.dataclass
class EmptyCacheOnPressure:
    """Return cached memory when memory is tight, at most once per cooldown."""

    name: ClassVar[str] = "empty_cache_on_pressure"
    events: ClassVar[frozenset[Event]] = frozenset({Event.MEMORY_PRESSURE, Event.MEMORY_HIGH})

    threshold: float = 0.90
    cooldown_steps: int = 50
    last_step: int | None = dataclasses.field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        check_fraction(self.name, "threshold", self.threshold)
        check_int(self.name, "cooldown_steps", self.cooldown_steps, 0)

    def decide(self, event: Event, snap: Snapshot) -> Sequence[Action]:
        if self.last_step is not None and snap.step - self.last_step < self.cooldown_steps:
            return []
        fraction = snap.sample.used_fraction if snap.sample is not None else None
        if fraction is not None and fraction < self.threshold:
            return []  # memory is not tight: a clean-up would only cost a synchronisation
        if event is Event.MEMORY_HIGH and fraction is None:
            return []
        self.last_step = snap.step
        why = (f"allocator pressure at {fraction:.0%} of the cap" if event is Event.MEMORY_PRESSURE and fraction
               else "allocator pressure" if event is Event.MEMORY_PRESSURE else f"memory at {fraction:.0%} of the cap")
        return [EmptyCache(reason=why)]

    def state_dict(self) -> dict[str, Any]:
        return {"last_step": self.last_step}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.last_step = state.get("last_step")
