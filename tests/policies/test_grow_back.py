from autotune.common.actions import SetMicroBatch
from autotune.common.events import Event
from autotune.policies import GrowBack, HalveOnOOM
from autotune.common.snapshot import DeviceSample, Snapshot


def snap(step, micro, batch=1024, demand=None, failed=None, good=None):
    return Snapshot(step=step, epoch=0, batch_size=batch, micro_batch_size=micro, device="cpu",
                    failed_micro_batch=failed, last_good_micro_batch=good, step_demand=demand,
                    sample=DeviceSample(time=0.0, used_bytes=98, cap_bytes=100))  # raw fraction: ignored


def run_until_action(policy, micro, start_step=0, **kwargs):
    for step in range(start_step, start_step + 10_000):
        actions = policy.decide(Event.BATCH_MEASURED, snap(step, micro, **kwargs))
        if actions:
            return step, actions[0]
    return None, None


def test_doubles_after_calm_steps_up_to_the_batch():
    policy = GrowBack(calm_steps=5)
    step, action = run_until_action(policy, 64)
    assert step == 4 and action == SetMicroBatch(128, action.reason)
    _, action = run_until_action(policy, 768, batch=1000)
    assert action.size == 1000


def test_a_step_that_demanded_most_of_its_room_is_not_calm():
    policy = GrowBack(calm_steps=3, headroom=0.9)
    for step in range(20):
        assert policy.decide(Event.BATCH_MEASURED, snap(step, 64, demand=0.95)) == []


def test_growth_stops_where_the_demand_predicts_the_edge():
    policy = GrowBack(calm_steps=1)
    (action,) = policy.decide(Event.BATCH_MEASURED, snap(0, 300, demand=0.6))
    assert action.size == 500  # 300 / 0.6: doubling to 600 would be predicted not to fit
    (action,) = policy.decide(Event.BATCH_MEASURED, snap(1, 500, demand=0.89))  # still calm (< 0.9)
    assert action.size == 561  # 500 / 0.89
    assert policy.decide(Event.BATCH_MEASURED, snap(2, 561, demand=0.995)) == []  # at the edge: stays


def test_binary_search_below_a_failure_converges_then_stays():
    """Simulate a device where sizes up to 600 fit: the search must end in (540, 600]
    (within the 10% margin) with few failures, and then ask for nothing more."""
    fits = 600
    grow, halve = GrowBack(calm_steps=3, search_calm_steps=1), HalveOnOOM()
    micro, good, failures, step = 4096, None, 0, 0
    while step < 500:
        if micro > fits:
            failures += 1
            s = snap(step, micro, batch=4096, failed=micro, good=good)
            grow.decide(Event.OOM, s)
            micro = halve.decide(Event.OOM, s)[0].size
            continue
        good = micro
        actions = grow.decide(Event.BATCH_MEASURED, snap(step, micro, batch=4096, good=good))
        if actions:
            micro = actions[0].size
        step += 1
    assert 540 <= micro <= fits
    assert failures <= 6  # 4096 -> 2048 -> 1024 -> 512 (3), then at most a few probes above 600
    history = []
    for extra in range(500, 1500):  # converged: no more probes while the failure is remembered
        history += grow.decide(Event.BATCH_MEASURED, snap(extra, micro, batch=4096, good=micro))
    assert history == []


def test_a_failed_size_is_retried_after_it_is_forgotten():
    policy = GrowBack(calm_steps=2, search_calm_steps=1, forget_failure_steps=100)
    policy.decide(Event.OOM, snap(10, 512, failed=512))
    step, action = run_until_action(policy, 500, start_step=11)
    assert step >= 110 and action.size == 1000  # failure forgotten: doubling again


def test_state_survives_a_checkpoint():
    policy = GrowBack()
    policy.decide(Event.OOM, snap(7, 256, failed=256))
    restored = GrowBack()
    restored.load_state_dict(policy.state_dict())
    assert (restored.failed, restored.failed_step) == (256, 7)


def test_halve_returns_to_the_last_good_size_not_below_it():
    (action,) = HalveOnOOM().decide(Event.OOM, snap(3, 768, failed=768, good=512))
    assert action.size == 512
    (action,) = HalveOnOOM().decide(Event.OOM, snap(3, 768, failed=768, good=256))
    assert action.size == 384  # the good size is below the half: halve as usual
