"""cache_when_io_bound: when the loop waits on its data and reading/decoding is the slow part,
cache decoded samples in shared memory.

When: `Event.IO_BOUND` (the loop spent >= 20% of its time blocked in the loader over a
window of steps). The trainer has then timed, once, the dataset's load/decode apart from
its transforms (`Snapshot.input.profile`, also in the journal).
What: `CacheSamples` when the dataset can be split safely (a torchvision dataset, a
`load`/`augment` pair, or `cacheable = True`) and load/decode is at least `min_load_share`
of a sample's time. The cache holds samples *before* random transforms, so augmentation
stays random every epoch; it is one shared-memory region for the main process and all
workers; it switches on at the next batch without changing the sample order. If the
transforms dominate, a cache would not help: nothing is done (the profile says so).

Parameters:
    min_load_share: load/decode share of a sample's time needed to cache (default 0.5).
    max_bytes: the most the cache may hold, bytes or a size such as "8GiB" (default 0: no
        limit of its own; the host's free memory and /dev/shm still bound it).
    available_fraction: at most this share of MemAvailable (default 0.5).

Owns: this policy's state (saved in checkpoints). Touches nothing: it reads a Snapshot and returns actions.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar, Sequence

from autotune.common.actions import Action, CacheSamples
from autotune.common.events import Event
from autotune.common.snapshot import Snapshot
from autotune.common.units import parse_bytes
from autotune.common.validate import check_fraction, check_int
from autotune.decisions.policy import PolicyBase


@dataclasses.dataclass
class CacheWhenIOBound(PolicyBase):
    """Cache decoded samples (before random transforms) when the loop is input-bound by decoding."""

    name: ClassVar[str] = "cache_when_io_bound"
    events: ClassVar[frozenset[Event]] = frozenset({Event.IO_BOUND})

    min_load_share: float = 0.5
    max_bytes: int | str = 0
    available_fraction: float = 0.5

    def __post_init__(self) -> None:
        check_fraction(self.name, "min_load_share", self.min_load_share, zero_ok=True)
        check_fraction(self.name, "available_fraction", self.available_fraction)
        if isinstance(self.max_bytes, str):
            try:
                self.max_bytes = parse_bytes(self.max_bytes)
            except ValueError as exc:
                raise ValueError(f"{self.name}: max_bytes: {exc}") from None
        else:
            check_int(self.name, "max_bytes", self.max_bytes, 0)

    def decide(self, event: Event, snap: Snapshot) -> Sequence[Action]:
        state = snap.input
        if state is None or state.cache_active or not state.loader_owned or state.profile is None:
            return []
        profile = state.profile
        if not profile.cacheable or profile.load_share < self.min_load_share:
            return []
        return [CacheSamples(max_bytes=self.max_bytes or None, available_fraction=self.available_fraction,
                             reason=f"{state.data_wait_fraction:.0%} of step time waiting for data; load/decode is "
                                    f"{profile.load_share:.0%} of a sample ({profile.load_seconds * 1e3:.2f} ms of "
                                    f"{(profile.load_seconds + profile.transform_seconds) * 1e3:.2f} ms)")]
