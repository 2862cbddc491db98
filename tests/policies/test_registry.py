"""Every policy in the registry: documented, round-trips through TOML, calm on a calm snapshot."""

import inspect

import pytest

from autotune.events import Event
from autotune.policies import BUILTIN_POLICIES
from autotune.policy import Policy
from autotune.presets import build_policy, policy_parameters
from autotune.snapshot import DeviceSample, Snapshot, StepTiming

CALM = Snapshot(step=10, epoch=0, batch_size=64, micro_batch_size=64, device="cpu",
                sample=DeviceSample(time=0.0, used_bytes=1 << 30, cap_bytes=8 << 30, source="host"),
                timing=StepTiming(step_seconds=0.1, data_wait_seconds=0.001))


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
    fresh = policy_cls()
    fresh.load_state_dict(policy.state_dict())
    assert fresh.state_dict() == policy.state_dict()


def test_no_action_on_a_calm_snapshot(policy_cls):
    policy = policy_cls()
    for event in policy.events - {Event.OOM}:
        assert list(policy.decide(event, CALM)) == []
