"""Event -> subscribed policies -> actions -> conflicts resolved -> applied -> journal.

Every decision goes to the journal as an `action` line, applied or suppressed, with the
policy's reason and what applying it did.
"""

from __future__ import annotations

from typing import Sequence

from loguru import logger

from autotune import knobs as knob_module
from autotune.actions import Action, SetMicroBatch, action_kind, action_params
from autotune.events import Event
from autotune.journal import Journal
from autotune.policy import Policy
from autotune.snapshot import Snapshot


def resolve_conflicts(proposals: list[tuple[Policy, Action]]) -> list[tuple[Policy, Action, str | None]]:
    """Decide which proposals to carry out. Returns (policy, action, why_suppressed or None).

    Two micro-batch sizes in one round: the smaller wins, because the OOM it avoids costs
    more than the throughput it gives up. Identical actions run once.
    """
    smallest = min((a.size for _, a in proposals if isinstance(a, SetMicroBatch)), default=None)
    resolved: list[tuple[Policy, Action, str | None]] = []
    seen: set[tuple[str, tuple]] = set()
    winner_taken = False
    for policy, action in proposals:
        key = (action_kind(action), tuple(sorted(action_params(action).items())))
        if isinstance(action, SetMicroBatch) and (action.size != smallest or winner_taken):
            resolved.append((policy, action, f"another policy asked for micro-batch {smallest}"))
            continue
        if key in seen:
            resolved.append((policy, action, "the same action was already taken this round"))
            continue
        seen.add(key)
        winner_taken = winner_taken or isinstance(action, SetMicroBatch)
        resolved.append((policy, action, None))
    return resolved


class Dispatcher:
    """Asks the subscribed policies about each event and applies their actions to `knobs`."""

    def __init__(self, policies: Sequence[Policy], knobs: knob_module.Knobs, journal: Journal):
        self.policies = list(policies)
        self.knobs = knobs
        self.journal = journal

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
                self.journal.write("policy_error", snap.step, snap.epoch, policy=policy.name,
                                   event=event.value, error=repr(exc))
                continue
            proposals.extend((policy, action) for action in actions)
        applied: list[Action] = []
        for policy, action, suppressed in resolve_conflicts(proposals):
            if suppressed is None:
                outcome = knob_module.apply(action, self.knobs)
                is_applied, note = outcome.applied, outcome.note
            else:
                is_applied, note = False, suppressed
            if is_applied:
                applied.append(action)
                logger.info(f"{policy.name}: {action.reason} ({note})")
            self.journal.write("action", snap.step, snap.epoch, event=event.value, policy=policy.name,
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
