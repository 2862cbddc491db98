"""What checkpoints cost: one checkpoint's write time, the step-time ratio when writing one
every 50 steps (measured), and the ratio at the default interval of 900 s (derived from
the two measured figures).

    python benchmarks/checkpoint.py [--rounds 5]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch
import torchvision
from torch import nn
from torch.utils.data import TensorDataset

sys.path.insert(0, str(Path(__file__).parent))
from common import median, write_results  # noqa: E402

from autotune import AutoTrainer  # noqa: E402

SAMPLES, BATCH, EVERY = 1600, 16, 50


def run(data, every: int | None, run_dir: Path) -> float:
    torch.manual_seed(0)
    model = torchvision.models.resnet18(num_classes=10)
    trainer = AutoTrainer(model, data, loss_fn=nn.functional.cross_entropy, batch_size=BATCH, device="cpu", progress=False, monitor=False,
                          optimizer=lambda p: torch.optim.SGD(p, lr=0.01, momentum=0.9), run_dir=run_dir,
                          checkpoint_every=every, checkpoint_interval=None)
    return trainer.fit(epochs=1).wall_seconds


def checkpoint_seconds(run_dir: Path) -> list[float]:
    import json

    lines = (run_dir / "events.jsonl").read_text().splitlines()
    return [r["seconds"] for r in map(json.loads, lines) if r["kind"] == "checkpoint"]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(SAMPLES, 3, 32, 32, generator=g), torch.randint(0, 10, (SAMPLES,), generator=g))
    base = Path("runs/bench-checkpoint")
    run(data, None, base / "warm")
    with_ckpt, without = [], []
    writes: list[float] = []
    for r in range(args.rounds):
        for every in ((EVERY, None) if r % 2 == 0 else (None, EVERY)):
            wall = run(data, every, base / f"{r}-{every}")
            (with_ckpt if every else without).append(wall)
            if every:
                writes += checkpoint_seconds(base / f"{r}-{every}")[:-1]  # periodic ones (the last is the end-of-fit one)
        print(f"round {r}: with {with_ckpt[-1]:.2f}s without {without[-1]:.2f}s", file=sys.stderr)
    steps = SAMPLES // BATCH
    step_time = median(without) / steps
    write = statistics.median(writes)
    measured = median(with_ckpt) / median(without)
    at_default = 1 + write / 900.0
    size = sum(p.stat().st_size for p in (base / f"0-{EVERY}" / "checkpoints").glob("*.pt")) / len(
        list((base / f"0-{EVERY}" / "checkpoints").glob("*.pt")))
    lines = [
        f"ResNet-18 (10 classes) on {SAMPLES} random 32x32 images, batch {BATCH}, SGD+momentum, CPU, one epoch "
        f"({steps} steps), {args.rounds} alternating rounds. Checkpoint file {size / 2**20:.0f} MiB "
        "(weights + momentum + state).", "",
        "| measure | value |", "| --- | --- |",
        f"| one checkpoint write (median of {len(writes)}; temp file, fsync, rename) | {write * 1e3:.0f} ms |",
        f"| step time | {step_time * 1e3:.0f} ms |",
        f"| fit time with a checkpoint every {EVERY} steps / without (measured) | {measured:.3f} |",
        f"| at the default interval, 900 s (1 + write / 900 s) | {at_default:.5f} |",
    ]
    write_results("checkpoint", "Checkpoint cost (CPU)", lines)


if __name__ == "__main__":
    main()
