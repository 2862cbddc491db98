"""Two-rank AutoTrainer vs a hand-written two-rank DDP loop (gloo, CPU), same model, data,
per-rank batch and sample order; alternating rounds inside one torchrun job.

    python benchmarks/ddp.py [--rounds 7]        # launches torchrun with 2 processes itself
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

SAMPLES, FEATURES, WIDTH, CLASSES, BATCH = 16384, 256, 1024, 10, 128


def worker(rounds: int, out: str) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.data import DataLoader, TensorDataset

    from autotune import AutoTrainer
    from autotune.data.sampler import EpochSampler

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(SAMPLES, FEATURES, generator=g), torch.randint(0, CLASSES, (SAMPLES,), generator=g))

    def model():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(FEATURES, WIDTH), nn.ReLU(), nn.Linear(WIDTH, WIDTH), nn.ReLU(), nn.Linear(WIDTH, CLASSES))

    def plain() -> float:
        ddp = DistributedDataParallel(model())
        optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9)
        loader = DataLoader(data, batch_size=BATCH, sampler=EpochSampler(SAMPLES, seed=0, rank=rank, world=world))
        dist.barrier()
        start = time.perf_counter()
        for x, y in loader:
            nn.functional.cross_entropy(ddp(x), y).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        dist.barrier()
        return time.perf_counter() - start

    def auto() -> float:
        trainer = AutoTrainer(model(), data, loss_fn=nn.functional.cross_entropy, batch_size=BATCH, device="cpu",
                              optimizer=lambda p: torch.optim.SGD(p, lr=0.01, momentum=0.9), progress=False,
                              run_dir="runs/bench-ddp", checkpoint_interval=None)
        dist.barrier()
        start = time.perf_counter()
        trainer.fit(epochs=1)
        dist.barrier()
        return time.perf_counter() - start

    plain(), auto()  # warm-up
    times = {"plain": [], "autotune": []}
    for r in range(rounds):
        for name, fn in ((("plain", plain), ("autotune", auto)) if r % 2 == 0 else (("autotune", auto), ("plain", plain))):
            times[name].append(fn())
    if rank == 0:
        Path(out).write_text(json.dumps(times))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", default="runs/bench-ddp/times.json", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.rounds, args.out)
        return
    sys.path.insert(0, str(Path(__file__).parent))
    from common import median, write_results

    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
                    "--master-port", str(port), __file__, "--worker", "--rounds", str(args.rounds), "--out", args.out],
                   check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    times = json.loads(Path(args.out).read_text())
    plain, auto = median(times["plain"]), median(times["autotune"])
    lines = [
        f"MLP {FEATURES}-{WIDTH}-{WIDTH}-{CLASSES}, SGD+momentum, {SAMPLES} samples (one epoch), {BATCH} per rank, "
        f"2 ranks (gloo, one thread each), {args.rounds} alternating rounds in one torchrun job.", "",
        "| loop | median epoch (s) | ratio |", "| --- | --- | --- |",
        f"| hand-written DDP | {plain:.3f} | 1.000 |",
        f"| AutoTrainer (agreement, then one flat all-reduce) | {auto:.3f} | {auto / plain:.3f} |",
        "", "Per-round ratios: " + ", ".join(f"{a / p:.3f}" for a, p in zip(times["autotune"], times["plain"])),
    ]
    write_results("ddp", "Two ranks: AutoTrainer vs hand-written DDP (CPU, gloo)", lines)


if __name__ == "__main__":
    main()
