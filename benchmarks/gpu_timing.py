"""A short GPU timing for `make gpu-check`: AutoTrainer vs a plain loop on CUDA, and the
cost of recovering from a real CUDA OOM under `set_per_process_memory_fraction`.

    python benchmarks/gpu_timing.py [--rounds 5]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).parent))
from common import median, write_results  # noqa: E402

from autotune import AutoTrainer  # noqa: E402
from autotune.data.sampler import EpochSampler  # noqa: E402

SAMPLES, FEATURES, WIDTH, CLASSES, BATCH = 65536, 512, 8192, 16, 4096


def make_model(device):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(FEATURES, WIDTH), nn.ReLU(), nn.Linear(WIDTH, WIDTH), nn.ReLU(),
                         nn.Linear(WIDTH, CLASSES)).to(device)


def plain(data, device):
    model = make_model(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    loader = DataLoader(data, batch_size=BATCH, sampler=EpochSampler(len(data), seed=0), pin_memory=True)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    return time.perf_counter() - start, 0, BATCH


def auto(data, device, micro=None, cap_bytes=None):
    model = make_model(device)
    trainer = AutoTrainer(model, data, loss_fn=nn.functional.cross_entropy,
                          optimizer=lambda p: torch.optim.AdamW(p, lr=1e-4), batch_size=BATCH,
                          micro_batch_size=micro, device=device, progress=False, run_dir="runs/bench-gpu")
    total = torch.cuda.get_device_properties(device).total_memory
    if cap_bytes:
        torch.cuda.empty_cache()
        torch.cuda.set_per_process_memory_fraction((torch.cuda.memory_allocated(device) + cap_bytes) / total, device)
    torch.cuda.synchronize()
    start = time.perf_counter()
    try:
        result = trainer.fit(epochs=1)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, device)
    torch.cuda.synchronize()
    return time.perf_counter() - start, result.ooms, result.micro_batch_size


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    device = torch.device("cuda", torch.cuda.current_device())  # set_per_process_memory_fraction wants an index
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(SAMPLES, FEATURES, generator=g), torch.randint(0, CLASSES, (SAMPLES,), generator=g))
    plain(data, device)
    auto(data, device)
    rows = {"plain": [], "autotune": [], "autotune, capped (OOMs)": []}
    extra = {}
    for _ in range(args.rounds):
        rows["plain"].append(plain(data, device)[0])
        rows["autotune"].append(auto(data, device)[0])
        seconds, ooms, micro = auto(data, device, cap_bytes=2 * 2**30)
        rows["autotune, capped (OOMs)"].append(seconds)
        extra = {"ooms": ooms, "micro": micro}
    base = median(rows["plain"])
    lines = [f"{torch.cuda.get_device_name(device)}; MLP {FEATURES}-{WIDTH}-{WIDTH}-{CLASSES}, AdamW, "
             f"{SAMPLES} samples, batch {BATCH}, {args.rounds} rounds. Capped run: 2 GiB over the weights via "
             f"set_per_process_memory_fraction, {extra.get('ooms')} OOMs, final micro-batch {extra.get('micro')}.", "",
             "| loop | median epoch (s) | ratio to plain |", "| --- | --- | --- |"]
    lines += [f"| {k} | {median(v):.3f} | {median(v) / base:.3f} |" for k, v in rows.items()]
    write_results("gpu_timing", "GPU timing: AutoTrainer vs a plain loop (CUDA)", lines)


if __name__ == "__main__":
    main()
