"""bf16 under an address-space cap, run after run: does anything die of a signal? (issue 56, item 11)

    python benchmarks/bf16_under_cap.py [--runs 20] [--parallel 2] [--sweeps 3] [--overhead-rounds 5]
                                        [--base PATH] [--base-runs N] [--out FILE] [-- EXAMPLE ARGS]

Two measures, each run a fresh interpreter with the examples' environment (MALLOC_ARENA_MAX=1,
OMP_NUM_THREADS=1, as tests/test_examples.py runs them):

- The sweep: tests/memory/test_kernel_room.py's script (a bf16 Linear stack's forward and backward through
  a Tuner, retried at 16, 12, 8, 7, 6, 5 under caps 64 KiB apart, then wide), `--sweeps` times; and
  the same model in a plain torch loop (no autotune step: what torch and oneDNN do alone), as many.
- The example: `examples/hf_causal_lm.py` as shipped (bf16, its measured cap), `--runs` times,
  `--parallel` at a time, in its own folder each.
- What the check costs: the example's model, forward and backward at micro-batch 1 and 8 under bf16
  autocast and a wide cap (the check made, never refused), with the check and without it in turn,
  `--overhead-rounds` rounds of 10 steps each (0: not measured); medians.

`--base PATH`: the sweep and `--base-runs` example runs (default `--runs`) with PYTHONPATH=PATH too (a
`git worktree` of an older commit). A negative exit code is a signal (-11: SIGSEGV, a shell's 139).
Prints and (with `--out`) writes every exit code, the example's OOMs and fit time, the command and the CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]
ENV = {"MALLOC_ARENA_MAX": "1", "OMP_NUM_THREADS": "1"}

# What torch and oneDNN do with no autotune step between: the sweep's model and sizes in a hand loop.
PLAIN = """
import torch
from autotune.memory.limits import cap_address_space, fix_mmap_threshold, lift_address_space_cap, single_malloc_arena
from autotune.memory.figures import free_cpu_caches
from autotune.common.oom import is_oom

single_malloc_arena()
fix_mmap_threshold()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64),
                            torch.nn.Linear(64, 4096)).to(torch.bfloat16)

def step(m):
    model(torch.randn(m * 64, 64, dtype=torch.bfloat16)).float().logsumexp(-1).mean().backward()
    model.zero_grad(set_to_none=True)

step(8)
said = {"fits": [], "refused": 0}
for headroom in [k * 64 * 1024 for k in range(8)] + [16 * 2**20, 96 * 2**20]:
    for m in (16, 12, 8, 7, 6, 5):
        free_cpu_caches()
        cap_address_space(headroom)
        try:
            step(m)
            said["fits"].append([headroom, m])
        except Exception as exc:
            if not is_oom(exc):
                raise
            said["refused"] += 1
        finally:
            lift_address_space_cap()
        model.zero_grad(set_to_none=True)
save(said)
"""

OVERHEAD = """
import contextlib, statistics, sys, time
import torch
from torch.utils._python_dispatch import TorchDispatchMode
sys.path.insert(0, EXAMPLES)
from hf_causal_lm import build
from autotune.memory import kernel_room
from autotune.memory.limits import cap_address_space

torch.manual_seed(0)
model, train, _, collator = build(64)
kernel_room.warm()
cap_address_space(4 * 2**30)  # wide: the check is made and never refuses
cpu = torch.device("cpu")
room = {"without": contextlib.nullcontext, "with": lambda: kernel_room.guard(cpu, {torch.bfloat16})}

class Count(TorchDispatchMode):
    ops = 0
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        Count.ops += 1
        return func(*args, **(kwargs or {}))

def step(batch, side):
    with room[side]():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(**batch).loss
    with room[side]():
        loss.backward()
    model.zero_grad(set_to_none=True)

said = {}
for n in (1, 8):
    batch = collator([train[i] for i in range(n)])
    with Count():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            model(**batch).loss.backward()
    model.zero_grad(set_to_none=True)
    ops, Count.ops = Count.ops, 0
    for side in ("without", "with", "without", "with"):
        step(batch, side)
    times = {"without": [], "with": []}
    for _ in range(ROUNDS):
        for side in ("without", "with"):
            started = time.perf_counter()
            for _ in range(10):
                step(batch, side)
            times[side].append((time.perf_counter() - started) / 10)
    said[n] = {"ops": ops, **{side: statistics.median(t) for side, t in times.items()}}
save(said)
"""


def cpu() -> tuple[str, str]:
    """The CPU's model name and its bf16/fp16 features (/proc/cpuinfo)."""
    model, flags = platform.processor() or "unknown", set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name":
                    model = value.strip()
                elif key.strip() == "flags":
                    flags = set(value.split())
    except OSError:
        pass
    features = sorted(flags & {"avx512_bf16", "amx_bf16", "amx_tile", "avx512_fp16", "amx_fp16"})
    return model, ", ".join(features) or "none"


def code(returncode: int) -> str:
    return f"{returncode} ({signal.Signals(-returncode).name})" if returncode < 0 else str(returncode)


def sweep(script: str, root: str, folder: Path) -> int:
    """`script` in a fresh interpreter with autotune from `root`; its return code."""
    folder.mkdir(parents=True)
    preamble = (f"RUN_DIR = {str(folder / 'run')!r}\n"
                f"def save(obj):\n    open({str(folder / 'said.json')!r}, 'w').write(__import__('json').dumps(obj))\n")
    return subprocess.run([sys.executable, "-c", preamble + textwrap.dedent(script)], cwd=folder,
                          env={**os.environ, **ENV, "PYTHONPATH": root}, capture_output=True, timeout=600,
                          check=False).returncode


def start_example(root: str, folder: Path, args: list[str]) -> subprocess.Popen:
    folder.mkdir(parents=True)
    example = str(Path(root) / "examples" / "hf_causal_lm.py")
    return subprocess.Popen([sys.executable, example, *args, "--run-dir", "run"], cwd=folder,
                            env={**os.environ, **ENV, "PYTHONPATH": root}, stdout=open(folder / "stdout", "w"),
                            stderr=open(folder / "stderr", "w"))


def example_summary(folder: Path, returncode: int) -> dict:
    """What a finished example run did: its code, OOMs, the micro-batches that ran out, fit's seconds."""
    sizes, seconds = [], None
    journal = folder / "run" / "events.jsonl"
    for line in journal.read_text().splitlines() if journal.exists() else []:
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if record.get("kind") == "oom":
            sizes.append(record["micro_batch_size"])
        elif record.get("kind") == "fit_end":
            seconds = record.get("wall_seconds")
    said = (folder / "stderr").read_text().strip().splitlines()
    return {"code": returncode, "oom_sizes": sizes, "seconds": seconds,
            "last": said[-1][:160] if said and returncode else ""}


def run_examples(sides: dict[str, tuple[str, int]], parallel: int, args: list[str], tmp: Path) -> dict[str, list[dict]]:
    """The example `n` times per side (`sides`: name -> (PYTHONPATH, n)), the sides in turn, `parallel` at a time."""
    results: dict[str, list[dict]] = {side: [] for side in sides}
    queue = [(i, side) for i in range(max(n for _, n in sides.values())) for side, (_, n) in sides.items() if i < n]
    running: list[tuple[str, Path, subprocess.Popen]] = []
    while queue or running:
        while queue and len(running) < parallel:
            i, side = queue.pop(0)
            folder = tmp / f"example-{side.replace(' ', '_')}-{i}"
            running.append((side, folder, start_example(sides[side][0], folder, args)))
        side, folder, proc = running.pop(0)
        results[side].append(example_summary(folder, proc.wait()))
        print(side, len(results[side]), results[side][-1], flush=True)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--parallel", type=int, default=2)
    parser.add_argument("--sweeps", type=int, default=3)
    parser.add_argument("--overhead-rounds", type=int, default=5)
    parser.add_argument("--base", default=None, help="another checkout (PYTHONPATH) measured alike")
    parser.add_argument("--base-runs", type=int, default=None)
    parser.add_argument("--out", default=None)
    parser.add_argument("example_args", nargs="*", help="after --: the example's arguments (default: none, as shipped)")
    args = parser.parse_args()
    sys.path.insert(0, str(HERE))
    from tests.memory.test_kernel_room import SCRIPT  # the test's sweep, one text for both

    roots = {"this checkout": str(HERE)} | ({"base": str(Path(args.base).resolve())} if args.base else {})
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bf16_under_cap-") as tmp:
        sweeps = {("plain torch loop", "this checkout"): [sweep(PLAIN, roots["this checkout"], Path(tmp) / f"plain-{i}")
                                                          for i in range(args.sweeps)]}
        for side, root in roots.items():
            sweeps[("Tuner (tests/memory/test_kernel_room.py)", side)] = [
                sweep(SCRIPT, root, Path(tmp) / f"tuner-{side.replace(' ', '_')}-{i}") for i in range(args.sweeps)]
        print(sweeps, flush=True)
        counts = {"this checkout": (roots["this checkout"], args.runs)}
        if args.base:
            counts["base"] = (roots["base"], args.runs if args.base_runs is None else args.base_runs)
        examples = run_examples(counts, args.parallel, args.example_args, Path(tmp))
        overhead = None
        if args.overhead_rounds:
            folder = Path(tmp) / "overhead"
            script = f"EXAMPLES = {str(HERE / 'examples')!r}\nROUNDS = {args.overhead_rounds}\n" + OVERHEAD
            if sweep(script, roots["this checkout"], folder) == 0:
                overhead = json.loads((folder / "said.json").read_text())
    model, features = cpu()
    import torch

    command = (f"python benchmarks/bf16_under_cap.py --runs {args.runs} --parallel {args.parallel} "
               f"--sweeps {args.sweeps} --overhead-rounds {args.overhead_rounds}"
               + (f" --base OLD --base-runs {counts['base'][1]}" if args.base else "")
               + (" -- " + " ".join(args.example_args) if args.example_args else ""))
    lines = ["# bf16 under an address-space cap, run after run", "",
             (f"`{command.strip()}` ({time.perf_counter() - started:.0f} s in all); every run a fresh interpreter "
              "with MALLOC_ARENA_MAX=1 and OMP_NUM_THREADS=1."), "",
             (f"CPU: {model}, {os.cpu_count()} cores (bf16/fp16 features: {features}); torch {torch.__version__}, "
              f"bf16 on oneDNN: {torch.ops.mkldnn._is_mkldnn_bf16_supported()}."), ""]
    lines += [f"OLD: {roots['base']}." if args.base else "", "", "## The sweep (exit codes; -11 is SIGSEGV)", "",
              "| script | autotune | exit codes |", "| --- | --- | --- |"]
    lines += [f"| {script} | {side} | {', '.join(code(c) for c in codes)} |"
              for (script, side), codes in sweeps.items()]
    if overhead:
        lines += ["", f"## What the check costs (this checkout, medians of {args.overhead_rounds} rounds of 10 steps)",
                  "", "| micro-batch | ops a step | without the check | with it | more |",
                  "| --- | --- | --- | --- | --- |"]
        for n, said in overhead.items():
            more = said["with"] - said["without"]
            lines.append(f"| {n} | {said['ops']} | {said['without'] * 1e3:.1f} ms | {said['with'] * 1e3:.1f} ms "
                         f"| {more * 1e3:+.1f} ms ({more / said['ops'] * 1e6:+.1f} us an op) |")
    for side, runs in examples.items():
        if not runs:
            continue
        signals = [r for r in runs if r["code"] < 0]
        times = [r["seconds"] for r in runs if r["seconds"] is not None]
        shown = " ".join(["examples/hf_causal_lm.py", *args.example_args])
        median = f"{statistics.median(times):.2f} s" if times else "none ended"
        lines += ["", f"## {shown}, {side}: {len(runs) - len(signals)} of {len(runs)} without a signal", "",
                  f"Exit codes: {', '.join(code(r['code']) for r in runs)}. fit's wall time, median: {median}.", "",
                  "| run | exit code | OOMs at micro-batch | fit s | last stderr line (a failure) |",
                  "| --- | --- | --- | --- | --- |"]
        lines += [f"| {i + 1} | {code(r['code'])} | {r['oom_sizes']} | {r['seconds'] and round(r['seconds'], 2)} "
                  f"| {r['last']} |" for i, r in enumerate(runs)]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
