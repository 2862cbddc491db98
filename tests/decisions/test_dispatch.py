import dataclasses
from typing import ClassVar

import torch

from autotune.common.actions import EmptyCache, SetMicroBatch
from autotune.decisions.dispatch import Dispatcher
from autotune.common.events import Event
from autotune.observe.journal import Journal, read_journal
from autotune.decisions.knobs import Knobs
from autotune.common.snapshot import Snapshot

SNAP = Snapshot(step=5, epoch=1, batch_size=64, micro_batch_size=64, device="cpu", failed_micro_batch=64)


@dataclasses.dataclass
class Asks:
    """Test policy: proposes fixed actions on OOM."""

    name: ClassVar[str] = "asks"
    events: ClassVar[frozenset] = frozenset({Event.OOM})
    actions: tuple = ()

    def decide(self, event, snap):
        return list(self.actions)

    def state_dict(self):
        return {"n": len(self.actions)}

    def load_state_dict(self, state):
        self.loaded = state


class Broken(Asks):
    def decide(self, event, snap):
        raise ZeroDivisionError("bug in a policy")


def dispatcher(tmp_path, *policies):
    knobs = Knobs(batch_size=64, micro_batch_size=64, device=torch.device("cpu"))
    return Dispatcher(policies, knobs, Journal(tmp_path / "events.jsonl")), knobs


def actions_in(tmp_path):
    return [r for r in read_journal(tmp_path / "events.jsonl") if r["kind"] == "action"]


def test_the_smaller_micro_batch_wins_and_the_other_is_journaled_as_suppressed(tmp_path):
    d, knobs = dispatcher(tmp_path, Asks((SetMicroBatch(32, "a"),)), Asks((SetMicroBatch(16, "b"),)))
    applied = d.fire(Event.OOM, SNAP)
    assert applied == [SetMicroBatch(16, "b")] and knobs.micro_batch_size == 16
    records = actions_in(tmp_path)
    assert [(r["params"]["size"], r["applied"]) for r in records] == [(32, False), (16, True)]
    assert "micro-batch 16" in records[0]["note"] and records[1]["reason"] == "b"


def test_identical_actions_run_once(tmp_path):
    d, _ = dispatcher(tmp_path, Asks((EmptyCache("x"),)), Asks((EmptyCache("x"),)))
    assert len(d.fire(Event.OOM, SNAP)) == 1
    assert [r["applied"] for r in actions_in(tmp_path)] == [True, False]


def test_an_action_that_changes_nothing_is_suppressed(tmp_path):
    d, knobs = dispatcher(tmp_path, Asks((SetMicroBatch(64, "same"),)))
    assert d.fire(Event.OOM, SNAP) == [] and knobs.micro_batch_size == 64
    (record,) = actions_in(tmp_path)
    assert record["applied"] is False and record["note"] == "micro-batch is already 64"


def test_micro_batch_is_clamped_to_the_batch(tmp_path):
    d, knobs = dispatcher(tmp_path, Asks((SetMicroBatch(0, "too small"),)))
    d.fire(Event.OOM, SNAP)
    assert knobs.micro_batch_size == 1


def test_a_failing_policy_is_journaled_and_the_others_still_act(tmp_path):
    d, knobs = dispatcher(tmp_path, Broken(), Asks((SetMicroBatch(8, "ok"),)))
    d.fire(Event.OOM, SNAP)
    assert knobs.micro_batch_size == 8
    errors = [r for r in read_journal(tmp_path / "events.jsonl") if r["kind"] == "policy_error"]
    assert errors and "bug in a policy" in errors[0]["error"]


def test_policies_not_subscribed_are_not_asked(tmp_path):
    d, knobs = dispatcher(tmp_path, Asks((SetMicroBatch(8, "x"),)))
    assert d.fire(Event.EPOCH_END, SNAP) == [] and knobs.micro_batch_size == 64


def test_state_round_trip(tmp_path):
    a = Asks((EmptyCache(),))
    d, _ = dispatcher(tmp_path, a)
    b = Asks()
    d2, _ = dispatcher(tmp_path, b)
    d2.load_state_dict(d.state_dict())
    assert b.loaded == {"n": 1}


def test_empty_cache_reports_what_it_returned(tmp_path):
    d, _ = dispatcher(tmp_path, Asks((EmptyCache("pressure"),)))
    d.fire(Event.OOM, SNAP)
    (record,) = actions_in(tmp_path)
    assert record["applied"] and record["action"] == "empty_cache" and "returned" in record["note"]


@dataclasses.dataclass
class Listens(Asks):
    """Test policy that keeps the notices it gets."""

    notices: list = dataclasses.field(default_factory=list)

    def action_suppressed(self, action, why):
        self.notices.append(("suppressed", action, why))

    def relief_failed(self, action, why):
        self.notices.append(("failed", action, why))


def test_a_policy_learns_that_its_action_was_suppressed_or_its_relief_failed(tmp_path):
    from autotune.common.actions import PruneChannels

    small, big = Listens(actions=(SetMicroBatch(16),)), Listens(actions=(SetMicroBatch(48),))
    prune = Listens(actions=(PruneChannels(ratio=0.1),))
    d, knobs = dispatcher(tmp_path, small, big, prune)
    d.fire(Event.OOM, SNAP)
    assert small.notices == [] and [n[0] for n in big.notices] == ["suppressed"]
    assert "micro-batch 16" in big.notices[0][2]
    relief = knobs.take_relief()  # the trainer takes it to carry it out, and it fails
    d.relief_failed(relief, "pruning would break this model")
    assert prune.notices == [("failed", relief, "pruning would break this model")]
    d.relief_failed(relief, "again")  # told once
    assert len(prune.notices) == 1


def test_tune_workers_tries_again_when_its_change_was_suppressed():
    from autotune.common.actions import SetLoaderWorkers
    from autotune.policies import TuneWorkers
    from autotune.common.snapshot import InputState

    bound = dataclasses.replace(SNAP, input=InputState(data_wait_fraction=0.5, samples_per_second=100.0, steps=20,
                                                        num_workers=0, cpu_cores=8, loader_owned=True))
    policy = TuneWorkers()
    first = policy.decide(Event.IO_BOUND, bound)
    assert first == [SetLoaderWorkers(2, reason=first[0].reason)]
    assert policy.decide(Event.IO_BOUND, bound) == []  # measuring its trial
    policy.action_suppressed(first[0], "already 2 loader workers")
    assert policy.decide(Event.IO_BOUND, bound) == first  # no trial runs: it may ask again
