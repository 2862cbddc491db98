"""Overhead of AutoTrainer (default preset) against a hand-written PyTorch loop.

Same model, data, batch, optimizer and sample order on CPU; the two are run alternately
in one process so machine noise hits both alike. Reports the median run time of each
and their ratio (target <= 1.03).

    python benchmarks/overhead.py [--rounds 9] [--epochs 2]

With tensorboard installed, also AutoTrainer(tensorboard=True), which in runs this short
writes every step (the first 200 steps of any run are; then at most one a second).
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
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

SAMPLES, FEATURES, CLASSES, BATCH = 8192, 784, 10, 128


def make_data() -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(SAMPLES, FEATURES, generator=g), torch.randint(0, CLASSES, (SAMPLES,), generator=g))


def make_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(FEATURES, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, CLASSES))


def steady(stamps: list[float]) -> float:
    """Median interval between consecutive steps after the first ten: the per-step cost,
    without once-per-fit costs (the monitor's start-up, the end-of-fit checkpoint)."""
    return statistics.median(b - a for a, b in zip(stamps[10:], stamps[11:]))


def plain_run(data, epochs):
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sampler = EpochSampler(len(data), shuffle=True, seed=0)
    loader = DataLoader(data, batch_size=BATCH, sampler=sampler)
    stamps = []
    start = time.perf_counter()
    model.train()
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        for x, y in loader:
            stamps.append(time.perf_counter())
            loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    return time.perf_counter() - start, steady(stamps), model


def autotune_run(data, epochs, progress, run_dir, tensorboard=False):
    model = make_model()
    stamps = []

    def step(model, batch):
        stamps.append(time.perf_counter())
        return nn.functional.cross_entropy(model(batch[0]), batch[1])

    trainer = AutoTrainer(model, data, step_fn=step,
                          optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3), batch_size=BATCH, device="cpu",
                          policies="default", progress=progress, run_dir=run_dir, tensorboard=tensorboard)
    start = time.perf_counter()
    trainer.fit(epochs=epochs)
    return time.perf_counter() - start, steady(stamps), model


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--epochs", type=int, default=2)
    args = parser.parse_args()
    data = make_data()
    run_dir = Path("runs/bench-overhead")
    loops = {
        "plain": lambda r: plain_run(data, args.epochs),
        "autotune": lambda r: autotune_run(data, args.epochs, False, run_dir / f"a{r}"),
        "autotune+bar": lambda r: autotune_run(data, args.epochs, True, run_dir / f"b{r}"),
    }
    if importlib.util.find_spec("tensorboard"):  # every step is written: a run has fewer than 200
        loops["autotune+tensorboard"] = lambda r: autotune_run(data, args.epochs, False, run_dir / f"t{r}", True)
    for loop in loops.values():  # warm-up: first-touch allocations, thread pools
        loop("warm")
    times = {name: [] for name in loops}
    steps = {name: [] for name in loops}
    names = list(loops)
    for r in range(args.rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:  # rotate the order so no loop always goes first
            wall, step, _ = loops[name](r)
            times[name].append(wall)
            steps[name].append(step)
        print(f"round {r}: " + ", ".join(f"{k} {v[-1]:.3f}s" for k, v in times.items()), file=sys.stderr)
    # Same weights, as a check that both loops did the same work.
    a = plain_run(data, args.epochs)[-1]
    b = autotune_run(data, args.epochs, False, run_dir / "check")[-1]
    same = all(torch.allclose(p, q) for p, q in zip(a.parameters(), b.parameters()))
    base = median(times["plain"])
    lines = [
        f"MLP {FEATURES}-1024-1024-{CLASSES}, AdamW, {SAMPLES} samples, batch {BATCH}, {args.epochs} epochs per run, "
        f"{args.rounds} rounds alternating; same final weights: {same}.", "",
        "| loop | median run (s) | ratio to plain | median step (ms) | ratio to plain |",
        "| --- | --- | --- | --- | --- |",
    ]
    base_step = median(steps["plain"])
    for name, values in times.items():
        lines.append(f"| {name} | {median(values):.3f} | {median(values) / base:.3f} | "
                     f"{median(steps[name]) * 1e3:.2f} | {median(steps[name]) / base_step:.3f} |")
    lines += ["", "A run includes AutoTrainer's once-per-fit costs: the monitor process's start-up (~0.13 s of a "
              "core) and the end-of-fit checkpoint; the step columns are the median interval between steps."]
    lines += ["", "Per-round ratios (autotune / plain): "
              + ", ".join(f"{a / p:.3f}" for a, p in zip(times["autotune"], times["plain"]))]
    write_results("overhead", "Overhead: AutoTrainer vs a hand-written loop (CPU)", lines)


if __name__ == "__main__":
    main()
