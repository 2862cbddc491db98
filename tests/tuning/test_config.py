"""autotune/tuning/config.py: what a user's arguments resolve to."""

import pytest
import torch

from autotune.tuning.config import resolve_device


@pytest.fixture
def two_cuda_devices_current_1(monkeypatch):
    # This machine has no CUDA: a scripted stand-in for torch.cuda's three answers resolve_device reads.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)


@pytest.mark.parametrize("asked", ["cuda", torch.device("cuda"), None])
def test_cuda_without_an_index_resolves_to_the_current_device(two_cuda_devices_current_1, asked):
    # torch.cuda.set_per_process_memory_fraction(f, torch.device("cuda")) raises on torch 2.11+
    # (found on an H200): every CUDA device autotune hands on carries its index.
    assert resolve_device(asked) == torch.device("cuda", 1)


def test_cuda_with_an_index_is_kept_and_checked(two_cuda_devices_current_1):
    assert resolve_device("cuda:0") == torch.device("cuda", 0)
    with pytest.raises(ValueError, match="only 2 CUDA device"):
        resolve_device("cuda:2")


def test_cpu_stays_cpu():
    assert resolve_device("cpu") == torch.device("cpu")
