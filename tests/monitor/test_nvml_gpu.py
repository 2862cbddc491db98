"""CUDA only (run by `make gpu-check`): NVML's figures against CUDA's own, and the
monitor process seeing allocations and empty_cache on a real GPU."""

import time

import pytest
import torch

from autotune.memory.figures import cuda_uuid
from autotune.monitor.nvml import NVML
from autotune.monitor.process import MonitorProcess

pytestmark = pytest.mark.gpu
GIB = 2**30


def test_nvml_agrees_with_cuda_mem_get_info():
    device = torch.device("cuda:0")
    torch.cuda.mem_get_info(device)  # makes this process's CUDA context (~0.5 GiB on an H200) before either reading
    memory = NVML().memory(cuda_uuid(device))
    free, total = torch.cuda.mem_get_info(device)
    # NVML's v2 total includes what the driver reserves; CUDA's does not. Other processes
    # may allocate between the two calls: 256 MiB of slack on free.
    assert memory is not None
    assert abs(memory.free_bytes - free) <= 256 * 2**20, (memory, free)
    assert abs(memory.total_bytes - (memory.reserved_bytes or 0) - total) <= GIB, (memory, total)


def test_the_monitor_sees_an_allocation_and_empty_cache(tmp_path):
    device = torch.device("cuda:0")
    torch.cuda.init()
    monitor = MonitorProcess(tmp_path, interval=0.05, gpu_uuid=cuda_uuid(device))
    monitor.start()

    def settled_used():
        time.sleep(0.5)  # several intervals
        latest = None
        for _ in range(50):
            got = monitor.latest()
            latest = got or latest
            if got is None and latest is not None:
                break
            time.sleep(0.02)
        return latest[0].used_bytes

    try:
        before = settled_used()
        block = torch.empty(2 * GIB, dtype=torch.uint8, device=device)
        block.fill_(1)
        torch.cuda.synchronize()
        with_block = settled_used()
        assert with_block - before >= 1.8 * GIB
        del block
        cached = settled_used()  # the caching allocator keeps it: NVML still counts it
        assert cached - before >= 1.8 * GIB
        torch.cuda.empty_cache()
        after = settled_used()
        assert cached - after >= 1.8 * GIB
    finally:
        monitor.stop()


def test_this_processs_bytes_are_known_or_unknown_never_zero():
    # In a container NVML lists the host's PIDs: the trainer's own is then unknown (None), not 0.
    import os

    from autotune.monitor.process import MonitorConfig, Sampler

    device = torch.device("cuda:0")
    block = torch.empty(GIB, dtype=torch.uint8, device=device)
    torch.cuda.synchronize()
    time.sleep(0.2)
    sampler = Sampler(MonitorConfig(pid=os.getpid(), board="unused", samples_path=None, gpu_uuid=cuda_uuid(device)))
    mine = sampler.read_process()
    assert mine is None or mine >= GIB, mine
    del block
