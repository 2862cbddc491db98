"""The memory-relief ladder, rung by rung: step memory and step time, and what pruning costs in accuracy.

For torchvision's resnet18 and a small transformer, on CPU, each rung in its own process:
plain, + bf16 autocast, + activation checkpointing, + pruning 10% of channels, + pruning 30%.
Per rung: resident bytes (parameters + optimizer state), the step's demand (its peak above
what stays resident), and the median step time. Then the accuracy cost on a small learnable
task the benchmark builds (not random labels): the same number of steps with and without
pruning 30% of channels half-way, held-out accuracy at the end.

    python benchmarks/relief_ladder.py [--steps 150]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import median, write_results  # noqa: E402

RUNGS = ["plain", "autocast", "checkpointing", "prune 10%", "prune 30%"]


def build(model_name: str):
    """(model, make_batch(n, generator) -> (x, y)) for a learnable task."""
    import torch
    import torchvision
    from torch import nn

    if model_name == "resnet18":
        # Four classes of 32x32 images: a bright bar, horizontal or vertical, top/left or bottom/right half, in noise.
        def make_batch(n, g):
            y = torch.randint(0, 4, (n,), generator=g)
            x = torch.randn(n, 3, 32, 32, generator=g)
            pos = torch.randint(2, 14, (n,), generator=g)
            for i in range(n):
                c, p = int(y[i]), int(pos[i]) + (16 if int(y[i]) % 2 else 0)
                if c < 2:
                    x[i, :, p:p + 2, :] += 0.35
                else:
                    x[i, :, :, p:p + 2] += 0.35
            return x, y

        return torchvision.models.resnet18(num_classes=4), make_batch

    class TinyTransformer(nn.Module):
        def __init__(self, vocab: int = 16, d: int = 128, layers: int = 4, classes: int = 4):
            super().__init__()
            self.embed = nn.Embedding(vocab, d)
            self.position = nn.Parameter(torch.zeros(1, 64, d))
            self.encoder = nn.TransformerEncoder(
                nn.TransformerEncoderLayer(d, 4, 4 * d, batch_first=True, dropout=0.0), layers,
                enable_nested_tensor=False)
            self.head = nn.Linear(d, classes)

        def forward(self, tokens):
            return self.head(self.encoder(self.embed(tokens) + self.position[:, :tokens.shape[1]]).mean(1))

    # Which of 4 marker tokens appears most often in a sequence of 64 (the rest filler tokens).
    def make_batch(n, g):
        tokens = torch.randint(4, 16, (n, 64), generator=g)
        y = torch.randint(0, 4, (n,), generator=g)
        for i in range(n):
            counts = torch.randint(1, 4, (4,), generator=g)
            counts[y[i]] = 4  # one more than the most any other can have: a close count
            spots = torch.randperm(64, generator=g)[: int(counts.sum())]
            tokens[i, spots] = torch.repeat_interleave(torch.arange(4), counts)
        return tokens, y

    return TinyTransformer(), make_batch


def worker(spec: dict) -> dict:
    import time

    import torch
    from torch import nn

    from autotune.memory.limits import fix_mmap_threshold
    from autotune.memory.demand import StepPeak
    from autotune.step.precision import autocast_plan
    from autotune.relief.checkpointing import checkpoint_blocks
    from autotune.relief.pruning import prune_channels, remap_optimizer, tensor_bytes

    fix_mmap_threshold()
    torch.manual_seed(0)
    model, make_batch = build(spec["model"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1)
    batch = spec["batch"]
    plan = None

    def step(x, y):
        if plan is not None:
            with plan.context():
                loss = nn.functional.cross_entropy(model(x), y)
        else:
            loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.item()

    def accuracy() -> float:
        model.eval()
        gt = torch.Generator().manual_seed(99)  # the same held-out set for every run
        correct = 0
        with torch.no_grad():
            for _ in range(8):
                x, y = make_batch(64, gt)
                correct += int((model(x).argmax(1) == y).sum())
        model.train()
        return correct / 512

    if spec["task"] == "accuracy":
        for i in range(spec["steps"]):
            if spec["prune"] and i == spec["steps"] // 2:
                remap_optimizer(optimizer, prune_channels(model, make_batch(2, g)[0], 0.3)).apply()
            step(*make_batch(batch, g))
        return {"accuracy": accuracy(), "parameters": sum(p.numel() for p in model.parameters())}

    rung = spec["rung"]
    x, y = make_batch(batch, g)
    step(x, y)  # optimizer state exists
    if RUNGS.index(rung) >= 1:
        plan = autocast_plan(torch.device("cpu"))
    if RUNGS.index(rung) >= 2:
        checkpoint_blocks(model)
    if RUNGS.index(rung) >= 3:
        remap_optimizer(optimizer, prune_channels(model, x[:2], 0.1)).apply()
    if RUNGS.index(rung) >= 4:
        remap_optimizer(optimizer, prune_channels(model, x[:2], 1 - 0.7 / 0.9)).apply()  # 30% in all
    step(x, y)
    step(x, y)  # warm: kernels paged in
    peak = StepPeak(torch.device("cpu"))
    demands, times = [], []
    for _ in range(spec["repeats"]):
        before = peak.current()
        peak.start()
        started = time.perf_counter()
        step(x, y)
        times.append(time.perf_counter() - started)
        demands.append(peak.peak() - before)
    return {"resident": tensor_bytes(list(model.parameters())) + tensor_bytes(list(optimizer.state.values())),
            "demand": median(demands), "seconds": median(times),
            "parameters": sum(p.numel() for p in model.parameters())}


def run(spec: dict) -> dict:
    proc = subprocess.run([sys.executable, __file__, "--worker", json.dumps(spec)], capture_output=True, text=True,
                          timeout=1800, env={**os.environ, "MALLOC_ARENA_MAX": "1"})
    if proc.returncode != 0:
        raise RuntimeError(f"{spec} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=150, help="training steps for the accuracy comparison")
    parser.add_argument("--repeats", type=int, default=5, help="timed steps per rung")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))))
        return
    mib = 2**20
    lines = ["CPU, one process per measurement, AdamW. Demand: the step's peak resident size above what stays "
             "resident (activations, gradients, temporaries), median of the timed steps; resident: parameters + "
             "optimizer state. Rungs are cumulative. oneDNN on (its per-shape caches count in the resident size).",
             ""]
    for model_name, batch in (("resnet18", 64), ("transformer", 64)):
        lines += [f"### {model_name} (batch {batch})", "",
                  "| rung | parameters | resident (MiB) | step demand (MiB) | vs plain | step time (s) | vs plain |",
                  "| --- | --- | --- | --- | --- | --- | --- |"]
        base = None
        for rung in RUNGS:
            r = run({"task": "rung", "model": model_name, "rung": rung, "batch": batch, "repeats": args.repeats})
            base = base or r
            print(model_name, rung, r, file=sys.stderr)
            lines.append(f"| {rung} | {r['parameters']:,} | {r['resident'] / mib:.1f} | {r['demand'] / mib:.1f} | "
                         f"{r['demand'] / base['demand']:.2f} | {r['seconds']:.3f} | "
                         f"{r['seconds'] / base['seconds']:.2f} |")
        dense = run({"task": "accuracy", "model": model_name, "prune": False, "steps": args.steps, "batch": 32})
        pruned = run({"task": "accuracy", "model": model_name, "prune": True, "steps": args.steps, "batch": 32})
        print(model_name, dense, pruned, file=sys.stderr)
        lines += ["", f"Accuracy after {args.steps} steps (batch 32) on the learnable task, 512 held-out samples: "
                      f"dense {dense['accuracy']:.3f} ({dense['parameters']:,} parameters); pruned 30% of channels "
                      f"at step {args.steps // 2} {pruned['accuracy']:.3f} ({pruned['parameters']:,} parameters).", ""]
    write_results("relief_ladder", "Relief ladder: memory and time per rung, accuracy cost of pruning (CPU)", lines)


if __name__ == "__main__":
    main()
