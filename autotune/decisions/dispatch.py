"""Event -> subscribed policies -> actions -> conflicts resolved -> applied -> journal.

Every decision goes to the journal as an `action` line, applied or suppressed, with the
policy's reason and what applying it did. A policy learns of its own suppressed actions
(`action_suppressed`), and of a relief it asked for that could not be carried out
(`relief_failed`).
Conflicts are resolved in knobs.py, next to the code that applies actions.

Owns: asking the policies. Touches: the knobs (through knobs.apply only), the journal, the
policies' notice hooks.
"""

from __future__ import annotations

import typing
from typing import Sequence

from loguru import logger

from autotune.common.actions import Action, Relief, action_kind, action_params
from autotune.common.events import Event
from autotune.common.snapshot import Snapshot
from autotune.decisions import knobs as knob_module
from autotune.decisions.policy import Policy
from autotune.observe.journal import Journal
from autotune.observe.records import Kind


class Dispatcher:
    """Asks the subscribed policies about each event and applies their actions to `knobs`."""

    def __init__(self, policies: Sequence[Policy], knobs: knob_module.Knobs, journal: Journal):
        self.policies = list(policies)
        self.events = frozenset(event for p in self.policies for event in p.events)  # what anyone listens to
        self.knobs = knobs
        self.journal = journal
        # The relief in hand and the policy that asked for it: the one to tell when it fails or is dropped.
        self._asked_by: tuple[Relief, Policy] | None = None

    def relief_failed(self, action: Action, why: str) -> None:
        """A relief that was applied to the knobs could not be carried out: tell the policy that
        asked (it does not ask again)."""
        self._tell_who_asked(action, "relief_failed", why)

    def relief_dropped(self, action: Relief, why: str, step: int, epoch: int) -> None:
        """A relief applied to the knobs that will not be carried out (a smaller micro-batch goes
        first; another rank's policies decide): journaled, and the policy that asked told, as
        of an action suppressed (it may ask again)."""
        self.journal.write(Kind.RELIEF_DROPPED, step, epoch, relief=action_kind(action), reason=action.reason, why=why)
        self._tell_who_asked(action, "action_suppressed", why)

    def _tell_who_asked(self, action: Action, hook: str, why: str) -> None:
        # The policy whose relief this is, once.
        asked = self._asked_by
        if asked is not None and asked[0] is action:
            _tell(asked[1], hook, action, why)
            self._asked_by = None

    def fire(self, event: Event, snap: Snapshot) -> list[Action]:
        """Consult the policies subscribed to `event`; return the actions that were applied."""
        proposals: list[tuple[Policy, Action]] = []
        for policy in self.policies:
            if event not in policy.events:
                continue
            try:
                actions = list(policy.decide(event, snap))
            except Exception as exc:  # a buggy policy must not cost the run; it is logged and journaled
                logger.opt(exception=exc).error(f"policy {policy.name} failed on {event.value}; ignoring it this time")
                self.journal.write(Kind.POLICY_ERROR, snap.step, snap.epoch, policy=policy.name,
                                   event=event.value, error=repr(exc))
                continue
            proposals.extend((policy, action) for action in actions)
        applied: list[Action] = []
        if not proposals:  # most events, most steps
            return applied
        for policy, action, suppressed in knob_module.resolve_conflicts(proposals):
            if suppressed is None:
                outcome = knob_module.apply(action, self.knobs)
                is_applied, note = outcome.applied, outcome.note
            else:
                is_applied, note = False, suppressed
            if is_applied:
                applied.append(action)
                if isinstance(action, typing.get_args(Relief)):  # carried out later, by the trainer
                    self._asked_by = (action, policy)
                logger.info(f"{policy.name}: {action.reason} ({note})")
            else:
                _tell(policy, "action_suppressed", action, note)
            self.journal.write(Kind.ACTION, snap.step, snap.epoch, event=event.value, policy=policy.name,
                               action=action_kind(action), params=action_params(action),
                               reason=action.reason, applied=is_applied, note=note)
        return applied

    def state_dict(self) -> dict[str, dict]:
        """Every policy's state, by policy name (and position, when a name repeats)."""
        return {f"{i}:{p.name}": p.state_dict() for i, p in enumerate(self.policies)}

    def load_state_dict(self, state: dict[str, dict]) -> None:
        for i, policy in enumerate(self.policies):
            key = f"{i}:{policy.name}"
            if key in state:
                policy.load_state_dict(state[key])


def _tell(policy: Policy, hook: str, action: Action, why: str) -> None:
    # Optional hooks (PolicyBase has no-op ones): a plug-in that implements only the Protocol has none.
    method = getattr(policy, hook, None)
    if method is not None:
        method(action, why)
