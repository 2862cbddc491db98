"""The parts of an OOM's breakdown, on real tensors, and how the report shows them."""

import json

import torch
from torch import nn

from autotune.memory.breakdown import library_bytes, model_bytes, oom_breakdown, optimizer_bytes, tensor_bytes
from autotune.common.units import describe_breakdown
from autotune.observe.report import render, summarize

CPU = torch.device("cpu")


def test_shared_storages_count_once():
    base = torch.zeros(1000)
    assert tensor_bytes([base, base[:10], base.view(10, 100), torch.zeros(5)], CPU) == 4000 + 20


def test_weights_gradients_and_adam_state():
    model = nn.Linear(100, 10)  # 1010 parameters
    optimizer = torch.optim.AdamW(model.parameters())
    assert model_bytes(model, CPU) == (1010 * 4, 0) and optimizer_bytes(optimizer, CPU) == 0
    model(torch.randn(3, 100)).sum().backward()
    optimizer.step()
    assert model_bytes(model, CPU) == (1010 * 4, 1010 * 4)
    # two moments per parameter, and a 0-d step counter per tensor
    assert 2 * 1010 * 4 <= optimizer_bytes(optimizer, CPU) <= 2 * 1010 * 4 + 2 * 8


def test_the_parts_add_up_to_what_was_held():
    model = nn.Linear(100, 10)
    parts = oom_breakdown(model, None, CPU, held_at_start=10 * 2**30, held_at_failure=11 * 2**30,
                          gradients_at_failure=4040, cap=12 * 2**30, measure="virtual")
    names = ("weights", "gradients", "optimizer_state", "activations_and_temporaries", "libraries", "other")
    assert sum(parts[n] for n in names) == parts["held"] == 11 * 2**30
    assert parts["activations_and_temporaries"] == 2**30 - 4040 and parts["libraries"] == library_bytes(True) > 0
    assert oom_breakdown(model, None, CPU, held_at_start=None, held_at_failure=1, gradients_at_failure=0,
                         cap=None, measure="virtual") is None
    assert describe_breakdown(parts).startswith("held 11.0 GiB of a 12.0 GiB cap (virtual): ")


def test_the_report_shows_the_last_oom_breakdown(tmp_path):
    parts = {"measure": "cuda", "weights": 2**30, "gradients": 2**30, "optimizer_state": 2**31,
             "activations_and_temporaries": 3 * 2**30, "libraries": None, "other": 2**29, "held": 7.5 * 2**30,
             "cap": 8 * 2**30}
    records = [{"time": 0.0, "kind": "fit_start", "step": 0, "epoch": 0, "micro_batch_size": 64, "batch_size": 64},
               {"time": 1.0, "kind": "oom", "step": 3, "epoch": 0, "micro_batch_size": 64, "message": "CUDA out of memory",
                "lost_seconds": 0.1, "breakdown": parts},
               {"time": 2.0, "kind": "fit_end", "step": 10, "epoch": 1, "micro_batch_size": 32, "samples_seen": 640}]
    (tmp_path / "events.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    summary = summarize(tmp_path)
    assert summary["ooms"]["last_breakdown"] == parts
    assert ("at the last OOM: held 7.5 GiB of a 8.0 GiB cap (cuda): activations and temporaries 3.0 GiB, "
            "optimizer state 2.0 GiB") in render(summary)


def test_on_cuda_the_allocator_cache_and_what_is_outside_torch_stand_beside_the_parts():
    # The figures a CUDA run reads (scripted here: the real ones are in tests/test_trainer_gpu.py).
    parts = {"measure": "cuda", "weights": 2**30, "gradients": 2**30, "optimizer_state": 2 * 2**30,
             "activations_and_temporaries": 3 * 2**30, "libraries": None, "other": 0, "held": 7 * 2**30,
             "cap": 8 * 2**30, "allocator_cache": 512 * 2**20, "outside_torch": 600 * 2**20}
    assert describe_breakdown(parts).endswith(
        "; allocator cache beside it 512.0 MiB; outside torch on the device 600.0 MiB")
    assert "allocator_cache" not in oom_breakdown(nn.Linear(4, 2), None, CPU, held_at_start=1, held_at_failure=2,
                                                  gradients_at_failure=0, cap=None, measure="virtual")
