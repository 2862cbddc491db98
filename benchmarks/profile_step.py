"""Where `Tuner.step`'s own microseconds go (issue 46, item 5): a sampling profile (py-spy) of a
steady run of `Tuner.step` on steady_step.py's ~1 ms token MLP, one torch thread, and the
samples inside `Tuner.step` split into autotune's own Python lines (the leaf frame is autotune's)
and the calls it makes into torch and the step function (by the autotune line that made them).

    pip install py-spy
    python benchmarks/profile_step.py [--steps 15000] [--rate 250]

On a 2-core VM py-spy falls behind above a few hundred samples a second: keep `--rate` low and
the run long. Writes benchmarks/results/profile_step.md.
"""

from __future__ import annotations

import argparse
import collections
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import write_results  # noqa: E402


def run_steps(steps: int) -> None:
    """The profiled process: `steps` of Tuner.step with the defaults, on the 1 ms size's batches."""
    import torch

    import steady_step
    from autotune import Tuner

    torch.set_num_threads(1)
    data, collate, model_class, batch = steady_step.parts("1ms")
    batches = [collate([data[i] for i in range(b * batch, (b + 1) * batch)]) for b in range(200)]
    with tempfile.TemporaryDirectory() as run_dir, Tuner(model_class(), lambda p: torch.optim.SGD(p, lr=0.01),
                                                          step_fn=lambda m, b: m(**b)["loss"], run_dir=run_dir) as tuner:
        for i in range(steps):
            tuner.step(batches[i % len(batches)])


def attribute(raw: Path) -> tuple[int, int, collections.Counter, collections.Counter]:
    """(samples, samples inside Tuner.step, own lines, calls out by the autotune line that made them)."""
    total = inside = 0
    own: collections.Counter = collections.Counter()
    calls: collections.Counter = collections.Counter()
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        frames, n = stack.split(";"), int(count)
        total += n
        if not any(f.startswith("Tuner.step (") for f in frames):
            continue
        inside += n
        ours = [i for i, f in enumerate(frames) if "autotune/" in f]
        (own if ours[-1] == len(frames) - 1 else calls)[frames[ours[-1]]] += n
    return total, inside, own, calls


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=15000)
    parser.add_argument("--rate", type=int, default=250)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        run_steps(args.steps)
        return
    spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    with tempfile.TemporaryDirectory() as folder:
        raw = Path(folder) / "step.raw"
        subprocess.run([spy, "record", "-r", str(args.rate), "-f", "raw", "-o", str(raw), "--", sys.executable,
                        __file__, "--child", "--steps", str(args.steps)], check=True, capture_output=True)
        total, inside, own, calls = attribute(raw)
    mine = sum(own.values())
    lines = [f"steady_step.py's 1ms token MLP, SGD, one torch thread, {args.steps} steps of `Tuner.step` with its "
             f"defaults; py-spy at {args.rate} Hz: {total} samples, {inside} inside `Tuner.step`, of which "
             f"{mine} ({mine / max(inside, 1):.1%}) with an autotune line as the leaf (its own Python).", "",
             "| autotune's own line | samples | share of Tuner.step |", "| --- | --- | --- |"]
    lines += [f"| `{frame}` | {n} | {n / inside:.1%} |" for frame, n in own.most_common(20)]
    lines += ["", "| autotune line calling into torch or the step function | samples | share |", "| --- | --- | --- |"]
    lines += [f"| `{frame}` | {n} | {n / inside:.1%} |" for frame, n in calls.most_common(8)]
    write_results("profile_step", "Where Tuner.step's time goes: a sampling profile (CPU)", lines)


if __name__ == "__main__":
    main()
