"""Recovery: the cost of starting 8x above the largest micro-batch that fits.

Under a real RLIMIT_AS cap (each trial is its own process), AutoTrainer starts with a
micro-batch 8x the largest power of two that fits and must find its way down through
OOMs; the hand-written loop starts already at that best size and accumulates gradients
to the same effective batch, so both do identical arithmetic. Reports the median wall
time to train the same samples, the ratio (target <= 1.15) and the OOM cycles.

    python benchmarks/recovery.py [--trials 3] [--budget-mib 96]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import median, write_results  # noqa: E402

SAMPLES, FEATURES, WIDTH, CLASSES = 32768, 64, 8192, 8


def worker(spec: dict) -> dict:
    """One trial, in this process: build, warm up, cap, train; returns timings."""
    import time

    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from autotune import AutoTrainer, OutOfMemory
    from autotune.data.sampler import EpochSampler
    from autotune.memory.limits import cap_address_space, single_malloc_arena

    single_malloc_arena()
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(spec["samples"], FEATURES, generator=g),
                         torch.randint(0, CLASSES, (spec["samples"],), generator=g))
    # Wide in the middle, narrow at the ends: activations, not parameters, decide what fits.
    model = nn.Sequential(nn.Linear(FEATURES, WIDTH), nn.ReLU(), nn.Linear(WIDTH, FEATURES), nn.ReLU(),
                          nn.Linear(FEATURES, CLASSES))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    nn.functional.cross_entropy(model(data[:2][0]), data[:2][1]).backward()  # warm-up before the cap
    model.zero_grad(set_to_none=True)
    batch, micro = spec["batch"], spec["micro"]
    if spec["loop"] == "autotune":
        trainer = AutoTrainer(model, data, loss_fn=nn.functional.cross_entropy, optimizer=optimizer,
                              batch_size=batch, micro_batch_size=micro, device="cpu", progress=False,
                              run_dir=spec["run_dir"])
        cap_address_space(spec["budget"])
        start = time.perf_counter()
        try:
            result = trainer.fit(epochs=1)
        except OutOfMemory as exc:
            return {"ok": False, "error": str(exc)[:200]}
        return {"ok": True, "seconds": time.perf_counter() - start, "ooms": result.ooms,
                "final_micro": result.micro_batch_size, "samples": result.samples_seen}
    sampler = EpochSampler(len(data), shuffle=True, seed=0)
    loader = DataLoader(data, batch_size=batch, sampler=sampler)
    cap_address_space(spec["budget"])
    start = time.perf_counter()
    seen = 0
    try:
        for x, y in loader:
            for lo in range(0, len(x), micro):
                xs, ys = x[lo:lo + micro], y[lo:lo + micro]
                (nn.functional.cross_entropy(model(xs), ys) * (len(xs) / len(x))).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            seen += len(x)
            if spec.get("probe_steps") and seen >= spec["probe_steps"] * batch:
                break
    except RuntimeError as exc:
        return {"ok": False, "error": str(exc)[:200]}
    return {"ok": True, "seconds": time.perf_counter() - start, "ooms": 0, "final_micro": micro, "samples": seen}


def trial(spec: dict) -> dict:
    proc = subprocess.run([sys.executable, __file__, "--worker", json.dumps(spec)], capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"trial {spec} crashed: {proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--budget-mib", type=int, default=96)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))))
        return
    budget = args.budget_mib * 2**20
    # The largest power of two that fits, found by the hand-written loop itself.
    best = None
    for size in (4096, 2048, 1024, 512, 256, 128, 64, 32):
        probe = trial({"loop": "plain", "batch": size, "micro": size, "budget": budget, "samples": SAMPLES,
                       "probe_steps": 3})
        print(f"probe micro-batch {size}: {'fits' if probe['ok'] else 'OOM'}", file=sys.stderr)
        if probe["ok"]:
            best = size
            break
    if best is None:
        raise SystemExit("no micro-batch fits this budget; raise --budget-mib")
    batch = 8 * best
    runs = {"plain": [], "autotune": []}
    for t in range(args.trials):
        for loop in (("plain", "autotune") if t % 2 == 0 else ("autotune", "plain")):
            spec = {"loop": loop, "batch": batch, "micro": best if loop == "plain" else batch, "budget": budget,
                    "samples": SAMPLES, "run_dir": f"runs/bench-recovery/{loop}{t}"}
            result = trial(spec)
            if not result["ok"]:
                raise SystemExit(f"{loop} failed under the cap: {result['error']}")
            runs[loop].append(result)
            print(f"trial {t} {loop}: {result}", file=sys.stderr)
    plain_s = median([r["seconds"] for r in runs["plain"]])
    auto_s = median([r["seconds"] for r in runs["autotune"]])
    lines = [
        f"MLP {FEATURES}-{WIDTH}-{FEATURES}-{CLASSES}, SGD+momentum, {SAMPLES} samples (one epoch), effective batch "
        f"{batch}, RLIMIT_AS = virtual size after warm-up + {args.budget_mib} MiB, {args.trials} trials each "
        "(one process per trial).", "",
        f"Largest power-of-two micro-batch that fits (probed): {best}. AutoTrainer starts at {batch} (8x).", "",
        "| loop | start micro-batch | final micro-batch | OOM cycles | median wall (s) | ratio |",
        "| --- | --- | --- | --- | --- | --- |",
        f"| plain loop at the best size | {best} | {best} | 0 | {plain_s:.2f} | 1.000 |",
        f"| AutoTrainer from 8x | {batch} | {runs['autotune'][0]['final_micro']} | "
        f"{', '.join(str(r['ooms']) for r in runs['autotune'])} | {auto_s:.2f} | {auto_s / plain_s:.3f} |",
    ]
    write_results("recovery", "Recovery: starting 8x too big under RLIMIT_AS (CPU)", lines)


if __name__ == "__main__":
    main()
