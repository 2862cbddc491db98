"""Overhead of AutoTrainer (default preset) against a hand-written PyTorch loop.

Same model, data, batch, optimizer and sample order on CPU; the two are run alternately
in one process so machine noise hits both alike. Reports the median run time of each
and their ratio (target <= 1.03).

    python benchmarks/overhead.py [--rounds 9] [--epochs 2]
    python benchmarks/overhead.py --tiny [--rounds 9]   # autotune's own work per step, tiny model
    python benchmarks/overhead.py --short [--rounds 9]  # a short run of 2-5 ms steps, default preset (issue 45)

With tensorboard installed, also AutoTrainer(tensorboard=True), which in runs this short
writes every step (the first 200 steps of any run are; then at most one a second).

The training features of issue 14, on: `clip_grad_norm=1.0`, a step that returns
`(loss, n_items)` (item weighting), a callback with `on_step_end`, beside a hand-written loop
that clips too ("plain+clip"). Off, they are the default "autotune" row. With
`--compare-with DIR` (a checkout of an earlier autotune), both versions' default loop also
run in child processes, alternately, so the cost of the new code when its features are off
is measured against the code before it (the steady step interval; start-up excluded).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).parent))
from common import fresh_run_dir, median, write_results  # noqa: E402

from autotune import AutoTrainer  # noqa: E402
from autotune.training.callbacks import Callback  # noqa: E402
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


def plain_run(data, epochs, clip=False, save_to=None):
    """The hand-written loop; `save_to`: and at its end the checkpoint a careful loop writes (weights and
    optimizer, fsynced), as AutoTrainer's end-of-fit checkpoint does."""
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
            if clip:
                nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    if save_to is not None:
        save_to.parent.mkdir(parents=True, exist_ok=True)
        with open(save_to, "wb") as f:
            torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, f)
            f.flush()
            os.fsync(f.fileno())
    return time.perf_counter() - start, steady(stamps), model


class StepCounter:
    def __init__(self):
        self.steps = 0

    def on_step_end(self, trainer):
        self.steps += 1


def autotune_run(data, epochs, progress, run_dir, tensorboard=False, features=False, durable=False):
    """`durable`: the time until the end checkpoint (written in the background) is on disk, not until fit returns."""
    model = make_model()
    stamps = []

    def step(model, batch):
        stamps.append(time.perf_counter())
        loss = nn.functional.cross_entropy(model(batch[0]), batch[1])
        return (loss, len(batch[1])) if features else loss

    extra = {"clip_grad_norm": 1.0, "callbacks": [StepCounter()]} if features else {}
    trainer = AutoTrainer(model, data, step_fn=step,
                          optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3), batch_size=BATCH, device="cpu",
                          policies="default", progress=progress, run_dir=run_dir, tensorboard=tensorboard, **extra)
    start = time.perf_counter()
    trainer.fit(epochs=epochs)
    if durable:
        trainer.checkpointer.wait()
    wall = time.perf_counter() - start
    trainer.close()
    return wall, steady(stamps), model


TINY_BATCH = 32


def tiny_cost(loop: str, steps: int, run_dir: Path) -> float:
    """Mean seconds per step on Linear(8, 2), batch 32, one thread, over the second half of the run
    (past the warm-up, the run log's every-step stretch, and the input policies' trials: a loop
    this small waits on its loader, so the default preset tries workers and a cache first):
    where the model costs next to nothing, so what a loop adds shows."""
    torch.manual_seed(0)
    x, y = torch.randn(TINY_BATCH, 8), torch.randint(0, 2, (TINY_BATCH,))
    model = nn.Linear(8, 2)
    stamps = [0.0]
    if loop == "plain + DataLoader":  # what AutoTrainer is compared with: it loads its own batches
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        for xs, ys in DataLoader(TensorDataset(x.repeat(steps, 1), y.repeat(steps)), batch_size=TINY_BATCH):
            nn.functional.cross_entropy(model(xs), ys).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            stamps.append(time.perf_counter())
    elif loop == "plain":
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(steps):
            nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            stamps.append(time.perf_counter())
    elif loop.startswith("Tuner"):
        from autotune import Tuner
        policies = [] if "off" in loop else "default"
        with Tuner(model, lambda p: torch.optim.SGD(p, lr=0.1), loss_fn=nn.functional.cross_entropy, device="cpu",
                   policies=policies, monitor="monitor" in loop, run_dir=run_dir,
                   tensorboard="tensorboard" in loop) as tuner:
            for _ in range(steps):
                tuner.step((x, y))
                stamps.append(time.perf_counter())
    else:
        class Stamp(Callback):
            def on_step_end(self, trainer):
                stamps.append(time.perf_counter())

        data = TensorDataset(x.repeat(steps, 1), y.repeat(steps))
        AutoTrainer(model, data, loss_fn=nn.functional.cross_entropy, optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
                    batch_size=TINY_BATCH, device="cpu", policies=[] if "off" in loop else "default",
                    monitor="monitor" in loop, progress=False, run_dir=run_dir, shuffle=False, checkpoint_interval=None,
                    tensorboard="tensorboard" in loop, callbacks=[Stamp()]).fit(epochs=1)
    # The mean, not the median: one step in 32 is measured (cadence.py), and a median would leave those out.
    half = len(stamps) // 2
    return (stamps[-1] - stamps[half]) / (len(stamps) - 1 - half)


def tiny(rounds: int) -> None:
    """autotune's own work per optimizer step, against the same loop by hand (paired by round)."""
    torch.set_num_threads(1)
    loops = ["plain", "Tuner, policies off", "Tuner, default", "plain + DataLoader", "AutoTrainer, policies off",
             "AutoTrainer, default", "AutoTrainer, default + monitor"]
    if importlib.util.find_spec("tensorboard"):
        loops.append("AutoTrainer, default + tensorboard")
    cost = {name: [] for name in loops}
    fresh_run_dir("runs/bench-overhead-tiny")
    for r in range(rounds):
        for name in loops[r % len(loops):] + loops[:r % len(loops)]:
            cost[name].append(tiny_cost(name, 3000, Path("runs/bench-overhead-tiny") / f"{r}-{len(cost[name])}-{name}"))
        print(f"round {r}: " + ", ".join(f"{k} {v[-1] * 1e6:.0f}" for k, v in cost.items()), file=sys.stderr)
    lines = [f"Linear(8, 2), SGD, batch {TINY_BATCH}, 1 thread, 3000 steps a run, {rounds} rounds in rotating "
             "order; the mean step interval over the second half of each run (measured steps included). Tuner rows "
             "against the plain loop on "
             "the same tensors each step; AutoTrainer rows (they load their batches) against the plain loop "
             "with a DataLoader over the same data.", "",
             "| loop | step (us, median over rounds) | autotune's own work per step (us, median of paired differences) |",
             "| --- | --- | --- |"]
    for name, values in cost.items():
        loads = name.startswith("AutoTrainer") or name == "plain + DataLoader"  # against the loop that loads too
        base = cost["plain + DataLoader" if loads else "plain"]
        own = median([v - p for v, p in zip(values, base)])
        lines.append(f"| {name} | {median(values) * 1e6:.1f} | {own * 1e6:.1f} |")
    lines += ["", "The check for non-finite gradients before each optimizer step autotune takes (on_nonfinite, "
              "issue 28; part of every AutoTrainer and Tuner row above), alone: "
              "microseconds a call, median of 2000 calls, one thread.", "",
              "| model | gradients | check (us) |", "| --- | --- | --- |"]
    for name, model in (("Linear(8, 2)", nn.Linear(8, 2)), ("MLP 784-1024-1024-10", make_model())):
        lines.append(f"| {name} | {sum(p.numel() for p in model.parameters()) * 4 / 2**20:.2f} MiB | "
                     f"{finite_check_cost(model) * 1e6:.1f} |")
    write_results("overhead_tiny", "Overhead per step on a tiny model: autotune's own work (CPU)", lines)


SHORT_WIDTH = 512


def short_run(loop: str, data: TensorDataset, run_dir: Path) -> tuple[float, float, nn.Module, list[dict]]:
    """One 2-epoch run of `loop` ("hand loop" or "AutoTrainer, default"): wall time, median step
    interval, the final model, and AutoTrainer's journal (the decisions its policies made)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(FEATURES, SHORT_WIDTH), nn.ReLU(), nn.Linear(SHORT_WIDTH, SHORT_WIDTH), nn.ReLU(),
                          nn.Linear(SHORT_WIDTH, CLASSES))
    stamps: list[float] = []
    start = time.perf_counter()
    if loop.startswith("hand loop"):
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        sampler = EpochSampler(len(data), shuffle=True, seed=0)
        loader = DataLoader(data, batch_size=BATCH, sampler=sampler)
        if "gathered" in loop:  # the batch as one gather per tensor, what AutoTrainer's loader does
            loader = DataLoader(range(len(data)), batch_size=BATCH, sampler=sampler,
                                collate_fn=lambda rows: [t[torch.tensor(rows)] for t in data.tensors])
        for epoch in range(2):
            sampler.set_epoch(epoch)
            for x, y in loader:
                stamps.append(time.perf_counter())
                nn.functional.cross_entropy(model(x), y).backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
        return time.perf_counter() - start, steady(stamps), model, []

    class Stamp(Callback):
        def on_step_end(self, trainer):
            stamps.append(time.perf_counter())

    trainer = AutoTrainer(model, data, loss_fn=nn.functional.cross_entropy,
                          optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3), batch_size=BATCH, device="cpu",
                          policies="default", progress=False, run_dir=run_dir, callbacks=[Stamp()])
    trainer.fit(epochs=2)
    wall = time.perf_counter() - start
    trainer.close()
    from autotune.run_folder.checkpoint_files import wait_for_writes
    from autotune.observe.journal import read_journal

    wait_for_writes()
    return wall, steady(stamps), model, list(read_journal(run_dir / "events.jsonl"))


def short(rounds: int) -> None:
    """Issue 45: what the default preset costs a short run where nothing is wrong (an in-memory
    dataset, 2-5 ms steps, 2 epochs), side by side with a hand loop over the same DataLoader order."""
    data = make_data()
    fresh_run_dir("runs/bench-overhead-short")
    loops = ["hand loop", "hand loop, gathered batches", "AutoTrainer, default"]
    for loop in loops:  # warm-up: first-touch allocations, thread pools, torch._dynamo's import
        short_run(loop, data, Path("runs/bench-overhead-short") / f"warm-{loop[0]}")
    walls = {name: [] for name in loops}
    steps = {name: [] for name in loops}
    decisions: list[str] = []
    for r in range(rounds):
        for name in loops[r % 3:] + loops[:r % 3]:
            wall, step, model, records = short_run(name, data, Path("runs/bench-overhead-short") / f"{r}-{len(name)}")
            walls[name].append(wall)
            steps[name].append(step)
            decisions += [f"{x['policy']}: {x['reason']}" for x in records if x["kind"] == "action"]
            decisions += [f"loader rebuilt: {x['num_workers']} workers" for x in records if x["kind"] == "loader_rebuilt"]
        print(f"round {r}: " + ", ".join(f"{k} {v[-1]:.3f}s" for k, v in walls.items()), file=sys.stderr)
    hand, auto = short_run("hand loop", data, Path("unused"))[2], short_run(loops[-1], data,
                                                                          Path("runs/bench-overhead-short/check"))[2]
    same = all(torch.allclose(p, q, rtol=1e-5, atol=1e-6) for p, q in zip(hand.parameters(), auto.parameters()))
    base, base_step = median(walls["hand loop"]), median(steps["hand loop"])
    lines = [f"MLP {FEATURES}-{SHORT_WIDTH}-{SHORT_WIDTH}-{CLASSES}, AdamW, a TensorDataset of {SAMPLES} samples in "
             f"memory, batch {BATCH}, 2 epochs ({2 * SAMPLES // BATCH} steps) a run, {rounds} rounds alternating; "
             f"AutoTrainer with the default preset (monitor, journal, end-of-fit checkpoint on) against a hand loop "
             f"over a DataLoader in the same order. Same final weights: {same}.", "",
             "| loop | median run (s) | ratio | median step (ms) | ratio |", "| --- | --- | --- | --- | --- |"]
    for name in loops:
        lines.append(f"| {name} | {median(walls[name]):.3f} | {median(walls[name]) / base:.3f} | "
                     f"{median(steps[name]) * 1e3:.2f} | {median(steps[name]) / base_step:.3f} |")
    gathered = median(walls["hand loop, gathered batches"])
    lines += ["", "Per-round run ratios to the hand loop: " + ", ".join(
                  f"{a / h:.3f}" for a, h in zip(walls[loops[-1]], walls["hand loop"])),
              "", f"AutoTrainer's own cost, against the hand loop that gathers its batches as AutoTrainer's loader "
                  f"does (a TensorDataset: data/tensors.py): {median(walls[loops[-1]]) / gathered:.3f}.",
              "", f"The policies' decisions over all rounds: {len(decisions)}"
              + ("" if not decisions else " (" + "; ".join(sorted(set(decisions))) + ")") + "."]
    write_results("overhead_short", "Overhead of a short run: AutoTrainer's default preset vs a hand loop (CPU)", lines)


def finite_check_cost(model: nn.Module) -> float:
    """Seconds per call of the non-finite check over `model`'s gradients (the optimizer step's own)."""
    from autotune.ranks.distributed import Solo
    from autotune.step.optimizer_step import OptimizerStep
    from autotune.common.progress import Progress

    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    stepper = OptimizerStep(model, optimizer, None, device=torch.device("cpu"), ranks=Solo(), counters=Progress())
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    times = []
    for _ in range(2000):
        start = time.perf_counter()
        assert stepper._gradients_finite()
        times.append(time.perf_counter() - start)
    return median(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--compare-with", default=None, help="a checkout of an earlier autotune (its root folder)")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--tiny", action="store_true", help="only autotune's own per-step cost on a tiny model")
    parser.add_argument("--short", action="store_true", help="only a short run of 2-5 ms steps (issue 45)")
    args = parser.parse_args()
    if args.tiny:
        tiny(args.rounds)
        return
    if args.short:
        short(args.rounds)
        return
    data = make_data()
    run_dir = Path("runs/bench-overhead")
    if args.child:  # one default AutoTrainer run for --compare-with, in whatever autotune PYTHONPATH gives
        wall, step, _ = autotune_run(data, args.epochs, False, Path(args.child))
        import autotune
        print(json.dumps({"wall": wall, "step": step, "autotune": autotune.__file__}))
        return
    fresh_run_dir(run_dir)  # an earlier invocation's runs: each AutoTrainer here starts a new one
    loops = {
        "plain": lambda r: plain_run(data, args.epochs),
        "autotune": lambda r: autotune_run(data, args.epochs, False, run_dir / f"a{r}"),
        "autotune, end checkpoint on disk": lambda r: autotune_run(data, args.epochs, False, run_dir / f"d{r}",
                                                                   durable=True),
        "autotune+bar": lambda r: autotune_run(data, args.epochs, True, run_dir / f"b{r}"),
        "plain+clip": lambda r: plain_run(data, args.epochs, clip=True),
        "plain+end checkpoint": lambda r: plain_run(data, args.epochs, save_to=run_dir / f"p{r}" / "end.pt"),
        "autotune+clip+items+callback": lambda r: autotune_run(data, args.epochs, False, run_dir / f"f{r}",
                                                               features=True),
    }
    if args.compare_with:
        def child(tree, tag):
            def run(r):
                env = {**os.environ, "PYTHONPATH": str(tree)}
                out = subprocess.run([sys.executable, __file__, "--epochs", str(args.epochs), "--child",
                                      str(run_dir / f"{tag}{r}")], env=env, capture_output=True, text=True, check=True)
                figures = json.loads(out.stdout.strip().splitlines()[-1])
                assert figures["autotune"].startswith(str(tree)), (figures["autotune"], tree)
                return figures["wall"], figures["step"], None
            return run
        loops["child: this tree"] = child(Path(__file__).parents[1], "c")
        loops["child: --compare-with"] = child(Path(args.compare_with), "o")
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
    lines += ["", "A run includes AutoTrainer's once-per-fit costs: the monitor process's start-up (~0.2 s of a "
              "core, under SCHED_IDLE) and the end-of-fit checkpoint, taken before fit returns and written in the "
              "background ('autotune'), or until it is on disk ('autotune, end checkpoint on disk'); 'plain+end "
              "checkpoint' is the hand loop that writes the same (weights and AdamW state, fsynced) at its end. The "
              "step columns are the median interval between steps."]
    whole, saving = median(times["autotune"]), median(times["plain+end checkpoint"])
    durable = median(times["autotune, end checkpoint on disk"])
    lines += ["", f"Whole fit, autotune / plain+end checkpoint: {whole / saving:.3f} (until the checkpoint is on disk: "
              f"{durable / saving:.3f}); per round: "
              + ", ".join(f"{a / p:.3f}" for a, p in zip(times["autotune"], times["plain+end checkpoint"]))]
    lines += ["", "Per-round ratios (autotune / plain): "
              + ", ".join(f"{a / p:.3f}" for a, p in zip(times["autotune"], times["plain"]))]
    features, clip = median(steps["autotune+clip+items+callback"]), median(steps["plain+clip"])
    lines += ["", f"Issue 14's features on (clip_grad_norm, (loss, n_items), a callback) vs a hand loop that clips: "
              f"median step {features / clip:.3f}; vs autotune with them off: {features / median(steps['autotune']):.3f}."]
    if args.compare_with:
        new, old = median(steps["child: this tree"]), median(steps["child: --compare-with"])
        lines += [f"This tree vs `{args.compare_with}` (default loop, features off, child processes): median step "
                  f"{new * 1e3:.2f} vs {old * 1e3:.2f} ms, ratio {new / old:.3f}; per round: "
                  + ", ".join(f"{a / b:.3f}" for a, b in zip(steps["child: this tree"], steps["child: --compare-with"]))]
    write_results("overhead", "Overhead: AutoTrainer vs a hand-written loop (CPU)", lines)


if __name__ == "__main__":
    main()
