"""Turn memory samples and allocator figures into events, with hysteresis.

MEMORY_HIGH      used/cap has stayed at or above `high` for `confirm` samples in a row. It
                 fires on entering that state and again every `repeat` samples while it
                 lasts (so "it persists" is visible to policies); it re-arms only after
                 used/cap falls below `low`, so a value hovering at the line does not chatter.
MEMORY_PRESSURE  the allocator struggled in the last step: new `num_alloc_retries` (the
                 CUDA caching allocator freed its cache and retried: an OOM narrowly
                 avoided), or memory is high while much of what is reserved is not
                 allocated (fragmentation).
IO_BOUND         over the last `window` steps, the loop spent at least `high` of its time
                 blocked in the loader's next(). It stays input-bound (and fires again once
                 per fresh window) until that share falls under `calm`.

Owns: turning the monitor's samples and the step timing into events. Touches nothing.
"""

from __future__ import annotations

import collections
import dataclasses

from autotune.common.events import Event
from autotune.common.snapshot import AllocatorStats, DeviceSample, StepTiming


@dataclasses.dataclass
class MemoryDetector:
    """MEMORY_HIGH with hysteresis from device samples; MEMORY_PRESSURE from allocator stats."""

    high: float = 0.90
    low: float = 0.80
    confirm: int = 2
    repeat: int = 20
    fragmentation: float = 0.25  # unallocated share of reserved memory that counts as fragmented

    _streak: int = dataclasses.field(default=0, init=False)
    _since_fired: int = dataclasses.field(default=0, init=False)
    _is_high: bool = dataclasses.field(default=False, init=False)
    _last_retries: int | None = dataclasses.field(default=None, init=False)

    def __post_init__(self) -> None:
        if not 0 < self.low < self.high <= 1:
            raise ValueError(f"detector thresholds need 0 < low < high <= 1, got low={self.low}, high={self.high}")

    @property
    def is_high(self) -> bool:
        return self._is_high

    def on_sample(self, sample: DeviceSample) -> list[Event]:
        """Feed one new sample; returns [Event.MEMORY_HIGH] when it should fire."""
        fraction = sample.used_fraction
        if fraction is None:
            return []
        if fraction < self.low:
            self._streak, self._is_high = 0, False
            return []
        if fraction < self.high:
            self._streak = 0
            return []
        self._streak += 1
        if not self._is_high:
            if self._streak >= self.confirm:
                self._is_high, self._since_fired = True, 0
                return [Event.MEMORY_HIGH]
            return []
        self._since_fired += 1
        if self._since_fired >= self.repeat:
            self._since_fired = 0
            return [Event.MEMORY_HIGH]
        return []

    def on_step(self, stats: AllocatorStats | None, sample: DeviceSample | None) -> list[Event]:
        """Feed one step's allocator figures; returns [Event.MEMORY_PRESSURE] when it should fire."""
        if stats is None:
            return []
        new_retries = self._last_retries is not None and stats.num_alloc_retries > self._last_retries
        self._last_retries = stats.num_alloc_retries
        fraction = sample.used_fraction if sample is not None else None
        idle = stats.reserved_bytes - stats.allocated_bytes
        fragmented = (fraction is not None and fraction >= self.high and stats.reserved_bytes > 0
                      and idle / stats.reserved_bytes >= self.fragmentation)
        return [Event.MEMORY_PRESSURE] if new_retries or fragmented else []


@dataclasses.dataclass
class InputDetector:
    """IO_BOUND from per-step timings: the share of step time spent waiting for data."""

    high: float = 0.20
    calm: float = 0.05
    window: int = 20

    _steps: collections.deque = dataclasses.field(default_factory=collections.deque, init=False)
    _bound: bool = dataclasses.field(default=False, init=False)
    _last: tuple[float, float, int] = dataclasses.field(default=(0.0, 0.0, 0), init=False)

    def __post_init__(self) -> None:
        if not 0 <= self.calm < self.high <= 1:
            raise ValueError(f"input detector thresholds need 0 <= calm < high <= 1, got calm={self.calm}, "
                             f"high={self.high}")
        if self.window < 1:
            raise ValueError(f"input detector window must be >= 1 step, got {self.window}")

    @property
    def is_bound(self) -> bool:
        return self._bound

    def summary(self) -> tuple[float, float, int]:
        """(data-wait share, samples per second, steps) over the last full window since the loader
        was rebuilt, or over the current one until the first is full. The last full one, not the
        one filling: a policy that judges on a full window (tune_workers, `steps` >= its
        judge_steps) must find one at whichever batch it is asked, not only at the batch after a
        window closed (with batches measured every 32 and windows of 20, those may never meet)."""
        if self._last[2] or not self._steps:
            return self._last
        return self._figures()

    def _figures(self) -> tuple[float, float, int]:
        step = sum(t.step_seconds for t, _ in self._steps)
        wait = sum(t.data_wait_seconds for t, _ in self._steps)
        samples = sum(n for _, n in self._steps)
        return (wait / step if step > 0 else 0.0, samples / step if step > 0 else 0.0, len(self._steps))

    def on_step(self, timing: StepTiming, samples: int) -> list[Event]:
        """Feed one step; returns [Event.IO_BOUND] when the loop is (still) waiting on its data."""
        self._steps.append((timing, samples))
        if len(self._steps) < self.window:
            return []
        self._last = self._figures()
        fraction = self._last[0]
        self._steps.clear()  # the next verdict needs a fresh window: at most one event per window
        if fraction >= self.high or (self._bound and fraction >= self.calm):
            self._bound = True
            return [Event.IO_BOUND]
        if fraction < self.calm:
            self._bound = False
        return []

    def restart(self) -> None:
        """Forget the window (the loader changed: its figures no longer describe the pipeline)."""
        self._steps.clear()
        self._last = (0.0, 0.0, 0)
