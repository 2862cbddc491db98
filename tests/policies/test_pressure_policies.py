from autotune.common.actions import EmptyCache, SetMicroBatch
from autotune.common.events import Event
from autotune.policies import EmptyCacheOnPressure, ShrinkOnThrash
from autotune.common.snapshot import AllocatorStats, DeviceSample, Snapshot


def snap(step, fraction=0.95, retries=None, micro=64):
    return Snapshot(step=step, epoch=0, batch_size=64, micro_batch_size=micro, device="cuda:0",
                    sample=DeviceSample(time=0.0, used_bytes=int(fraction * 100), cap_bytes=100),
                    allocator=AllocatorStats(num_alloc_retries=retries) if retries is not None else None)


def test_empty_cache_under_pressure_with_a_cooldown():
    policy = EmptyCacheOnPressure(threshold=0.9, cooldown_steps=10)
    assert isinstance(policy.decide(Event.MEMORY_PRESSURE, snap(0))[0], EmptyCache)
    assert policy.decide(Event.MEMORY_PRESSURE, snap(5)) == []  # cooling down
    assert policy.decide(Event.MEMORY_HIGH, snap(10))[0].reason == "memory at 95% of the cap"


def test_empty_cache_not_when_memory_is_not_tight():
    policy = EmptyCacheOnPressure(threshold=0.9)
    assert policy.decide(Event.MEMORY_HIGH, snap(0, fraction=0.85)) == []
    assert policy.decide(Event.MEMORY_PRESSURE, snap(1, fraction=0.5)) == []


def test_shrink_after_consecutive_steps_with_new_retries():
    policy = ShrinkOnThrash(steps=2, factor=0.75)
    assert policy.decide(Event.BATCH_MEASURED, snap(0, retries=0)) == []
    assert policy.decide(Event.BATCH_MEASURED, snap(1, retries=1)) == []  # one step with retries
    (action,) = policy.decide(Event.BATCH_MEASURED, snap(2, retries=3))  # two in a row
    assert action == SetMicroBatch(48, action.reason)
    assert policy.decide(Event.BATCH_MEASURED, snap(3, retries=3)) == []  # no new retries: streak broken


def test_shrink_needs_allocator_figures():
    assert ShrinkOnThrash().decide(Event.BATCH_MEASURED, snap(0)) == []  # CPU: none
