"""What a steady step costs on CUDA: `Tuner.step` against the same step without autotune.

Issue 32's question on a GPU: a fast GPU step (0.3-10 ms) is where autotune's own host work and its
one host sync a step (the NaN/inf check reads one flag) can show. Four sides, each with its own
model and optimizer, built once and warmed up, then timed in alternating rounds of a size's steps
(plain, floor, tuner, ..., tuner fused, tuner fused, ..., plain), each round between two
`torch.cuda.synchronize()`:

- `plain`: forward, backward, `optimizer.step()`, `zero_grad`
- `floor`: the same with autotune's gradient check (`all_finite`) before the optimizer step: what
  any step that keeps the NaN promise with a host decision pays (the sync included)
- `tuner`: `Tuner.step` with its defaults (default preset, the monitor process on)
- `unchecked`: `Tuner.step` with the gradient check answered without looking (measurement only)
- `plain fused` and `tuner fused`: the plain step and `Tuner.step` with `AdamW(fused=True)`, whose
  check autotune hands to the optimizer's kernel and reads a step late (finite.py's `LateRead`):
  no host sync

Sizes: `launch` (the CPU benchmark's token MLP: launch-bound on a GPU), `1ms` and `10ms` (MLPs
sized for about that step on an H200 in fp32). Reported: the median step of each side, its ratio
to plain, with the middle half of the rounds' ratios.

    python benchmarks/gpu_steady_step.py [--rounds 9]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))
from common import write_results  # noqa: E402

SIZES = {  # name: (batch, features, width, depth, steps a round)
    "launch": (8, 64, 192, 2, 400),
    "1ms": (512, 1024, 2048, 6, 200),
    "10ms": (2048, 2048, 4096, 6, 40),
}
SIDES = ("plain", "floor", "tuner", "unchecked", "plain fused", "tuner fused")
FUSED = ("plain fused", "tuner fused")


def make_model(features: int, width: int, depth: int) -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Linear(features, width), nn.GELU()]
    for _ in range(depth - 2):
        layers += [nn.Linear(width, width), nn.GELU()]
    layers.append(nn.Linear(width, 16))
    return nn.Sequential(*layers)


def loss_of(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return nn.functional.cross_entropy(model(x), y)


def main() -> None:
    from autotune import Tuner
    from autotune.step.finite import all_finite
    from autotune.step.optimizer_step import OptimizerStep

    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--sizes", default="launch,1ms,10ms")
    parser.add_argument("--device", default="cuda", help="cpu: a smoke test of this script")
    args = parser.parse_args()
    device = torch.device(args.device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (smoke test)"
    lines = [f"{name}, torch {torch.__version__}, fp32 (TF32 off), {args.rounds} "
             "alternating rounds a side. Step: median over rounds of (round's time / its steps), each round "
             "between two syncs; ratio: median of the rounds' ratios to the plain round next to it "
             "(middle half in brackets).", "",
             "AdamW (foreach, torch's default on CUDA) in the first four columns; `fused=True` in the last three.",
             "",
             "| size | plain step (ms) | floor: + check | Tuner.step | Tuner.step, check answered | "
             "Tuner.step - plain (us) | fused: plain step (ms) | fused: Tuner.step | fused: Tuner.step - plain (us) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    real_check = OptimizerStep._gradients_finite
    for size in args.sizes.split(","):
        batch_n, features, width, depth, steps = SIZES[size]
        g = torch.Generator(device=device).manual_seed(0)
        batches = [(torch.randn(batch_n, features, device=device, generator=g),
                    torch.randint(0, 16, (batch_n,), device=device, generator=g)) for _ in range(8)]
        models = {side: make_model(features, width, depth).to(device) for side in SIDES}
        optimizers = {side: torch.optim.AdamW(models[side].parameters(), lr=1e-4, fused=side in FUSED)
                      for side in ("plain", "floor", "plain fused")}
        run_dir = tempfile.mkdtemp(prefix="gpu-steady-")
        tuners = {side: Tuner(models[side], lambda p, fused=side in FUSED: torch.optim.AdamW(p, lr=1e-4, fused=fused),
                              device=device, run_dir=f"{run_dir}/{side.replace(' ', '-')}")
                  for side in ("tuner", "unchecked", "tuner fused")}

        def one_step(side: str, b) -> None:
            if side in tuners:
                tuners[side].step(b, loss_of)
                return
            model, optimizer = models[side], optimizers[side]
            loss_of(model, b).backward()
            if side != "floor" or all_finite([p.grad for p in model.parameters() if p.grad is not None]):
                optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        def round_of(side: str) -> float:
            if side == "unchecked":
                OptimizerStep._gradients_finite = lambda self: True
            try:
                sync()
                start = time.perf_counter()
                for i in range(steps):
                    one_step(side, batches[i % len(batches)])
                sync()
                return (time.perf_counter() - start) / steps
            finally:
                OptimizerStep._gradients_finite = real_check

        for side in SIDES:  # warm-up: kernels chosen, the tuner's first measured batches behind it
            for _ in range(2):
                round_of(side)
        times: dict[str, list[float]] = {side: [] for side in SIDES}
        for r in range(args.rounds):
            for side in (SIDES if r % 2 == 0 else SIDES[::-1]):
                times[side].append(round_of(side))
        for tuner in tuners.values():
            tuner.close()

        def ratio(side: str, base: str = "plain") -> str:
            rs = sorted(a / b for a, b in zip(times[side], times[base]))
            q = len(rs) // 4
            return f"{statistics.median(rs):.3f} ({rs[q]:.3f}-{rs[-1 - q]:.3f})"

        plain = statistics.median(times["plain"])
        def extra(side: str, base: str) -> str:
            return f"{statistics.median(a - b for a, b in zip(times[side], times[base])) * 1e6:+.0f}"

        lines.append(f"| {size} | {plain * 1e3:.3f} | {ratio('floor')} | {ratio('tuner')} | {ratio('unchecked')} | "
                     f"{extra('tuner', 'plain')} | {statistics.median(times['plain fused']) * 1e3:.3f} | "
                     f"{ratio('tuner fused', 'plain fused')} | {extra('tuner fused', 'plain fused')} |")
        print(lines[-1], flush=True)
    write_results("gpu_steady_step", "Steady step on CUDA: Tuner.step vs the plain step", lines)


if __name__ == "__main__":
    torch.backends.cuda.matmul.allow_tf32 = False
    main()
