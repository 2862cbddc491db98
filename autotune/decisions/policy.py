"""The policy interface.

A policy is a pure decision maker: it receives an `Event` and a frozen `Snapshot` and
returns `Action`s. It never touches the trainer, model, optimizer or loader; `knobs.py`
applies what it asks for, and the journal records every decision with its reason.

Writing one takes a dataclass (its fields are the parameters a TOML preset may set)::

    @dataclasses.dataclass
    class EmptyCacheEveryEpoch(PolicyBase):
        '''Return cached memory at every epoch end.'''
        name: ClassVar[str] = "empty_cache_every_epoch"
        events: ClassVar[frozenset[Event]] = frozenset({Event.EPOCH_END})

        def decide(self, event, snap):
            return [EmptyCache(reason="epoch end")]

`PolicyBase` gives a policy with no state to keep the checkpoint methods (no-ops) and the
two notices a policy may want (no-ops too): `action_suppressed(action, why)`, when an
action it asked for was not applied this time (another policy's won, or it changed nothing),
and `relief_failed(action, why)`, when a relief it asked for could not be carried out (it would break
the model, or it ran out of memory itself): asking again would fail the same way.

Install it as a plug-in through the entry-point group `autotune.policies`, or name it
in a preset as `use = "package.module:EmptyCacheEveryEpoch"`.

Owns the policy protocol. Touches nothing.
"""

from __future__ import annotations

from typing import Any, ClassVar, Protocol, Sequence, runtime_checkable

from autotune.common.actions import Action
from autotune.common.events import Event
from autotune.common.snapshot import Snapshot


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


class PolicyBase:
    """No-op defaults for the parts of a policy that many do not need (see the module docstring).
    Not required: any object with the `Policy` members will do."""

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        return None

    def action_suppressed(self, action: Action, why: str) -> None:
        """An action this policy asked for was not applied this time."""

    def relief_failed(self, action: Action, why: str) -> None:
        """A relief this policy asked for was applied but could not be carried out."""
