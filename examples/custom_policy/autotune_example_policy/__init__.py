"""empty_cache_every_epoch: return cached memory to the device (or the OS) at epoch ends.

An example of an autotune policy shipped as a plug-in package. A policy is a dataclass:
`name`, the `events` it listens to, and `decide`, which gets a frozen Snapshot and returns
actions. It never touches the model or optimizer; autotune applies the actions and
journals them. Its dataclass fields are the parameters a TOML preset may set. `PolicyBase`
gives it the checkpoint methods (it has no state to keep) and the notices it ignores.

Parameters:
    every: epochs between clean-ups (default 1).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar, Sequence

from autotune import Action, EmptyCache, Event, PolicyBase, Snapshot
from autotune.common.validate import check_int


@dataclasses.dataclass
class EmptyCacheEveryEpoch(PolicyBase):
    """Return cached memory at every `every`-th epoch end."""

    name: ClassVar[str] = "empty_cache_every_epoch"
    events: ClassVar[frozenset[Event]] = frozenset({Event.EPOCH_END})
    every: int = 1

    def __post_init__(self) -> None:
        check_int(self.name, "every", self.every, 1)

    def decide(self, event: Event, snap: Snapshot) -> Sequence[Action]:
        if snap.epoch % self.every:
            return []
        return [EmptyCache(reason=f"epoch {snap.epoch} ended")]
