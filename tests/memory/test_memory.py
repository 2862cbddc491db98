"""memory/figures.py: autotune's own threads under an address-space cap, and the allocator's figures read by name."""

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch


MiB = 1 << 20

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self")


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
        from autotune.memory.limits import cap_address_space

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


# A scripted allocator (tests/fake_cuda.py).
CUDA = torch.device("cuda", 0)


def test_an_allocator_figure_torch_does_not_give_is_an_error_that_names_it(monkeypatch):
    from autotune.memory.figures import allocator_stats
    from tests.fake_cuda import FakeAllocator

    gpu = FakeAllocator(empty=True).install(monkeypatch)
    assert allocator_stats(CUDA).num_ooms == 0  # nothing allocated yet: every figure is 0
    gpu.empty, gpu.missing = False, ("num_alloc_retries",)
    with pytest.raises(RuntimeError, match="has no 'num_alloc_retries'"):
        allocator_stats(CUDA)
