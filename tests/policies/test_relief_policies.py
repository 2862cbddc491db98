import torch

from autotune.common.actions import CheckpointActivations, PruneChannels, UseAutocast
from autotune.decisions.dispatch import Dispatcher
from autotune.common.events import Event
from autotune.observe.journal import Journal
from autotune.decisions.knobs import Knobs
from autotune.policies import AutocastNearCap, CheckpointNearCap, PruneNearCap
from autotune.common.snapshot import Snapshot


def snap(step, demand=0.95, micro=1, reliefs=(), last=None, failed=None):
    return Snapshot(step=step, epoch=0, batch_size=8, micro_batch_size=micro, device="cpu", step_demand=demand,
                    reliefs=tuple(reliefs), last_relief_step=last, failed_micro_batch=failed)


def run(policy, snaps, event=Event.BATCH_MEASURED):
    return [policy.decide(event, s) for s in snaps]


def test_acts_after_persistent_high_demand_at_the_smallest_micro_batch():
    policy = AutocastNearCap(high=0.9, persist_steps=3)
    out = run(policy, [snap(1), snap(2), snap(3)])
    assert out[:2] == [[], []] and isinstance(out[2][0], UseAutocast) and "3 steps in a row" in out[2][0].reason
    assert run(policy, [snap(4, demand=0.5), snap(5), snap(6)]) == [[], [], []]  # the streak restarted


def test_not_while_the_micro_batch_can_still_shrink_or_demand_is_not_known():
    policy = AutocastNearCap(persist_steps=1)
    assert policy.decide(Event.BATCH_MEASURED, snap(1, micro=4)) == []  # accumulate smaller micro-batches first
    assert policy.decide(Event.BATCH_MEASURED, snap(2, demand=None)) == []
    assert AutocastNearCap(persist_steps=1, floor_micro_batch=4).decide(Event.BATCH_MEASURED, snap(3, micro=4))


def test_an_oom_at_the_floor_acts_at_once_and_above_it_not():
    policy = CheckpointNearCap(persist_steps=50, settle_steps=50)
    assert isinstance(policy.decide(Event.OOM, snap(7, failed=1, last=7))[0], CheckpointActivations)
    assert policy.decide(Event.OOM, snap(8, failed=2, micro=2)) == []


def test_waits_for_the_last_relief_to_settle_and_does_nothing_once_applied():
    policy = CheckpointNearCap(persist_steps=1, settle_steps=10)
    assert policy.decide(Event.BATCH_MEASURED, snap(15, reliefs=["autocast"], last=10)) == []  # 5 steps since
    assert policy.decide(Event.BATCH_MEASURED, snap(20, reliefs=["autocast"], last=10))
    assert policy.decide(Event.BATCH_MEASURED, snap(40, reliefs=["autocast", "checkpointing"], last=20)) == []


def test_pruning_goes_in_bounded_steps_up_to_the_maximum():
    policy = PruneNearCap(step_ratio=0.2, max_ratio=0.5, persist_steps=1, settle_steps=0)
    (first,) = policy.decide(Event.BATCH_MEASURED, snap(1))
    assert first == PruneChannels(ratio=0.2, reason=first.reason)
    (second,) = policy.decide(Event.BATCH_MEASURED, snap(2, reliefs=["pruning"]))  # 20% done
    assert second.ratio == 0.2
    (third,) = policy.decide(Event.BATCH_MEASURED, snap(3, reliefs=["pruning"] * 2))  # 36% done
    assert third.ratio == 0.2  # 48.8% after it
    (last,) = policy.decide(Event.BATCH_MEASURED, snap(4, reliefs=["pruning"] * 3))
    assert abs((1 - 0.512 * (1 - last.ratio)) - 0.5) < 1e-3  # just up to the maximum
    assert policy.decide(Event.BATCH_MEASURED, snap(5, reliefs=["pruning"] * 4)) == []


def test_the_ladder_climbs_one_rung_per_trigger_in_preset_order(tmp_path):
    knobs = Knobs(batch_size=8, micro_batch_size=1, device=torch.device("cpu"))
    dispatcher = Dispatcher([AutocastNearCap(persist_steps=1, settle_steps=0),
                             CheckpointNearCap(persist_steps=1, settle_steps=0),
                             PruneNearCap(persist_steps=1, settle_steps=0)], knobs, Journal(tmp_path / "j.jsonl"))
    climbed = []
    for step in range(5):
        applied = dispatcher.fire(Event.BATCH_MEASURED, snap(step, reliefs=climbed, last=step - 1 if climbed else None))
        assert len(applied) == 1  # one rung; the others are journaled as suppressed
        climbed.append({UseAutocast: "autocast", CheckpointActivations: "checkpointing",
                        PruneChannels: "pruning"}[type(knobs.relief)])
        knobs.relief = None  # what the trainer does when it carries the relief out
    assert climbed == ["autocast", "checkpointing", "pruning", "pruning", "pruning"]
