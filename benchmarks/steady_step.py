"""What a steady step costs: each way of training with autotune against the same training without it.

Nothing happens in these runs (no cap, no OOM, no alarm), so whatever autotune adds to a step is
its own work. Six pairs, each in its own process, on one torch thread:

- `floor`: a hand loop that checks its gradients for NaN/inf before each optimizer step with the
  check autotune makes (step.py's `all_finite`), vs the same loop without it: what no steady step
  that keeps that promise can skip, as a reference for the rows below
- `loop`: `Tuner.step` in a hand-written loop vs the same loop calling backward and step itself
- `interleaved`: the same two and the floor's checked hand loop, stepped in turn batch by batch in
  one loop and timed step by step, so all three see the VM at the same moment (its rows: chunks of
  a round's steps, not rounds; its last column: the floor's side over the plain one)
- `autotrainer`: `AutoTrainer.fit` vs a hand loop over a DataLoader of the same data
- `hf`: `AutoTuneTrainer` vs HF's `Trainer`
- `lightning`: `AutoTuneStrategy` vs Lightning's own strategy

and two sizes of step: `1ms` (a token MLP, 8 sequences of 20 tokens a batch, width 192: about 1 ms
on one core) and `10ms` (32 sequences of 32 tokens, width 768). Every pair alternates rounds
(without, with, with, without, ...) in one process; a round is a fresh model and trainer and a
size's steps, and its figure is the median interval between consecutive steps after its first
250 (start-up and warm-up: the monitor process starts once per run; the steps log writes each of
its first 200 steps). The two sides of a round run next to each other, at the same speed of this
shared VM (which drifts by tens of percent over seconds): the ratio and the difference reported
are the medians of the rounds' own, with the middle half of the ratios. The pairs whose autotune
side checks the gradients itself (`loop`, `autotrainer`) run it a third time with that check
answered without looking, to tell its share. autotune runs with its defaults: the default preset,
the monitor process on; AutoTrainer without its progress bar (the hand loop has none).

With `--torchrun`, the two-rank rows as well: `Tuner.step` vs a hand loop on a DDP model, and
`Tuner(shard=True)` vs a hand loop on an FSDP2 model (gloo, one thread a rank).

    pip install -e '.[bench]'
    python benchmarks/steady_step.py [--rounds 11] [--pairs floor,loop,interleaved,autotrainer,hf,lightning] [--sizes 1ms,10ms]
                                     [--torchrun]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import write_results  # noqa: E402

VOCAB, DIM, CLASSES = 1000, 64, 4
SIZES = {  # name: (tokens a sequence, sequences a batch, MLP width, steps a round)
    "1ms": (20, 8, 192, 700),
    "10ms": (32, 32, 768, 350),
}
PAIRS = {
    "floor": "the floor: a hand loop that checks its gradients for NaN/inf as autotune does, vs backward + step",
    "loop": "your loop: `Tuner.step` vs backward + step",
    "interleaved": "your loop, step by step: `Tuner.step` and backward + step (and the floor's, checked) taken in turn in one loop",
    "autotrainer": "`AutoTrainer` vs a hand loop over a DataLoader",
    "hf": "HF: `AutoTuneTrainer` vs `Trainer`",
    "lightning": "Lightning: `AutoTuneStrategy` vs its own strategy",
    "ddp": "torchrun, 2 ranks, DDP: `Tuner.step` vs a hand loop",
    "fsdp": "torchrun, 2 ranks, FSDP2: `Tuner(shard=True).step` vs a hand loop",
}
WARM_UP = 250


def parts(size: str, copies: int = 1):
    """The dataset, its collate function and a model factory for one size (`copies`: the round's
    steps `copies` times over: under torchrun every rank takes its share of them)."""
    import torch
    from torch import nn
    from torch.utils.data import Dataset

    tokens, batch, width, steps = SIZES[size]

    class Sequences(Dataset):
        def __init__(self) -> None:
            g = torch.Generator().manual_seed(0)
            self.items = torch.randint(0, VOCAB, (batch * steps * copies, tokens), generator=g)

        def __len__(self) -> int:
            return len(self.items)

        def __getitem__(self, i: int) -> dict:
            return {"input_ids": self.items[i], "labels": i % CLASSES}

    def collate(items: list[dict]) -> dict:
        return {"input_ids": torch.stack([it["input_ids"] for it in items]),
                "labels": torch.tensor([it["labels"] for it in items])}

    class TokenMLP(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.embed = nn.Embedding(VOCAB, DIM)
            self.mlp = nn.Sequential(nn.Linear(DIM, width), nn.GELU(), nn.Linear(width, DIM))
            self.head = nn.Linear(DIM, CLASSES)

        def forward(self, input_ids, labels):  # HF's calling convention: a dict with the loss
            logits = self.head(self.mlp(self.embed(input_ids)).mean(dim=1))
            return {"loss": nn.functional.cross_entropy(logits, labels)}

    return Sequences(), collate, TokenMLP, batch


NO_CHECK_COLUMN = {"floor": "- (the whole row)", "hf": "- (its trainer steps)", "lightning": "- (its trainer steps)"}
CHECKED = ("loop", "autotrainer")  # the pairs whose autotune side checks the gradients itself (on_nonfinite)


def one_round(pair: str, side: str, size: str, run_dir: str) -> list[float]:
    """One run of `side` ("with" or "without" autotune, or "unchecked": with autotune, its check
    for non-finite gradients replaced by a yes, to tell its share): the time stamps of its steps."""
    import torch
    from torch.utils.data import DataLoader

    from autotune.step.optimizer_step import OptimizerStep

    if side == "unchecked":  # measurement only: the check is part of every real step
        checked, OptimizerStep._gradients_finite = OptimizerStep._gradients_finite, lambda self: True
        try:
            return one_round(pair, "with", size, run_dir)
        finally:
            OptimizerStep._gradients_finite = checked
    data, collate, TokenMLP, batch = parts(size)
    model = TokenMLP()
    stamps: list[float] = []
    with_autotune = side == "with"
    if pair == "floor":  # what no steady step can skip: the check before the optimizer step (step.py's all_finite)
        from autotune.step.finite import all_finite

        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        params = list(model.parameters())
        for b in DataLoader(data, batch_size=batch, collate_fn=collate):
            model(**b)["loss"].backward()
            if not with_autotune or all_finite([p.grad for p in params if p.grad is not None]):
                optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            stamps.append(time.perf_counter())
    elif pair == "loop":
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
        loader = DataLoader(data, batch_size=batch, collate_fn=collate)
        if with_autotune:
            from autotune import Tuner

            with Tuner(model, optimizer, device="cpu", run_dir=run_dir) as tuner:
                for b in loader:
                    tuner.step(b, lambda m, micro: m(**micro)["loss"])
                    stamps.append(time.perf_counter())
        else:
            for b in loader:
                model(**b)["loss"].backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                stamps.append(time.perf_counter())
    elif pair == "autotrainer":
        def step(m, micro):
            stamps.append(time.perf_counter())
            return m(**micro)["loss"]

        if with_autotune:
            from autotune import AutoTrainer

            trainer = AutoTrainer(model, data, step_fn=step, optimizer=lambda p: torch.optim.SGD(p, lr=0.01),
                                  batch_size=batch, collate_fn=collate, device="cpu", run_dir=run_dir, progress=False)
            trainer.fit(epochs=1)
            trainer.close()
        else:
            optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
            generator = torch.Generator().manual_seed(0)
            model.train()
            for b in DataLoader(data, batch_size=batch, collate_fn=collate, shuffle=True, generator=generator):
                step(model, b).backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
    elif pair == "hf":
        from transformers import Trainer, TrainerCallback, TrainingArguments

        from autotune.integrations.transformers import AutoTuneTrainer

        class Stamp(TrainerCallback):
            def on_step_end(self, *args, **kwargs):
                stamps.append(time.perf_counter())

        args = TrainingArguments(output_dir=run_dir, per_device_train_batch_size=batch, num_train_epochs=1,
                                 learning_rate=0.01, optim="sgd", lr_scheduler_type="constant", save_strategy="no",
                                 logging_strategy="no", report_to="none", use_cpu=True,
                                 disable_tqdm=True, seed=0)
        cls = AutoTuneTrainer if with_autotune else Trainer
        cls(model=model, args=args, train_dataset=data, data_collator=collate, callbacks=[Stamp()]).train()
    elif pair == "lightning":
        import lightning as L

        from autotune.integrations.lightning import AutoTuneStrategy

        class Module(L.LightningModule):
            def __init__(self) -> None:
                super().__init__()
                self.net = model

            def training_step(self, b, batch_idx):
                return self.net(**b)["loss"]

            def configure_optimizers(self):
                return torch.optim.SGD(self.parameters(), lr=0.01)

        class Stamp(L.Callback):
            def on_train_batch_end(self, *args):
                stamps.append(time.perf_counter())

        trainer = L.Trainer(max_epochs=1, accelerator="cpu", devices=1, callbacks=[Stamp()], logger=False,
                            strategy=AutoTuneStrategy("cpu") if with_autotune else "auto",
                            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                            default_root_dir=run_dir)
        trainer.fit(Module(), DataLoader(data, batch_size=batch, collate_fn=collate))
    else:
        raise ValueError(f"unknown pair {pair!r}")
    return stamps


def distributed_round(pair: str, side: str, size: str, run_dir: str) -> list[float]:
    """One run of a two-rank pair on this rank (under torchrun): its step time stamps."""
    import torch
    import torch.distributed as dist
    from torch.utils.data import DataLoader
    from torch.utils.data.distributed import DistributedSampler

    data, collate, TokenMLP, batch = parts(size, copies=dist.get_world_size())  # a round's steps on every rank
    model = TokenMLP()
    loader = DataLoader(data, batch_size=batch, collate_fn=collate,
                        sampler=DistributedSampler(data, shuffle=False))
    stamps: list[float] = []
    if side == "with":
        from autotune import Tuner

        with Tuner(model, lambda p: torch.optim.SGD(p, lr=0.01), device="cpu", run_dir=run_dir,
                   shard=pair == "fsdp") as tuner:
            for b in loader:
                tuner.step(b, lambda m, micro: m(**micro)["loss"])
                stamps.append(time.perf_counter())
        return stamps
    if pair == "ddp":
        wrapped = torch.nn.parallel.DistributedDataParallel(model)
    else:
        from torch.distributed.fsdp import fully_shard

        for layer in (model.embed, model.mlp, model.head):
            fully_shard(layer)
        wrapped = fully_shard(model)
    optimizer = torch.optim.SGD(wrapped.parameters(), lr=0.01)
    for b in loader:
        wrapped(**b)["loss"].backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        stamps.append(time.perf_counter())
    dist.barrier()
    return stamps


def interval(stamps: list[float]) -> float:
    """The median interval between consecutive steps after the warm-up."""
    return statistics.median(b - a for a, b in zip(stamps[WARM_UP:], stamps[WARM_UP + 1:]))


def measure(pair: str, size: str, rounds: int, distributed: bool = False) -> dict:
    """`rounds` alternating rounds of the pair in this process: each side's interval per round."""
    import torch

    torch.set_num_threads(1)  # a ~1 ms step on two threads of a shared 2-core VM is mostly noise
    run = distributed_round if distributed else one_round
    sides = ("without", "with", "unchecked") if pair in CHECKED and not distributed else ("without", "with")
    figures: dict[str, list[float]] = {side: [] for side in sides}
    run_dir = f"runs/bench-steady/{pair}-{size}"
    for side in sides:  # warm-up: imports, first-call costs
        run(pair, side, size, run_dir)
    for r in range(rounds):
        for side in sides if r % 2 == 0 else sides[::-1]:
            figures[side].append(interval(run(pair, side, size, run_dir)))
    return figures


def interleaved(size: str, steps: int) -> dict:
    """`Tuner.step`, the plain loop's step, and the plain loop's step with autotune's check of the
    gradients (the floor), taken in turn batch by batch in one loop: all three at the same moment
    of the VM's drift, so their medians compare to a few microseconds where rounds of seconds each
    cannot (the 10 ms rows). Each side's step is timed around its call; the order rotates, so each
    side in turn starts with caches another one filled."""
    import torch
    from torch.utils.data import DataLoader

    from autotune import Tuner
    from autotune.step.finite import all_finite

    torch.set_num_threads(1)
    data, collate, TokenMLP, batch = parts(size)
    models = {side: TokenMLP() for side in ("without", "floor", "with")}
    optimizers = {side: torch.optim.SGD(model.parameters(), lr=0.01) for side, model in models.items()}
    times: dict[str, list[float]] = {side: [] for side in models}
    loss_of = lambda m, micro: m(**micro)["loss"]  # noqa: E731
    sides = list(models)
    with Tuner(models["with"], optimizers["with"], device="cpu",
               run_dir=f"runs/bench-steady/interleaved-{size}") as tuner:
        done = 0
        while done < steps:
            for i, b in enumerate(DataLoader(data, batch_size=batch, collate_fn=collate)):
                for side in sides[i % 3:] + sides[:i % 3]:
                    start = time.perf_counter()
                    if side == "with":
                        tuner.step(b, loss_of)
                    else:
                        model, optimizer = models[side], optimizers[side]
                        model(**b)["loss"].backward()
                        if side == "without" or all_finite([p.grad for p in model.parameters() if p.grad is not None]):
                            optimizer.step()
                        optimizer.zero_grad(set_to_none=True)
                    times[side].append(time.perf_counter() - start)
                done += 1
                if done >= steps:
                    break
    # In chunks of a round's steps after the warm-up: each chunk's medians pair as a round's do.
    chunk = SIZES[size][3]
    return {side: [statistics.median(values[at:at + chunk]) for at in range(WARM_UP, len(values) - chunk // 2, chunk)]
            for side, values in times.items()}


def in_process(pair: str, size: str, rounds: int) -> dict:
    proc = subprocess.run([sys.executable, __file__, "--worker", pair, size, str(rounds)], capture_output=True,
                          text=True, timeout=3600)
    if proc.returncode != 0:
        raise RuntimeError(f"{pair} {size} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def under_torchrun(pair: str, size: str, rounds: int) -> dict:
    out = Path(f"runs/bench-steady/{pair}-{size}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    for attempt in (1, 2):
        # Once again where a rank aborted in C++ ("terminate called without an active exception": gloo,
        # seen about once in 40 two-rank jobs here, pytorch#179291); twice is a real failure.
        proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone",
                               __file__, "--rank-worker", pair, size, str(rounds), str(out)], timeout=3600,
                              env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True)
        if proc.returncode == 0:
            return json.loads(out.read_text())
        print(f"{pair} {size}: attempt {attempt} failed: {proc.stderr[-1500:]}", file=sys.stderr)
    raise RuntimeError(f"{pair} {size} failed twice under torchrun")


def row(pair: str, size: str, figures: dict) -> str:
    """A round's sides ran next to each other, at the machine's speed of the moment: the ratio and
    the difference are the medians of the rounds' own (paired), with the quartiles of the ratios."""
    without, with_ = figures["without"], figures["with"]
    ratios = sorted(w / wo for w, wo in zip(with_, without))
    own = statistics.median(w - wo for w, wo in zip(with_, without))
    quartiles = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else ratios * 3
    if "unchecked" in figures:  # the autotune side again, its check answered without looking
        check = f"{statistics.median(w - u for w, u in zip(with_, figures['unchecked'])) * 1e6:+.0f}"
    elif "floor" in figures:  # the hand loop with the same check, stepped in turn with the others
        check = (f"{statistics.median(f - wo for f, wo in zip(figures['floor'], without)) * 1e6:+.0f} (the hand loop "
                 f"with it: {statistics.median(f / wo for f, wo in zip(figures['floor'], without)):.3f}x)")
    else:
        check = NO_CHECK_COLUMN.get(pair, "- (not told apart)")
    a, b = statistics.median(without), statistics.median(with_)
    return (f"| {PAIRS[pair]} | {size} | {len(ratios)} | {a * 1e3:.3f} | {b * 1e3:.3f} | "
            f"{statistics.median(ratios):.3f} | {quartiles[0]:.3f}-{quartiles[2]:.3f} | {own * 1e6:+.0f} | {check} |")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=11)
    parser.add_argument("--pairs", default="floor,loop,interleaved,autotrainer,hf,lightning")
    parser.add_argument("--sizes", default="1ms,10ms")
    parser.add_argument("--torchrun", action="store_true", help="the two-rank rows too (ddp, fsdp)")
    parser.add_argument("--worker", nargs=3, help=argparse.SUPPRESS)
    parser.add_argument("--rank-worker", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        pair, size, rounds = args.worker
        figures = (interleaved(size, WARM_UP + SIZES[size][3] * int(rounds)) if pair == "interleaved"
                   else measure(pair, size, int(rounds)))
        print(json.dumps(figures))
        return
    if args.rank_worker:
        import torch.distributed as dist

        pair, size, rounds, out = args.rank_worker
        dist.init_process_group("gloo")
        figures = measure(pair, size, int(rounds), distributed=True)
        if dist.get_rank() == 0:
            Path(out).write_text(json.dumps(figures))
        dist.destroy_process_group()
        return
    import torch

    torch.set_num_threads(1)  # as in every worker (the results file names this process's threads)
    pairs = [pair for pair in args.pairs.split(",") if pair] + (["ddp", "fsdp"] if args.torchrun else [])
    lines = ["| pair | step | rounds | without (ms) | with autotune (ms) | ratio | ratio, middle half of the rounds | "
             "autotune's own (us a step) | of which the non-finite check (us) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for pair in pairs:
        for size in args.sizes.split(","):
            measure_pair = under_torchrun if pair in ("ddp", "fsdp") else in_process
            figures = measure_pair(pair, size, args.rounds)
            print(pair, size, figures, file=sys.stderr)
            lines.append(row(pair, size, figures))
    sizes = "; ".join(f"{name}: {batch} sequences of {tokens} tokens a batch, MLP {DIM}-{width}-{DIM}"
                      for name, (tokens, batch, width, _) in SIZES.items())
    lines += ["", f"Token MLP (embedding {VOCAB}x{DIM}, mean-pooled, {CLASSES} classes), SGD, one torch thread; "
              f"{sizes}. Each pair in its own process, {args.rounds} alternating rounds (without, with, with, "
              f"without, ...), a fresh model and trainer each, a round's figure its median step interval after the "
              f"first {WARM_UP} steps. Ratio and own: the medians of the "
              "rounds' paired ratios and differences (this VM's speed drifts by tens of percent over seconds: "
              "the sides of one round run at the same speed); without/with: the medians of each side. autotune "
              "with its defaults (default preset, monitor process on). The last column: "
              "the same autotune side run a third time, alternating with the others, with its check of the "
              "gradients for NaN/inf before each optimizer step (on_nonfinite, one fused pass over them) "
              "answered without looking; the difference is what the check costs. HF and Lightning step their "
              "own optimizers, so autotune checks nothing there. The floor row's \"with\" side is no autotune: "
              "the hand loop with the same check, what any steady step that keeps that promise pays."]
    write_results("steady_step", "A steady step: autotune's own work, side by side (CPU)", lines)


if __name__ == "__main__":
    main()
