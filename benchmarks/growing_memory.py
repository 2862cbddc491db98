"""Memory need that grows mid-epoch: AutoTrainer vs Accelerate's restart-on-OOM.

Variable-length sequences, padded per batch, in a fixed order: short ones first, a few
long batches late in the epoch (the case that kills a run hours in). Under a real
RLIMIT_AS cap the batch size that fits the short sequences does not fit the long ones.
- AutoTrainer halves the micro-batch on the OOM and retries the same batch (gradients
  accumulated, so the optimizer's batch does not change); nothing is redone.
- Accelerate's `find_executable_batch_size` (its default x0.9, and halving) restarts the
  training function with a smaller batch: the epoch starts over, and every sample trained
  before the OOM is trained again.
Reports the wall time to finish the epoch (median of trials), the ratio, the OOM cycles
and the samples recomputed. Each run is its own process.

    pip install accelerate   # or: pip install -e '.[bench]'
    python benchmarks/growing_memory.py [--trials 3]
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

SAMPLES, SHORT, LONG, LONG_SHARE = 4096, 32, 160, 0.1
VOCAB, DIM, WIDTH, CLASSES = 1000, 64, 1024, 4
BATCH, BUDGET_MIB = 128, 160


def worker(spec: dict) -> dict:
    """One run in this process: build, warm up, cap, train one epoch; returns what happened."""
    import time

    import torch
    from torch import nn
    from torch.utils.data import DataLoader, Dataset

    from autotune.memory.limits import cap_address_space, single_malloc_arena

    single_malloc_arena()
    torch.manual_seed(0)

    class Sequences(Dataset):
        """Token sequences; the last LONG_SHARE of the epoch are LONG tokens long, the rest SHORT."""

        def __init__(self) -> None:
            g = torch.Generator().manual_seed(0)
            first_long = int(SAMPLES * (1 - LONG_SHARE))
            self.items = [(torch.randint(0, VOCAB, (LONG if i >= first_long else SHORT,), generator=g), i % CLASSES)
                          for i in range(SAMPLES)]

        def __len__(self) -> int:
            return len(self.items)

        def __getitem__(self, i: int):
            return self.items[i]

    def pad(items):
        tokens = nn.utils.rnn.pad_sequence([t for t, _ in items], batch_first=True)
        return tokens, torch.tensor([label for _, label in items])

    class TokenMLP(nn.Module):
        """Per-token MLP, mean-pooled: activation memory grows with batch x length."""

        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(VOCAB, DIM)
            self.mlp = nn.Sequential(nn.Linear(DIM, WIDTH), nn.GELU(), nn.Linear(WIDTH, DIM))
            self.head = nn.Linear(DIM, CLASSES)

        def forward(self, tokens):
            return self.head(self.mlp(self.embed(tokens)).mean(dim=1))

    data, model = Sequences(), TokenMLP()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    warm = pad([data[0], data[1]])
    nn.functional.cross_entropy(model(warm[0]), warm[1]).backward()  # warm-up before the cap
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    budget = spec["budget_mib"] * 2**20

    if spec["tool"] == "autotune":
        from autotune import AutoTrainer

        trainer = AutoTrainer(model, data, loss_fn=nn.functional.cross_entropy, optimizer=optimizer,
                              batch_size=BATCH, shuffle=False, collate_fn=pad, device="cpu", progress=False,
                              checkpoint_interval=None, run_dir=spec["run_dir"])
        cap_address_space(budget)
        start = time.perf_counter()
        result = trainer.fit(epochs=1)
        return {"seconds": time.perf_counter() - start, "ooms": result.ooms, "trained": result.samples_seen,
                "final": result.micro_batch_size}

    from accelerate.utils import find_executable_batch_size

    state = {"attempts": 0, "trained": 0, "size": BATCH}

    def halve():
        state["size"] //= 2
        return state["size"]

    @find_executable_batch_size(starting_batch_size=BATCH,
                                reduce_batch_size_fn=halve if spec["tool"] == "accelerate-halving" else None)
    def train(batch_size):
        state["attempts"] += 1
        state["final"] = batch_size
        for tokens, labels in DataLoader(data, batch_size=batch_size, shuffle=False, collate_fn=pad):
            nn.functional.cross_entropy(model(tokens), labels).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            state["trained"] += len(labels)

    cap_address_space(budget)
    start = time.perf_counter()
    train()
    return {"seconds": time.perf_counter() - start, "ooms": state["attempts"] - 1, "trained": state["trained"],
            "final": state["final"]}


def run(spec: dict) -> dict:
    proc = subprocess.run([sys.executable, __file__, "--worker", json.dumps(spec)], capture_output=True, text=True,
                          env={**os.environ, "MALLOC_ARENA_MAX": "1"}, timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"{spec['tool']} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--budget-mib", type=int, default=BUDGET_MIB)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))))
        return
    tools = {"autotune": "AutoTrainer (default preset)",
             "accelerate": "Accelerate find_executable_batch_size (x0.9)",
             "accelerate-halving": "Accelerate find_executable_batch_size (halving)"}
    results: dict[str, list[dict]] = {tool: [] for tool in tools}
    for trial in range(args.trials):
        for tool in tools:  # interleaved, so machine noise hits every tool alike
            r = run({"tool": tool, "budget_mib": args.budget_mib, "run_dir": f"runs/bench-growing/{tool}-{trial}"})
            results[tool].append(r)
            print(trial, tool, r, file=sys.stderr)
    base = median([r["seconds"] for r in results["autotune"]])
    lines = [
        f"{SAMPLES} token sequences in a fixed order: the first {1 - LONG_SHARE:.0%} {SHORT} tokens long, the last "
        f"{LONG_SHARE:.0%} {LONG} tokens long (padded per batch); per-token MLP {DIM}-{WIDTH}-{DIM}, SGD+momentum, "
        f"batch {BATCH}, one epoch on CPU under RLIMIT_AS = virtual size after warm-up + {args.budget_mib} MiB. "
        f"{args.trials} trials per tool, interleaved, each its own process; medians. AutoTrainer as shipped "
        "(default preset, memory monitor on), checkpoints off as in the Accelerate loop.", "",
        "| tool | epoch wall (s) | vs AutoTrainer | OOM cycles | samples trained | samples recomputed | final batch |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for tool, name in tools.items():
        rs = results[tool]
        seconds = median([r["seconds"] for r in rs])
        trained = int(median([r["trained"] for r in rs]))
        lines.append(f"| {name} | {seconds:.1f} | {seconds / base:.2f} | {int(median([r['ooms'] for r in rs]))} | "
                     f"{trained} | {trained - SAMPLES} | {rs[0]['final']} |")
    lines += ["", "AutoTrainer's final batch is its micro-batch: the optimizer's batch stays "
              f"{BATCH} (gradients accumulated). Accelerate's restarts also change the optimizer's batch, and the "
              "model trains again on the samples it already saw."]
    write_results("growing_memory", "Memory need growing mid-epoch vs Accelerate restart-on-OOM (CPU, RLIMIT_AS)",
                  lines)


if __name__ == "__main__":
    main()
