import pytest

from autotune.decisions.detectors import InputDetector, MemoryDetector
from autotune.common.events import Event
from autotune.common.snapshot import AllocatorStats, DeviceSample, StepTiming


def at(fraction):
    return DeviceSample(time=0.0, used_bytes=int(fraction * 1000), cap_bytes=1000)


def feed(detector, fractions):
    return [bool(detector.on_sample(at(f))) for f in fractions]


def test_high_needs_confirmation_then_fires_once_and_repeats_while_it_lasts():
    detector = MemoryDetector(high=0.9, low=0.8, confirm=2, repeat=3)
    assert feed(detector, [0.5, 0.95, 0.95, 0.95, 0.95, 0.95, 0.95]) == [False, False, True, False, False, True, False]


def test_hovering_at_the_line_does_not_chatter():
    detector = MemoryDetector(high=0.9, low=0.8, confirm=1, repeat=100)
    # dips to 0.85 (between low and high) do not re-arm; only falling below 0.8 does
    assert feed(detector, [0.91, 0.85, 0.91, 0.85, 0.91, 0.79, 0.91]) == [True, False, False, False, False, False, True]


def test_unknown_figures_fire_nothing():
    assert MemoryDetector().on_sample(DeviceSample(time=0.0)) == []


def test_new_allocator_retries_are_pressure():
    detector = MemoryDetector()
    assert detector.on_step(AllocatorStats(num_alloc_retries=0), None) == []
    assert detector.on_step(AllocatorStats(num_alloc_retries=0), None) == []
    assert detector.on_step(AllocatorStats(num_alloc_retries=2), None) == [Event.MEMORY_PRESSURE]
    assert detector.on_step(AllocatorStats(num_alloc_retries=2), None) == []


def test_fragmentation_when_high_is_pressure():
    detector = MemoryDetector()
    fragmented = AllocatorStats(allocated_bytes=600, reserved_bytes=1000)
    assert detector.on_step(fragmented, at(0.95)) == [Event.MEMORY_PRESSURE]
    assert detector.on_step(fragmented, at(0.5)) == []  # plenty of room: not pressure
    assert detector.on_step(None, at(0.95)) == []  # CPU: no allocator figures


def test_bad_thresholds():
    with pytest.raises(ValueError):
        MemoryDetector(high=0.7, low=0.8)


def steps(detector, share, n, seconds=0.1, samples=32):
    events = []
    for _ in range(n):
        events += detector.on_step(StepTiming(step_seconds=seconds, data_wait_seconds=share * seconds), samples)
    return events


def test_input_bound_fires_once_per_full_window_above_the_threshold():
    detector = InputDetector(high=0.2, calm=0.05, window=10)
    assert steps(detector, 0.3, 9) == []  # the window is not full yet
    assert steps(detector, 0.3, 1) == [Event.IO_BOUND]
    assert steps(detector, 0.3, 9) == [] and steps(detector, 0.3, 1) == [Event.IO_BOUND]  # a fresh window each time
    wait, rate, n = detector.summary()
    assert abs(wait - 0.3) < 1e-9 and abs(rate - 320) < 1e-6 and n == 10


def test_input_bound_has_hysteresis():
    detector = InputDetector(high=0.2, calm=0.05, window=10)
    assert steps(detector, 0.1, 10) == []  # between the lines, not yet input-bound
    assert steps(detector, 0.25, 10) == [Event.IO_BOUND]
    assert steps(detector, 0.1, 10) == [Event.IO_BOUND]  # still input-bound until it is calm
    assert steps(detector, 0.01, 10) == [] and not detector.is_bound
    assert steps(detector, 0.1, 10) == []


def test_a_compute_bound_loop_is_never_input_bound():
    detector = InputDetector()
    assert steps(detector, 0.02, 200) == []


def test_restart_forgets_the_window():
    detector = InputDetector(window=10)
    steps(detector, 0.5, 9)
    detector.restart()
    assert steps(detector, 0.5, 9) == []


def test_bad_input_thresholds():
    with pytest.raises(ValueError, match="calm"):
        InputDetector(high=0.05, calm=0.2)


def test_input_summary_is_the_last_full_window_while_the_next_fills():
    """tune_workers judges a trial on a full window; asked at a batch where the next window has begun
    (batches measured every 32, windows of 20: they may never meet), it must still find the full one."""
    detector = InputDetector(high=0.2, calm=0.05, window=10)
    steps(detector, 0.3, 4)
    assert detector.summary()[2] == 4  # before the first full window: the one filling
    steps(detector, 0.3, 6)
    steps(detector, 0.1, 3)  # the next window has begun
    wait, _, n = detector.summary()
    assert n == 10 and abs(wait - 0.3) < 1e-9
    detector.restart()  # the loader changed: its figures start again
    steps(detector, 0.1, 3)
    assert detector.summary()[2] == 3
