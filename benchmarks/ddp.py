"""Two-rank AutoTrainer vs a hand-written two-rank DDP loop (gloo, CPU), same model, data,
per-rank batch and sample order; alternating rounds inside one torchrun job.

    python benchmarks/ddp.py [--rounds 7]        # launches torchrun with 2 processes itself
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
from common import alternate, fresh_run_dir, median, two_ranks, write_results  # noqa: E402

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

    def steady(stamps: list[float]) -> float:
        # median time between consecutive steps after the first five: the per-step cost,
        # without the once-per-fit costs (monitor start-up, the end-of-fit checkpoint)
        gaps = sorted(b - a for a, b in zip(stamps[5:], stamps[6:]))
        return gaps[len(gaps) // 2]

    def plain() -> tuple[float, float]:
        ddp = DistributedDataParallel(model())
        optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9)
        loader = DataLoader(data, batch_size=BATCH, sampler=EpochSampler(SAMPLES, seed=0, rank=rank, world=world))
        stamps = []
        dist.barrier()
        start = time.perf_counter()
        for x, y in loader:
            stamps.append(time.perf_counter())
            nn.functional.cross_entropy(ddp(x), y).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        dist.barrier()
        return time.perf_counter() - start, steady(stamps)

    times_run: list[Path] = []

    def auto() -> tuple[float, float]:
        stamps = []

        def step(model, batch):
            stamps.append(time.perf_counter())
            return nn.functional.cross_entropy(model(batch[0]), batch[1])

        run_dir = fresh_run_dir(f"runs/bench-ddp/round-{len(times_run)}", rank)  # a new run each round
        times_run.append(run_dir)
        dist.barrier()
        trainer = AutoTrainer(model(), data, step_fn=step, batch_size=BATCH, device="cpu",
                              optimizer=lambda p: torch.optim.SGD(p, lr=0.01, momentum=0.9), progress=False,
                              run_dir=run_dir, checkpoint_interval=None)
        dist.barrier()
        start = time.perf_counter()
        trainer.fit(epochs=1)
        dist.barrier()
        return time.perf_counter() - start, steady(stamps)

    times: dict[str, Any] = alternate(rounds, ("plain", plain), ("autotune", auto))
    if rank == 0:
        Path(out).write_text(json.dumps(times))
    dist.destroy_process_group()


def main() -> None:
    launched = two_ranks(__file__, worker, rounds=7, out="runs/bench-ddp/times.json")
    if launched is None:  # this process was a rank
        return
    rounds, times = launched
    plain, auto = median([t[0] for t in times["plain"]]), median([t[0] for t in times["autotune"]])
    plain_step, auto_step = median([t[1] for t in times["plain"]]), median([t[1] for t in times["autotune"]])
    lines = [
        f"MLP {FEATURES}-{WIDTH}-{WIDTH}-{CLASSES}, SGD+momentum, {SAMPLES} samples (one epoch), {BATCH} per rank, "
        f"2 ranks (gloo, one thread each), {rounds} alternating rounds in one torchrun job.", "",
        "| loop | median epoch (s) | ratio | median step (ms) | ratio |", "| --- | --- | --- | --- | --- |",
        f"| hand-written DDP | {plain:.3f} | 1.000 | {plain_step * 1e3:.2f} | 1.000 |",
        f"| AutoTrainer (agreement, then one flat all-reduce) | {auto:.3f} | {auto / plain:.3f} | "
        f"{auto_step * 1e3:.2f} | {auto_step / plain_step:.3f} |",
        "", "The epoch includes AutoTrainer's once-per-fit costs (monitor start-up on rank 0, the end-of-fit "
        "checkpoint); the step column is the median interval between steps.", "",
        "Per-round epoch ratios: " + ", ".join(f"{a[0] / p[0]:.3f}" for a, p in zip(times["autotune"], times["plain"])),
    ]
    write_results("ddp", "Two ranks: AutoTrainer vs hand-written DDP (CPU, gloo)", lines)


if __name__ == "__main__":
    main()
