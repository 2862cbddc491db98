"""The job's strategy (job.py): Solo, Replicated and Sharded each answer all of the Protocol, with
the Protocol's parameters, so the loop can call the one in use without asking which it is."""

import inspect

import pytest

from autotune.ranks.distributed import Replicated, Solo
from autotune.ranks.job import Job
from autotune.ranks.sharded import Sharded


def _members(cls):
    annotated = set(getattr(cls, "__annotations__", {}))
    methods = {name for name, value in vars(cls).items() if callable(value) and not name.startswith("_")}
    return annotated, methods


@pytest.mark.parametrize("strategy", [Solo, Replicated, Sharded])
def test_each_strategy_answers_the_whole_protocol(strategy):
    attributes, methods = _members(Job)
    assert len(attributes) >= 6 and len(methods) >= 9  # the Protocol is read at all
    missing = [name for name in attributes | methods if not hasattr(strategy, name)]
    assert missing == [], (strategy.__name__, missing)
    for name in methods:
        wanted = list(inspect.signature(getattr(Job, name)).parameters)[1:]
        got = inspect.signature(getattr(strategy, name))
        params = [p for p in got.parameters if p != "self"]
        assert len(params) == len(wanted), (strategy.__name__, name, params, wanted)


def test_alone_the_process_is_its_own_strategy():
    solo = Solo()
    assert solo.job is solo
