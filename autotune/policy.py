"""The policy interface.

A policy is a pure decision maker: it receives an `Event` and a frozen `Snapshot` and
returns `Action`s. It never touches the trainer, model, optimizer or loader; `knobs.py`
applies what it asks for, and the journal records every decision with its reason.

Writing one takes a dataclass (its fields are the parameters a TOML preset may set)::

    @dataclasses.dataclass
    class EmptyCacheEveryEpoch:
        '''Return cached memory at every epoch end.'''
        name: ClassVar[str] = "empty_cache_every_epoch"
        events: ClassVar[frozenset[Event]] = frozenset({Event.EPOCH_END})

        def decide(self, event, snap):
            return [EmptyCache(reason="epoch end")]

        def state_dict(self):
            return {}

        def load_state_dict(self, state):
            pass

Install it as a plug-in through the entry-point group `autotune.policies`, or name it
in a preset as `use = "package.module:EmptyCacheEveryEpoch"`.
"""

from __future__ import annotations

from typing import Any, ClassVar, Protocol, Sequence, runtime_checkable

from autotune.actions import Action
from autotune.events import Event
from autotune.snapshot import Snapshot


@runtime_checkable
class Policy(Protocol):
    """What the trainer needs from a policy (see the module docstring for an example)."""

    name: ClassVar[str]  # key in presets and in the registry
    events: ClassVar[frozenset[Event]]  # the events this policy is asked about

    def decide(self, event: Event, snap: Snapshot) -> Sequence[Action]:
        """Return the actions to take now (often none). Must not mutate anything but self."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """State that must survive a checkpoint (ceilings, cooldowns), as plain data."""
        ...

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `state_dict` returned."""
        ...
