"""Which batches are measured: while the run changes or nears the cap, every one; steady, 1 in `every`."""

import time

import pytest
import torch
from torch import nn

from autotune import Tuner
from autotune.memory.cadence import MeasureCadence
from autotune.common.events import Event

NEVER = float("inf")  # no batch is measured for the time gone by: only the counts decide


def run(cadence, sizes, demand=0.5):
    """Which of the batches at `sizes` the cadence measured."""
    measured = []
    for size in sizes:
        due = cadence.due(size)
        cadence.done(due, demand if due else None)
        measured.append(due)
    return measured


def test_steady_batches_are_measured_one_in_every():
    cadence = MeasureCadence(every=4, settle=2, interval=NEVER)
    # The first two (the start settles), then one in four.
    assert run(cadence, [8] * 12) == [True, True, False, False, False, True, False, False, False, True, False, False]


def test_a_new_size_or_a_change_is_measured_for_settle_batches():
    cadence = MeasureCadence(every=100, settle=3, interval=NEVER)
    run(cadence, [8] * 5)
    assert run(cadence, [16] * 5) == [True, True, True, False, False]
    cadence.changed()  # an OOM, a relief, the room measured again
    assert run(cadence, [16] * 4) == [True, True, True, False]


def test_near_the_cap_every_batch_is_measured():
    cadence = MeasureCadence(every=100, settle=0, interval=NEVER)
    assert run(cadence, [8] * 4, demand=0.85) == [True] * 4  # the first, then each one after a near one
    cadence = MeasureCadence(every=100, settle=0, interval=NEVER)
    assert run(cadence, [8] * 4, demand=0.5) == [True, False, False, False]


def test_slow_batches_are_measured_every_time():
    cadence = MeasureCadence(every=100, settle=0, interval=0.001)
    measured = []
    for _ in range(3):
        due = cadence.due(8)
        cadence.done(due, 0.1 if due else None)
        time.sleep(0.002)  # a batch longer than the interval
        measured.append(due)
    assert measured == [True, True, True]


def test_bad_settings_are_named():
    with pytest.raises(ValueError, match="every"):
        MeasureCadence(every=0)
    with pytest.raises(ValueError, match="interval"):
        MeasureCadence(interval=-1)


class Counts:
    name = "counts"
    events = frozenset({Event.BATCH_END, Event.BATCH_MEASURED})

    def __init__(self):
        self.seen = {Event.BATCH_END: [], Event.BATCH_MEASURED: []}

    def decide(self, event, snap):
        self.seen[event].append(snap.step)
        return []

    def state_dict(self):
        return {}

    def load_state_dict(self, state):
        return None


def test_the_tuner_fires_batch_end_every_batch_and_batch_measured_on_the_measured(tmp_path):
    torch.manual_seed(0)
    counts = Counts()
    with Tuner(nn.Linear(8, 2), loss_fn=nn.functional.cross_entropy, device="cpu", policies=[counts],
               monitor=False, run_dir=tmp_path) as tuner:
        tuner.batches.cadence = MeasureCadence(every=5, settle=2, interval=NEVER)  # where it decides
        x, y = torch.randn(16, 8), torch.randint(0, 2, (16,))
        for _ in range(12):
            tuner.step((x, y))
    assert counts.seen[Event.BATCH_END] == list(range(1, 13))
    assert counts.seen[Event.BATCH_MEASURED] == [1, 2, 7, 12]  # the start settles, then one in five
