"""Every policy in the registry: documented, round-trips through TOML and through its state,
and does nothing on a calm mid-run snapshot."""

import dataclasses
import inspect

import pytest

from autotune.common.actions import PruneChannels
from autotune.common.events import Event
from autotune.policies import BUILTIN_POLICIES
from autotune.decisions.policy import Policy
from autotune.tuning.presets import build_policy, policy_parameters
from autotune.common.snapshot import AllocatorStats, DeviceSample, InputProfile, InputState, Snapshot, StepTiming

GIB = 2**30


def sample(used_fraction: float) -> DeviceSample:
    return DeviceSample(time=0.0, used_bytes=int(used_fraction * 8 * GIB), cap_bytes=8 * GIB, total_bytes=8 * GIB,
                        source="host")


# A run 500 steps in that has settled: at its batch size, half the room used, the allocator
# quiet (retries long ago, constant since), a loader with its one worker keeping up, its
# transforms the slow part of a sample, two OOMs survived earlier.
CALM = Snapshot(
    step=500, epoch=3, batch_size=64, micro_batch_size=64, device="cpu", last_good_micro_batch=64,
    step_demand=0.55, ooms=2, sample=sample(0.5), window=tuple(sample(0.5) for _ in range(5)),
    allocator=AllocatorStats(allocated_bytes=3 * GIB, reserved_bytes=int(3.2 * GIB), peak_bytes=int(3.5 * GIB),
                             num_alloc_retries=4),
    timing=StepTiming(step_seconds=0.1, data_wait_seconds=0.001),
    input=InputState(data_wait_fraction=0.01, samples_per_second=640.0, steps=20, num_workers=1, cpu_cores=2,
                     loader_owned=True,
                     profile=InputProfile(load_seconds=0.2e-3, transform_seconds=0.8e-3, samples=16, cacheable=True,
                                          how="torchvision")))


@pytest.fixture(params=sorted(BUILTIN_POLICIES))
def policy_cls(request):
    return BUILTIN_POLICIES[request.param]


def test_has_a_method_card(policy_cls):
    module_doc = inspect.getdoc(inspect.getmodule(policy_cls))
    assert module_doc and module_doc.startswith(policy_cls.name), "the module docstring is the method card"
    assert "Parameters" in module_doc and inspect.getdoc(policy_cls)


def test_round_trips_through_toml(policy_cls):
    defaults = {k: v for k, v in policy_parameters(policy_cls).items() if v is not inspect.Parameter.empty}
    policy = build_policy({"use": policy_cls.name, **defaults})
    assert isinstance(policy, Policy) and isinstance(policy, policy_cls)


INPUT_BOUND = dataclasses.replace(CALM.input, data_wait_fraction=0.4, samples_per_second=100.0, num_workers=0,
                                  cpu_cores=8, profile=None)
MORE_WORKERS_NO_GAIN = dataclasses.replace(INPUT_BOUND, num_workers=2, samples_per_second=90.0)
NEAR_CAP = dict(micro_batch_size=1, step_demand=0.95, sample=sample(0.97))


def at(step, **changes):
    return dataclasses.replace(CALM, step=step, **changes)


# Events that move every stateful built-in policy off its defaults: an OOM (failing sizes),
# high memory (a clean-up), an input-bound loop (a worker trial, judged a failure), steps near
# the cap at micro-batch 1 with allocator retries rising (streaks, calm counts).
DRIVE = [
    (Event.OOM, at(10, failed_micro_batch=64)),
    (Event.MEMORY_HIGH, at(11, sample=sample(0.95))),
    (Event.IO_BOUND, at(12, input=INPUT_BOUND)),
    (Event.BATCH_MEASURED, at(13, allocator=dataclasses.replace(CALM.allocator, num_alloc_retries=6), **NEAR_CAP)),
    (Event.BATCH_MEASURED, at(14, allocator=dataclasses.replace(CALM.allocator, num_alloc_retries=9),
                         input=MORE_WORKERS_NO_GAIN, **NEAR_CAP)),
]
# What comes next: a policy restored from the driven one's state must decide the same.
FOLLOW = [
    (Event.BATCH_MEASURED, at(15, allocator=dataclasses.replace(CALM.allocator, num_alloc_retries=12), **NEAR_CAP)),
    (Event.OOM, at(16, failed_micro_batch=1, **NEAR_CAP)),
    (Event.MEMORY_HIGH, at(30, sample=sample(0.95))),
    (Event.IO_BOUND, at(31, input=INPUT_BOUND)),
    *[(Event.BATCH_MEASURED, at(40 + i, micro_batch_size=8)) for i in range(12)],
]


def feed(policy, events):
    return [list(policy.decide(event, snap)) for event, snap in events if event in policy.events]


def test_its_state_survives_a_checkpoint(policy_cls):
    driven = policy_cls()
    feed(driven, DRIVE)
    if hasattr(driven, "relief_failed"):
        driven.relief_failed(PruneChannels(ratio=0.1), "a relief it asked for could not be carried out")
    state = driven.state_dict()
    if state == policy_cls().state_dict():
        assert state == {}, f"{policy_cls.name}: DRIVE left it in its default state: drive it further"
        return  # a stateless policy
    restored = policy_cls()
    restored.load_state_dict(state)
    assert restored.state_dict() == state
    assert feed(restored, FOLLOW) == feed(driven, FOLLOW)


def test_no_action_on_a_calm_mid_run_snapshot(policy_cls):
    policy = policy_cls()
    for step in range(500, 560):  # long enough for every streak and cooldown to run out
        for event in sorted(policy.events - {Event.OOM}):
            assert list(policy.decide(event, dataclasses.replace(CALM, step=step))) == [], (step, event)
