import pytest

from autotune.common.actions import SetMicroBatch
from autotune.common.events import Event
from autotune.policies import HalveOnOOM
from autotune.common.snapshot import Snapshot


def oom_at(size, batch=64):
    return Snapshot(step=3, epoch=0, batch_size=batch, micro_batch_size=size, device="cpu", failed_micro_batch=size)


def test_halves_the_failing_size():
    (action,) = HalveOnOOM().decide(Event.OOM, oom_at(64))
    assert isinstance(action, SetMicroBatch) and action.size == 32 and "64" in action.reason


def test_odd_sizes_round_down_and_stop_at_the_minimum():
    policy = HalveOnOOM(min_micro_batch=4)
    assert policy.decide(Event.OOM, oom_at(9))[0].size == 4
    assert policy.decide(Event.OOM, oom_at(5))[0].size == 4
    assert policy.decide(Event.OOM, oom_at(4)) == []


def test_gives_up_at_one():
    assert HalveOnOOM().decide(Event.OOM, oom_at(1)) == []


def test_remembers_the_smallest_failing_size_across_checkpoints():
    policy = HalveOnOOM()
    policy.decide(Event.OOM, oom_at(64))
    policy.decide(Event.OOM, oom_at(32))
    restored = HalveOnOOM()
    restored.load_state_dict(policy.state_dict())
    assert restored.ceiling == 32


def test_rejects_a_bad_minimum():
    with pytest.raises(ValueError, match="min_micro_batch"):
        HalveOnOOM(min_micro_batch=0)


def test_a_size_at_the_edge_of_the_room_steps_back_a_tenth_then_halves():
    # At the edge (it fit the last batch, which needed nearly all the room), half the throughput
    # would be lost for a few bytes; if a tenth smaller fails too, the room really shrank and
    # halving takes over. Where the last batch needed much less, the need jumped: it halves.
    from autotune.common.snapshot import StepMemory

    def oom(size, good, need_share):
        memory = StepMemory(good, int(need_share * 300 * 2**20), 300 * 2**20)
        return Snapshot(step=3, epoch=0, batch_size=512, micro_batch_size=size, device="cpu",
                        failed_micro_batch=size, last_good_micro_batch=good, step_memory=memory)

    policy = HalveOnOOM()
    (action,) = policy.decide(Event.OOM, oom(145, 145, 0.94))
    assert action.size == 130 and "edge" in action.reason and "94%" in action.reason
    assert policy.decide(Event.OOM, oom(130, 145, 0.94))[0].size == 65
    assert policy.decide(Event.OOM, oom(145, 145, 0.5))[0].size == 72  # the need jumped
