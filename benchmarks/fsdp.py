"""Two-rank AutoTrainer on FSDP2 vs a hand-written two-rank FSDP2 loop (gloo, CPU): the same
transformer sharded per block then at the root, the same data, per-rank batch, sample order and
optimizer; alternating rounds inside one torchrun job. Also what autotune's checks cost: the
checks a step makes (one before every FSDP2 all-gather and reduce-scatter, one at the end of
the attempt, one for the micro-batch) times the median time of one check measured alone. And
what a checkpoint of the sharded model costs: every rank writing its shards with
torch.distributed.checkpoint (autotune's), against gathering the whole state to rank 0 and
writing one file.

    python benchmarks/fsdp.py [--rounds 5]       # launches torchrun with 2 processes itself
"""

from __future__ import annotations

import copy
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
from common import alternate, fresh_run_dir, median, two_ranks, write_results  # noqa: E402

SAMPLES, VOCAB, WIDTH, LENGTH, BLOCKS, BATCH = 1024, 256, 128, 32, 4, 16


def worker(rounds: int, out: str) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.fsdp import fully_shard
    from torch.utils.data import DataLoader, TensorDataset

    from autotune import AutoTrainer
    from autotune.data.sampler import EpochSampler
    from autotune.ranks.sharded import ShardedSteps

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, VOCAB, (SAMPLES, LENGTH + 1), generator=g)
    data = TensorDataset(tokens[:, :-1], tokens[:, 1:])

    def model() -> nn.Module:
        torch.manual_seed(0)
        layer = nn.TransformerEncoderLayer(WIDTH, 4, 4 * WIDTH, dropout=0.0, batch_first=True, norm_first=True)
        return nn.Sequential(nn.Embedding(VOCAB, WIDTH), *[copy.deepcopy(layer) for _ in range(BLOCKS)],
                             nn.LayerNorm(WIDTH), nn.Linear(WIDTH, VOCAB))

    def loss_fn(logits, targets):
        return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())

    def steady(stamps: list[float]) -> float:
        # the median time between consecutive steps after the first five: the per-step cost,
        # without once-per-fit costs (the monitor's start-up, the end-of-fit checkpoint)
        return statistics.median(b - a for a, b in zip(stamps[5:], stamps[6:]))

    def sharded_model() -> nn.Module:
        net = model()
        for block in net[1:1 + BLOCKS]:
            fully_shard(block)
        fully_shard(net)
        return net

    def plain(checked: bool = False) -> tuple[float, float]:
        net = sharded_model()
        # checked: autotune's checks alone, in the hand-written loop (one before each exchange, one after backward)
        checks = ShardedSteps(net) if checked else None
        optimizer = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
        loader = DataLoader(data, batch_size=BATCH, sampler=EpochSampler(SAMPLES, seed=0, rank=rank, world=world))
        stamps = []
        dist.barrier()
        start = time.perf_counter()
        for x, y in loader:
            stamps.append(time.perf_counter())
            loss_fn(net(x), y).backward()
            if checks is not None:
                checks.check(False)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        dist.barrier()
        return time.perf_counter() - start, steady(stamps)

    checks_per_step: list[float] = []

    def auto() -> tuple[float, float]:
        stamps = []

        def step(net, batch):
            stamps.append(time.perf_counter())
            return loss_fn(net(batch[0]), batch[1])

        run_dir = fresh_run_dir(f"runs/bench-fsdp/round-{len(checks_per_step)}", rank)  # a new run each round
        dist.barrier()
        trainer = AutoTrainer(model(), data, step_fn=step, batch_size=BATCH, device="cpu", shard=True,
                              optimizer=lambda p: torch.optim.SGD(p, lr=0.01, momentum=0.9), progress=False,
                              run_dir=run_dir, checkpoint_interval=None)
        dist.barrier()
        start = time.perf_counter()
        trainer.fit(epochs=1)
        dist.barrier()
        wall = time.perf_counter() - start
        # + 1: the micro-batch every rank takes from rank 0 before each attempt (same_size)
        checks_per_step.append(trainer.ranks.sharded.checks / trainer.step + 1)
        trainer.close()
        return wall, steady(stamps)

    def one_check() -> float:
        # What one check costs alone: a one-number all-reduce on a gloo group of its own.
        group = dist.new_group(backend="gloo")
        flag = torch.zeros(1, dtype=torch.int64)
        times = []
        for _ in range(200):
            start = time.perf_counter()
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
            flag.item()
            times.append(time.perf_counter() - start)
        return statistics.median(times[20:])

    def checkpoint_seconds() -> dict[str, float]:
        # One checkpoint of the model and its optimizer state, five times each way, alternating.
        from autotune.run_folder.checkpoint_files import Checkpoints
        from autotune.ranks.sharded import full_state, sharded_state

        net = sharded_model()
        optimizer = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
        x, y = data[:BATCH]
        loss_fn(net(x), y).backward()
        optimizer.step()  # the momentum buffers exist
        store = Checkpoints(Path("runs/bench-fsdp/checkpoints"), keep=1)
        took: dict[str, list[float]] = {"sharded": [], "gathered": []}
        for i in range(5):
            dist.barrier()
            start = time.perf_counter()
            weights, optimizer_state = sharded_state(net, optimizer)
            store.save_sharded({"model": weights, "optimizer": optimizer_state}, 2 * i, rank == 0)
            dist.barrier()
            took["sharded"].append(time.perf_counter() - start)
            start = time.perf_counter()
            weights, optimizer_state = full_state(net, optimizer)
            if rank == 0:
                store.save({"model": weights, "optimizer": optimizer_state}, 2 * i + 1)
            dist.barrier()
            took["gathered"].append(time.perf_counter() - start)
        return {way: statistics.median(seconds) for way, seconds in took.items()}

    times: dict[str, Any] = alternate(rounds, ("plain", plain), ("checked", lambda: plain(checked=True)),
                                      ("autotune", auto))
    times["checkpoint_seconds"] = checkpoint_seconds()
    times["check_seconds"] = one_check()
    times["checks_per_step"] = statistics.median(checks_per_step)
    if rank == 0:
        Path(out).write_text(json.dumps(times))
    dist.destroy_process_group()


def main() -> None:
    launched = two_ranks(__file__, worker, rounds=5, out="runs/bench-fsdp/times.json")
    if launched is None:  # this process was a rank
        return
    rounds, times = launched
    plain, checked, auto = (median([t[0] for t in times[name]]) for name in ("plain", "checked", "autotune"))
    plain_step, checked_step, auto_step = (median([t[1] for t in times[name]])
                                           for name in ("plain", "checked", "autotune"))
    check, checks = times["check_seconds"], times["checks_per_step"]
    lines = [
        f"Transformer: embedding {VOCAB}x{WIDTH}, {BLOCKS} pre-norm encoder layers of width {WIDTH} (4 heads), "
        f"head; sequences of {LENGTH} tokens; SGD+momentum; {SAMPLES} sequences (one epoch), {BATCH} per rank; "
        f"`fully_shard` per layer, then the root; 2 ranks (gloo, one thread each), {rounds} alternating rounds "
        "in one torchrun job.", "",
        "| loop | median epoch (s) | ratio | median step (ms) | ratio |", "| --- | --- | --- | --- | --- |",
        f"| hand-written FSDP2 | {plain:.3f} | 1.000 | {plain_step * 1e3:.2f} | 1.000 |",
        f"| the same with autotune's checks only (ShardedSteps on the model) | {checked:.3f} | {checked / plain:.3f} | "
        f"{checked_step * 1e3:.2f} | {checked_step / plain_step:.3f} |",
        f"| AutoTrainer(shard=True) (a check before each exchange) | {auto:.3f} | {auto / plain:.3f} | "
        f"{auto_step * 1e3:.2f} | {auto_step / plain_step:.3f} |",
        "",
        f"The agreement's cost: {checks:.1f} checks a step x {check * 1e6:.0f} us a check (median, measured alone) = "
        f"{checks * check * 1e3:.2f} ms a step, {checks * check / plain_step:.1%} of the hand-written step.", "",
        "The epoch includes AutoTrainer's once-per-fit costs (monitor start-up on rank 0, the end-of-fit checkpoint, "
        "every rank writing its shards); the step column is the median interval between steps.", "",
        "A checkpoint of this model and its optimizer state (median of 5): every rank writing its shards with "
        f"torch.distributed.checkpoint (autotune's) {times['checkpoint_seconds']['sharded'] * 1e3:.0f} ms; the whole "
        f"state gathered to rank 0 and written as one file {times['checkpoint_seconds']['gathered'] * 1e3:.0f} ms "
        "(and rank 0 holding all of it in host memory).", "",
        "Per-round step ratios to the hand-written loop, AutoTrainer: "
        + ", ".join(f"{a[1] / p[1]:.3f}" for a, p in zip(times["autotune"], times["plain"]))
        + "; checks only: " + ", ".join(f"{c[1] / p[1]:.3f}" for c, p in zip(times["checked"], times["plain"])),
    ]
    write_results("fsdp", "Two ranks: AutoTrainer on FSDP2 vs hand-written FSDP2 (CPU, gloo)", lines)


if __name__ == "__main__":
    main()
