"""empty_cache_every_epoch: return cached memory to the device (or the OS) at epoch ends.

An example of an autotune policy shipped as a plug-in package. A policy is a dataclass:
`name`, the `events` it listens to, and `decide`, which gets a frozen Snapshot and returns
actions. It never touches the model or optimizer; autotune applies the actions and
journals them. Its dataclass fields are the parameters a TOML preset may set.

Parameters:
    every: epochs between clean-ups (default 1).
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, Sequence

from autotune import Action, EmptyCache, Event, Snapshot


@dataclasses.dataclass
class EmptyCacheEveryEpoch:
    """Return cached memory at every `every`-th epoch end."""

    name: ClassVar[str] = "empty_cache_every_epoch"
    events: ClassVar[frozenset[Event]] = frozenset({Event.EPOCH_END})
    every: int = 1

    def __post_init__(self) -> None:
        if isinstance(self.every, bool) or not isinstance(self.every, int) or self.every < 1:
            raise ValueError(f"empty_cache_every_epoch: every must be an integer >= 1, got {self.every!r}")

    def decide(self, event: Event, snap: Snapshot) -> Sequence[Action]:
        if snap.epoch % self.every:
            return []
        return [EmptyCache(reason=f"epoch {snap.epoch} ended")]

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        return None
