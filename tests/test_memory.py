"""A step's need in the measure the cap binds, also for a step measured after unmeasured ones."""

import json
import os
import subprocess
import sys
import textwrap

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


def test_autotunes_own_threads_take_little_of_an_address_space_cap(tmp_path):
    # Issue 34: under RLIMIT_AS, what AutoTrainer adds to the virtual size of a process that already ran
    # the same loop by hand. Each thread autotune starts (the step's virtual-peak sampler, the background
    # checkpoint writer) reserved its own 64 MiB malloc arena and an 8 MiB stack, all counted by the cap:
    # +72 MiB. Now one arena and small stacks. No MALLOC_ARENA_MAX here: glibc's default, as a user's.
    script = tmp_path / "own.py"
    script.write_text(textwrap.dedent("""
        import json, sys, threading, psutil, torch
        from torch import nn
        from torch.utils.data import DataLoader, TensorDataset
        from autotune import AutoTrainer
        from autotune.limits import cap_address_space

        process = psutil.Process()
        g = torch.Generator().manual_seed(0)
        data = TensorDataset(torch.randn(2048, 32, generator=g), torch.randint(0, 4, (2048,), generator=g))
        model = nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 4))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        for x, y in DataLoader(data, batch_size=64):  # the loop by hand first: its own imports and memory
            nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()
        base = process.memory_info().vms
        cap_address_space(1 << 30)  # a cap well above what the run needs: only what is reserved is measured
        sizes = []

        def step(model, batch):
            sizes.append(process.memory_info().vms)
            x, y = batch
            return nn.functional.cross_entropy(model(x), y)

        trainer = AutoTrainer(model, data, step_fn=step, batch_size=64, device="cpu", progress=False,
                              run_dir=sys.argv[1], checkpoint_every=8)  # background checkpoint writers
        trainer.fit(epochs=1)
        sizes.append(process.memory_info().vms)
        trainer.close()
        json.dump({"added_mib": (max(sizes) - base) / 2**20, "threads": [t.name for t in threading.enumerate()],
                   "steps_mib": [round((size - base) / 2**20, 1) for size in sizes]}, open(sys.argv[2], "w"))
    """))
    out = tmp_path / "out.json"
    env = {key: value for key, value in os.environ.items() if key != "MALLOC_ARENA_MAX"}
    proc = subprocess.run([sys.executable, str(script), str(tmp_path / "run"), str(out)], capture_output=True,
                          text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    added = result["added_mib"]
    assert added < 24, f"AutoTrainer added {added:.0f} MiB of address space: {result}"


# CUDA sizing in the unit a cap binds (issue 45), on a scripted allocator (tests/fake_cuda.py).
CUDA = torch.device("cuda", 0)


def test_under_a_per_process_fraction_the_room_is_the_fraction_of_reserved_bytes(monkeypatch):
    from tests.fake_cuda import MiB, FakeAllocator

    # memory_cap / set_per_process_memory_fraction: the allocator is refused past 2 GiB of its own
    # reserved bytes; the CUDA context and other processes' 500 MiB do not count against that.
    gpu = FakeAllocator(total=80 * 1024 * MiB, fraction=2 * 1024 / (80 * 1024), allocated=100 * MiB,
                        reserved=100 * MiB).install(monkeypatch)
    demand = StepDemand(CUDA, cap_bytes=2048 * MiB)
    demand.measure_room()
    assert demand.binding_cap == 2048 * MiB and demand.others_bytes == 500 * MiB
    demand.start(64)
    gpu.step(peak_live=1100 * MiB, reserved_peak=1100 * MiB)
    demand.finish()
    assert demand.last_memory.room_bytes == 1948 * MiB and demand.last_memory.need_bytes == 1000 * MiB
    # Without a fraction the device binds: what is free beside the context and the others.
    gpu.fraction = 1.0
    demand.measure_room()
    assert demand.binding_cap == 80 * 1024 * MiB - 500 * MiB


def test_a_steps_cuda_need_counts_what_the_allocator_wasted_not_what_it_had_cached(monkeypatch):
    from tests.fake_cuda import MiB, FakeAllocator

    gpu = FakeAllocator(allocated=100 * MiB, reserved=100 * MiB).install(monkeypatch)
    demand = StepDemand(CUDA, cap_bytes=None)
    demand.measure_room()
    demand.start(64)
    gpu.step(peak_live=600 * MiB, reserved_peak=700 * MiB)  # 100 MiB of fragments beside 500 live
    demand.finish()
    assert demand.last_memory.need_bytes == 600 * MiB
    # A smaller size next, in the cache the larger one left (700 MiB reserved): it reserves nothing
    # new, and its need is its live peak, not the cache's size.
    demand.start(32)
    gpu.step(peak_live=350 * MiB, reserved_peak=700 * MiB)
    demand.finish()
    assert demand.last_memory.need_bytes == 250 * MiB


def test_an_allocator_figure_torch_does_not_give_is_an_error_that_names_it(monkeypatch):
    from autotune.memory import allocator_stats
    from tests.fake_cuda import FakeAllocator

    gpu = FakeAllocator(empty=True).install(monkeypatch)
    assert allocator_stats(CUDA).num_ooms == 0  # nothing allocated yet: every figure is 0
    gpu.empty, gpu.missing = False, ("num_alloc_retries",)
    with pytest.raises(RuntimeError, match="has no 'num_alloc_retries'"):
        allocator_stats(CUDA)
