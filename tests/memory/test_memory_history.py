"""memory_snapshot=True: the largest allocation sites of an allocator snapshot, and CPU's clear error.
The snapshot itself needs CUDA (tests/test_trainer_gpu.py); here it is a scripted dict of the same shape."""

import os

import pytest
import torch
from torch import nn

from autotune import AutoTrainer, Tuner
from autotune.memory.history import largest_sites, refused, site

TORCH = os.path.dirname(torch.__file__)


def frame(filename, line, name):
    return {"filename": filename, "line": line, "name": name}


def block(size, state, *frames):
    return {"size": size, "requested_size": size, "state": state, "frames": list(frames)}


def test_the_largest_sites_are_the_innermost_frames_outside_torch_summed():
    forward = frame("/home/me/model.py", 12, "forward")
    inside = frame(f"{TORCH}/nn/modules/linear.py", 125, "forward")
    step = frame("/site-packages/autotune/step/core.py", 290, "optimizer_step")
    snapshot = {"segments": [
        {"blocks": [block(300, "active_allocated", inside, forward), block(200, "active_allocated", forward),
                    block(900, "inactive", forward)]},  # cached, no tensor: not a site's
        {"blocks": [block(400, "active_allocated", frame(f"{TORCH}/optim/adamw.py", 80, "step"), step),
                    block(50, "active_allocated")]},
    ]}
    assert largest_sites(snapshot) == [
        {"site": "/home/me/model.py:12 in forward", "bytes": 500},
        {"site": "/site-packages/autotune/step/core.py:290 in optimizer_step", "bytes": 400},
        {"site": "no Python stack (autograd's backward thread, or C++)", "bytes": 50},
    ]
    assert site([inside]) == f"{TORCH}/nn/modules/linear.py:125 in forward"  # only torch: its innermost
    snapshot["device_traces"] = [[{"action": "alloc", "size": 8, "frames": [forward]},
                                  {"action": "oom", "size": 4096, "frames": [inside, forward]},
                                  {"action": "free_requested", "size": 8, "frames": []}]]
    assert refused(snapshot) == {"site": "/home/me/model.py:12 in forward", "bytes": 4096}
    assert refused({"segments": []}) is None


def test_memory_snapshot_on_cpu_is_a_clear_error_before_any_file(tmp_path):
    data = torch.utils.data.TensorDataset(torch.randn(8, 4), torch.randint(0, 2, (8,)))
    with pytest.raises(ValueError, match="memory_snapshot=True needs a CUDA device.*cpu"):
        AutoTrainer(nn.Linear(4, 2), data, loss_fn=nn.functional.cross_entropy, device="cpu", run_dir=tmp_path / "a",
                    memory_snapshot=True)
    with pytest.raises(ValueError, match="memory_snapshot"):
        Tuner(nn.Linear(4, 2), device="cpu", run_dir=tmp_path / "b", memory_snapshot=0)
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
