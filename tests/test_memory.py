"""A step's need in the measure the cap binds, also for a step measured after unmeasured ones."""

import sys

import pytest
import torch

from autotune.memory import StepDemand
from tests.conftest import run_python

MiB = 1 << 20

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self")


def touched(mib):
    return torch.ones(mib * MiB // 4)  # written: resident, not just mapped


def test_a_step_after_unmeasured_ones_measures_its_own_need_against_the_room_left():
    demand = StepDemand(torch.device("cpu"), cap_bytes=64 * 1024 * MiB)  # a soft cap: the resident size
    demand.measure_room()
    demand.start(8)
    step = touched(64)
    del step
    demand.finish()
    first = demand.last_memory
    assert first.exact and 60 * MiB <= first.need_bytes <= 80 * MiB
    kept = touched(100)  # unmeasured steps in between keep 100 MiB (a cache, say)
    demand.start(8, rebase=True)
    step = touched(64)
    del step
    demand.finish()
    second = demand.last_memory
    # Its own 64 MiB, not the 100 MiB kept before it began; and 100 MiB less room.
    assert 60 * MiB <= second.need_bytes <= 80 * MiB
    assert 90 * MiB <= first.room_bytes - second.room_bytes <= 110 * MiB
    del kept


def test_the_virtual_size_sampler_costs_little_address_space(tmp_path):
    # RLIMIT_AS counts a thread's whole stack reservation, and the sampler starts at a run's first
    # measured step, often under the cap: with the default 8 MiB stack a Lightning bf16 run needed
    # 24 MiB of headroom where plain Lightning needed 14 (issue 29).
    proc, result = run_python("""
        from autotune.memory import virtual_peak_sampler
        def virtual():
            return int(open("/proc/self/statm").read().split()[0]) * 4096
        before = virtual()
        sampler = virtual_peak_sampler()
        sampler.begin(); sampler.end()  # the thread has run
        save({"grew": virtual() - before, "started": sampler is not None})
    """, tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert result["started"] and result["grew"] < 2 * 2**20, result
