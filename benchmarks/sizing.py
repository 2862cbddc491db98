"""Sizing under a real RLIMIT_AS cap: how fast each way finds the largest micro-batch that fits.

The scenario of tests/test_sizing_e2e.py (a CNN and a transformer LM, AutoTrainer, the cap
after a warm-up): from 8x below and 8x above the largest micro-batch that fits, the default
preset (fit_micro_batch) beside the blind way it replaced (halve_on_oom + grow_back). For each:
the optimizer steps and OOMs until the run is within 10% of the largest size (and stays), the
final size over the largest, and the run's time against a run that starts at the largest size.
The largest size is found by bisection in fresh processes, on the same batches.

    python benchmarks/sizing.py [--steps 12]

Not here yet (issue 16): Lightning's BatchSizeFinder and Accelerate's halving on this scenario
(benchmarks/integrations.py and batch_efficiency.py compare them on other models).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).parent))
from common import write_results  # noqa: E402

from tests.test_sizing_e2e import ABOUT, fits, run  # noqa: E402  the same scenario as the tests

GROW_BACK = '[[policy]]\nuse = "halve_on_oom"\n\n[[policy]]\nuse = "grow_back"\n'


def fresh(tmp: Path) -> Path:
    """A new folder for one process's run."""
    return Path(tempfile.mkdtemp(dir=tmp))


def largest(tmp: Path, model: str, batch: int, steps: int) -> int:
    """The largest micro-batch that trains a whole run (`steps` steps) in a fresh process under the
    cap, to within 2% (one step is not enough: a size can pass the first and fail a later one)."""
    lo, hi = ABOUT[model] // 2, ABOUT[model] * 2
    assert fits(fresh(tmp), model, lo, batch, steps) and not fits(fresh(tmp), model, hi, batch, steps), (model, lo, hi)
    while hi - lo > max(1, lo // 50):
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(fresh(tmp), model, mid, batch, steps) else (lo, mid)
    return lo


def settled_at(sizes: dict[int, int], best: int) -> int | None:
    """The first step from which every step's micro-batch is within 10% of `best`."""
    steps = sorted(sizes)
    for i, step in enumerate(steps):
        if all(abs(sizes[s] - best) <= 0.1 * best for s in steps[i:]):
            return step
    return None


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=12)
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="sizing-"))
    preset = tmp / "grow_back.toml"
    preset.write_text(GROW_BACK)
    rows = []
    for model in ("cnn", "lm"):
        for direction, start, batch in (("8x below", ABOUT[model] // 8, ABOUT[model] * 4),
                                        ("8x above", ABOUT[model] * 8, ABOUT[model] * 8)):
            best = largest(tmp, model, batch, args.steps)
            for _ in range(4):  # at the edge a size can fit one run and not the next: then 2% lower
                began = time.perf_counter()
                reference_run, _, _ = run(fresh(tmp), model, start=best, batch=batch, steps=args.steps, policies=[])
                reference = time.perf_counter() - began
                if "out_of_memory" not in reference_run:
                    break
                best = int(best * 0.98)
            else:
                raise RuntimeError(f"{model}: no run at the largest size found fits twice")
            for name, policies in (("fit_micro_batch (default)", "default"), ("grow_back", str(preset))):
                began = time.perf_counter()
                result, records, sizes = run(fresh(tmp), model, start=start, batch=batch,
                                             steps=args.steps, policies=policies)
                wall = time.perf_counter() - began
                at = settled_at(sizes, best)
                ooms_by = sum(1 for r in records if r["kind"] == "oom" and (at is None or r["step"] < at))
                rows.append(f"| {model} | {direction} ({start}) | {name} | {best} | "
                            f"{at if at is not None else 'never'} | {ooms_by} | {result['ooms']} | "
                            f"{result['micro'] / best:.2f} | {wall / reference:.2f} |")
                print(rows[-1], file=sys.stderr)
    lines = [f"AutoTrainer, {args.steps} optimizer steps a run, batch 4x (from below) or 8x (from above) the "
             "largest micro-batch; the models and caps of tests/test_sizing_e2e.py (CNN: three convs at 64x64, "
             "100 MiB of room; LM: 2-layer transformer, 128 tokens, 230 MiB), one thread each, oneDNN's primitive "
             "cache off (see the test's docstring).", "",
             "| model | start | sizing | largest that fits | settled at step | OOMs until then | OOMs in all | "
             "final / largest | time / a run started at the largest |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |", *rows, "",
             "'Settled at step': the first step from which every step is within 10% of the largest size (the "
             "micro-batch a step ran at is the one logged with it). 'Largest that fits': bisection of whole runs "
             "in fresh processes, then lowered 2% at a time until a second run at it fits too."]
    write_results("sizing", "Sizing under RLIMIT_AS: fit_micro_batch vs grow_back (CPU)", lines)


if __name__ == "__main__":
    main()
