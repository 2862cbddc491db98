import dataclasses

from autotune.common.actions import CacheSamples, SetLoaderWorkers
from autotune.common.events import Event
from autotune.policies import CacheWhenIOBound, TuneWorkers
from autotune.common.snapshot import InputProfile, InputState, Snapshot

LOAD_BOUND = InputProfile(load_seconds=0.004, transform_seconds=0.001, samples=8, cacheable=True, how="test")
TRANSFORM_BOUND = InputProfile(load_seconds=0.001, transform_seconds=0.004, samples=8, cacheable=True, how="test")


def snap(step=100, workers=0, cores=4, rate=100.0, steps=20, owned=True, cache=False, profile=LOAD_BOUND):
    return Snapshot(step=step, epoch=0, batch_size=32, micro_batch_size=32, device="cpu",
                    input=InputState(data_wait_fraction=0.4, samples_per_second=rate, steps=steps, num_workers=workers,
                                     cpu_cores=cores, loader_owned=owned, cache_active=cache, profile=profile))


def test_caches_when_load_and_decode_dominate():
    (action,) = CacheWhenIOBound(max_bytes="1GiB").decide(Event.IO_BOUND, snap())
    assert isinstance(action, CacheSamples) and action.max_bytes == 2**30
    assert "40% of step time waiting" in action.reason and "load/decode is 80%" in action.reason


def test_does_not_cache_when_it_would_not_help_or_is_not_safe():
    policy = CacheWhenIOBound()
    assert policy.decide(Event.IO_BOUND, snap(profile=TRANSFORM_BOUND)) == []  # the transforms are the cost
    assert policy.decide(Event.IO_BOUND, snap(cache=True)) == []  # already on
    assert policy.decide(Event.IO_BOUND, snap(owned=False)) == []  # the caller's DataLoader
    unsafe = InputProfile(0.004, 0.001, 0, cacheable=False, how="random output")
    assert policy.decide(Event.IO_BOUND, snap(profile=unsafe)) == []
    assert policy.decide(Event.IO_BOUND, Snapshot(step=1, epoch=0, batch_size=8, micro_batch_size=8, device="cpu")) == []


def test_bad_cache_parameters_are_named():
    import pytest

    with pytest.raises(ValueError, match="max_bytes"):
        CacheWhenIOBound(max_bytes="lots")
    with pytest.raises(ValueError, match="min_load_share"):
        CacheWhenIOBound(min_load_share=2)


def test_adds_workers_up_to_the_idle_cores():
    policy = TuneWorkers()
    (action,) = policy.decide(Event.IO_BOUND, snap(workers=0, cores=8))
    assert action == SetLoaderWorkers(2, reason=action.reason)
    assert policy.decide(Event.IO_BOUND, snap(workers=2, cores=8)) == []  # judging the last change first
    assert TuneWorkers().decide(Event.IO_BOUND, snap(workers=4, cores=8))[0].num_workers == 7  # cores - 1
    assert TuneWorkers().decide(Event.IO_BOUND, snap(workers=0, cores=2))[0].num_workers == 1
    assert TuneWorkers().decide(Event.IO_BOUND, snap(workers=0, cores=1)) == []  # no idle core
    assert TuneWorkers(max_workers=3).decide(Event.IO_BOUND, snap(workers=2, cores=64))[0].num_workers == 3


def test_keeps_a_change_that_helped():
    policy = TuneWorkers(judge_steps=20, min_gain=0.1)
    policy.decide(Event.IO_BOUND, snap(step=100, workers=0, rate=100.0))
    assert policy.decide(Event.BATCH_MEASURED, snap(step=110, workers=2, rate=300.0, steps=10)) == []  # too soon to judge
    assert policy.decide(Event.BATCH_MEASURED, snap(step=120, workers=2, rate=300.0, steps=20)) == []
    assert policy.decide(Event.IO_BOUND, snap(step=140, workers=2, cores=8))[0].num_workers == 4  # and tries more


def test_goes_back_when_a_change_did_not_help_and_never_tries_it_again():
    policy = TuneWorkers(judge_steps=20, min_gain=0.1)
    policy.decide(Event.IO_BOUND, snap(workers=2, cores=8, rate=100.0))
    (back,) = policy.decide(Event.BATCH_MEASURED, snap(step=130, workers=4, rate=105.0, steps=20))
    assert back.num_workers == 2 and "going back" in back.reason
    # A trial that made it slower says what it cost: 30 steps of 32 samples at 80/s instead of 100/s.
    policy = TuneWorkers(judge_steps=20, min_gain=0.1)
    policy.decide(Event.IO_BOUND, snap(step=100, workers=2, cores=8, rate=100.0))
    (back,) = policy.decide(Event.BATCH_MEASURED, snap(step=130, workers=4, rate=80.0, steps=20))
    assert "the trial cost ~2.40 s over 30 steps" in back.reason  # 960 / 80 - 960 / 100
    assert policy.decide(Event.IO_BOUND, snap(step=200, workers=2, cores=8)) == []  # 4 did not help: 2 is the most
    fresh = TuneWorkers()
    fresh.load_state_dict(policy.state_dict())  # a resumed run remembers it
    assert fresh.decide(Event.IO_BOUND, snap(step=200, workers=2, cores=8)) == []


def test_no_worker_trial_over_tensors_in_memory():
    # A batch gathered from tensors in memory: a worker would make the same gather and send it back.
    state = snap(workers=0, cores=16).input
    gathered = Snapshot(step=100, epoch=0, batch_size=32, micro_batch_size=32, device="cpu",
                        input=dataclasses.replace(state, gathered=True))
    assert TuneWorkers().decide(Event.IO_BOUND, gathered) == []
    assert TuneWorkers().decide(Event.IO_BOUND, snap(workers=0, cores=16)) != []
