"""Keep your loop or trainer: autotune's integrations vs what each ecosystem offers, when memory need jumps late.

One task for every pair: token sequences in a fixed order, the last tenth 5x longer (padded per
batch), a per-token MLP, SGD, batch 64, one epoch on CPU under RLIMIT_AS: batches of short
sequences fit, the long ones at 64 do not.

- a hand-written loop: `Tuner.step` vs Accelerate's `find_executable_batch_size` (reruns the
  function from its start at 0.9x the batch)
- HF `Trainer`: `AutoTuneTrainer` vs `Trainer(auto_find_batch_size=True)` (the same, through HF)
- Lightning: `AutoTuneStrategy` vs `BatchSizeFinder` (probes on the first batches before
  training) + Lightning's own strategy

Reported: wall time of the epoch, samples trained (in completed optimizer steps; each once is
1536), samples forwarded (all the work, failed attempts included), OOMs or restarts, whether
the run finished. Then each integration's cost per step on a ~1 ms step with no cap: the median
step interval with it vs the same trainer without it (alternating rounds in one process).
Each run is its own process.

Evaluation (`--part eval`, also in a whole run): the long tenth (154 sequences of 160 tokens)
evaluated in one batch under the same kind of cap, where the evaluation's batch does not fit:
HF `evaluate()` with `per_device_eval_batch_size=154` and Lightning `validate()` with a loader of
batch 154, each plain and through autotune. Reported: whether it finished, the eval loss against
the same loss computed uncapped in pieces in the same process, evaluation OOMs survived.

    pip install -e '.[bench]'
    python benchmarks/integrations.py [--trials 3] [--rounds 5] [--part all|late|eval]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import median, write_results  # noqa: E402

SAMPLES, SHORT, LONG, LONG_SHARE = 1536, 32, 160, 0.1
VOCAB, DIM, WIDTH, CLASSES = 1000, 64, 1024, 4
BATCH, BUDGET_MIB = 64, 96
EVALUATED = range(int(SAMPLES * (1 - LONG_SHARE)), SAMPLES)  # the evaluation's samples: the long tenth


class Ledger:
    """Which samples each completed optimizer step trained on (a set per step: an autotune retry of
    the same samples counts once), and every sample a forward saw (the work, retries included)."""

    def __init__(self) -> None:
        self.pending: set[int] = set()
        self.trained = self.forwarded = self.steps = self.starts = 0
        self.final: int | None = None  # the (micro-)batch size in use at the end, where a tool has one

    def saw(self, ids) -> None:
        ids = ids.tolist()
        self.forwarded += len(ids)
        self.pending.update(ids)

    def step_begins(self) -> None:
        self.pending = set()  # what a failed, restarted step saw is not trained

    def step_done(self) -> None:
        self.trained += len(self.pending)
        self.steps += 1
        self.pending = set()

    def figures(self) -> dict:
        return {"trained": self.trained, "forwarded": self.forwarded, "steps": self.steps, "starts": self.starts,
                "final": self.final}


def _parts(tiny: bool = False):
    import torch
    from torch import nn
    from torch.utils.data import Dataset

    samples, short, long, width = (4096, 8, 8, 64) if tiny else (SAMPLES, SHORT, LONG, WIDTH)

    class Sequences(Dataset):
        def __init__(self) -> None:
            g = torch.Generator().manual_seed(0)
            first_long = int(samples * (1 - LONG_SHARE))
            self.items = [torch.randint(0, VOCAB, (long if i >= first_long else short,), generator=g)
                          for i in range(samples)]

        def __len__(self) -> int:
            return len(self.items)

        def __getitem__(self, i: int) -> dict:
            return {"input_ids": self.items[i], "labels": i % CLASSES, "idx": i}

    def collate(items: list[dict]) -> dict:
        return {"input_ids": nn.utils.rnn.pad_sequence([it["input_ids"] for it in items], batch_first=True),
                "labels": torch.tensor([it["labels"] for it in items]), "idx": torch.tensor([it["idx"] for it in items])}

    class TokenMLP(nn.Module):
        """Per-token MLP, mean-pooled: activation memory grows with batch x length."""

        def __init__(self, ledger: Ledger) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.ledger = ledger
            self.embed = nn.Embedding(VOCAB, DIM)
            self.mlp = nn.Sequential(nn.Linear(DIM, width), nn.GELU(), nn.Linear(width, DIM))
            self.head = nn.Linear(DIM, CLASSES)

        def forward(self, input_ids, labels, idx):  # HF's calling convention: a dict with the loss
            if self.training:
                self.ledger.saw(idx)
            logits = self.head(self.mlp(self.embed(input_ids)).mean(dim=1))
            return {"loss": nn.functional.cross_entropy(logits, labels)}

    return Sequences(), collate, TokenMLP


def _warm_up(model, data, collate) -> None:
    batch = collate([data[0], data[1]])
    model(**batch)["loss"].backward()
    model.zero_grad(set_to_none=True)
    model.ledger.__init__()  # the warm-up is not training


# ----------------------------------------------------------------------------- the late-jump runs
def loop_run(tool: str, cap, ledger: Ledger) -> dict:
    import torch
    from torch.utils.data import DataLoader

    data, collate, TokenMLP = _parts()
    model = TokenMLP(ledger)
    _warm_up(model, data, collate)

    class LedgerSGD(torch.optim.SGD):
        def step(self, closure=None):
            out = super().step(closure)
            ledger.step_done()
            return out

    optimizer = LedgerSGD(model.parameters(), lr=0.01, momentum=0.9)
    step_fn = lambda m, batch: m(**batch)["loss"]  # noqa: E731
    if tool == "tuner":
        from autotune import Tuner

        with Tuner(model, optimizer, device="cpu", run_dir="runs/bench-integrations/tuner") as tuner:
            cap()
            start = time.perf_counter()
            for batch in DataLoader(data, batch_size=BATCH, collate_fn=collate):
                ledger.step_begins()
                tuner.step(batch, step_fn)
            ledger.final = tuner.micro_batch_size
            return {"seconds": time.perf_counter() - start, "ooms": tuner.ooms, **ledger.figures()}
    from accelerate.utils import find_executable_batch_size

    state = {"attempts": 0, "final": BATCH}

    @find_executable_batch_size(starting_batch_size=BATCH)
    def train(batch_size):
        state["attempts"] += 1
        state["final"] = batch_size
        for batch in DataLoader(data, batch_size=batch_size, collate_fn=collate):
            ledger.step_begins()
            step_fn(model, batch).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

    cap()
    start = time.perf_counter()
    train()
    ledger.final = state["final"]
    return {"seconds": time.perf_counter() - start, "ooms": state["attempts"] - 1, **ledger.figures()}


def _hf_args(out: str, **kw):
    from transformers import TrainingArguments

    return TrainingArguments(output_dir=out, per_device_train_batch_size=BATCH, num_train_epochs=1, optim="sgd",
                             learning_rate=0.01, lr_scheduler_type="constant", report_to="none", use_cpu=True,
                             save_strategy="no", logging_strategy="no", disable_tqdm=True,
                             train_sampling_strategy="sequential", **kw)


def _hf_ledger_callback(ledger: Ledger):
    from transformers import TrainerCallback

    class Steps(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            ledger.starts += 1  # auto_find_batch_size starts the training loop again after an OOM

        def on_step_begin(self, args, state, control, **kwargs):
            ledger.final = state.train_batch_size
            ledger.step_begins()

        def on_step_end(self, *args, **kwargs):
            ledger.step_done()

    return Steps()


def hf_run(tool: str, cap, ledger: Ledger) -> dict:
    from transformers import Trainer

    from autotune.integrations.transformers import AutoTuneTrainer

    data, collate, TokenMLP = _parts()
    model = TokenMLP(ledger)
    _warm_up(model, data, collate)
    out = f"runs/bench-integrations/{tool}"
    if tool == "hf-autotune":
        trainer = AutoTuneTrainer(model=model, args=_hf_args(out), train_dataset=data, data_collator=collate,
                                  callbacks=[_hf_ledger_callback(ledger)])
    else:
        trainer = Trainer(model=model, args=_hf_args(out, auto_find_batch_size=True), train_dataset=data,
                          data_collator=collate, callbacks=[_hf_ledger_callback(ledger)])
    cap()
    start = time.perf_counter()
    trainer.train()
    seconds = time.perf_counter() - start
    if tool == "hf-autotune":
        ledger.final = trainer.micro_batch_size
        return {"seconds": seconds, "ooms": trainer.tuner.ooms, **ledger.figures()}
    return {"seconds": seconds, "ooms": ledger.starts - 1, **ledger.figures()}


def lightning_run(tool: str, cap, ledger: Ledger) -> dict:
    import lightning as L
    import torch
    from torch.utils.data import DataLoader

    from autotune.integrations.lightning import AutoTuneStrategy

    data, collate, TokenMLP = _parts()

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net, self.batch_size = TokenMLP(ledger), BATCH

        def training_step(self, batch, batch_idx):
            return self.net(**batch)["loss"]

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)

        def train_dataloader(self):
            return DataLoader(data, batch_size=self.batch_size, collate_fn=collate)

    class Steps(L.Callback):
        searching = tool == "pl-batch-size-finder"  # until BatchSizeFinder's on_fit_start (before ours) is done

        def on_fit_start(self, *args):
            self.searching = False

        def on_train_batch_start(self, trainer, pl_module, *args):
            ledger.final = pl_module.batch_size
            ledger.step_begins()

        def on_train_batch_end(self, *args):
            if self.searching:
                ledger.step_begins()  # a trial step of the search: its weights are restored afterwards
                return
            ledger.step_done()

    module = Module()
    _warm_up(module.net, data, collate)
    callbacks = [Steps()]
    if tool == "pl-batch-size-finder":
        # Searching up to the batch the others use, so every tool trains the same optimizer batch.
        callbacks.insert(0, L.pytorch.callbacks.BatchSizeFinder(mode="power", max_val=BATCH))
    strategy = AutoTuneStrategy("cpu") if tool == "pl-autotune" else "auto"
    trainer = L.Trainer(max_epochs=1, accelerator="cpu", devices=1, strategy=strategy, callbacks=callbacks,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, default_root_dir=f"runs/bench-integrations/{tool}")
    cap()
    start = time.perf_counter()
    trainer.fit(module)
    ooms = strategy.tuner.ooms if tool == "pl-autotune" else None
    if tool == "pl-autotune":
        ledger.final = strategy.micro_batch_size
    return {"seconds": time.perf_counter() - start, "ooms": ooms, **ledger.figures()}


def late_jump(spec: dict) -> dict:
    """One run in this process: build, warm up, cap, one epoch; what happened, crash included."""
    from autotune.memory.limits import cap_address_space, single_malloc_arena
    from autotune.common.oom import is_oom

    single_malloc_arena()
    runner = {"tuner": loop_run, "accelerate": loop_run, "hf-autotune": hf_run, "hf-auto-find": hf_run,
              "pl-autotune": lightning_run, "pl-batch-size-finder": lightning_run}[spec["tool"]]
    ledger = Ledger()
    started = [0.0]

    def cap():
        cap_address_space(spec["budget_mib"] * 2**20)
        started[0] = time.perf_counter()

    try:
        return {"finished": True, **runner(spec["tool"], cap, ledger)}
    except Exception as exc:  # the run died: what it had done by then is the result
        if not is_oom(exc):
            raise
        return {"finished": False, "seconds": time.perf_counter() - started[0], **ledger.figures(),
                "error": str(exc).splitlines()[0][:120]}


# ----------------------------------------------------------------------------- evaluation too big
def evaluation(spec: dict) -> dict:
    """One evaluation in this process: build, reference loss uncapped, cap, evaluate; what happened."""
    import torch
    from torch.utils.data import DataLoader, Subset

    from autotune.memory.limits import cap_address_space, single_malloc_arena
    from autotune.common.oom import is_oom

    single_malloc_arena()
    tool = spec["tool"]
    data, collate, TokenMLP = _parts()
    evals = Subset(data, EVALUATED)
    model = TokenMLP(Ledger())
    model.eval()
    with torch.no_grad():  # the reference: the same loss uncapped, in pieces of 16, weighted by samples
        pieces = [(model(**batch)["loss"].item(), len(batch["labels"]))
                  for batch in DataLoader(evals, batch_size=16, collate_fn=collate)]
    reference = sum(loss * n for loss, n in pieces) / len(evals)
    start = time.perf_counter()
    try:
        if tool.startswith("hf"):
            from transformers import Trainer

            from autotune.integrations.transformers import AutoTuneTrainer

            args = _hf_args(f"runs/bench-integrations/{tool}", per_device_eval_batch_size=len(evals))
            cls = AutoTuneTrainer if tool == "hf-autotune-eval" else Trainer
            kwargs = {"tuner_options": {"monitor": False}} if cls is AutoTuneTrainer else {}
            trainer = cls(model=model, args=args, eval_dataset=evals, data_collator=collate, **kwargs)
            cap_address_space(spec["budget_mib"] * 2**20)
            start = time.perf_counter()
            loss = trainer.evaluate()["eval_loss"]
            ooms = trainer.evaluator.ooms if cls is AutoTuneTrainer else None
        else:
            import lightning as L

            from autotune.integrations.lightning import AutoTuneStrategy

            class Module(L.LightningModule):
                def __init__(self) -> None:
                    super().__init__()
                    self.net = model

                def validation_step(self, batch, batch_idx):
                    loss = self.net(**batch)["loss"]
                    self.log("val_loss", loss, batch_size=len(batch["labels"]))
                    return loss

            strategy = AutoTuneStrategy("cpu", tuner_options={"monitor": False}) if tool == "pl-autotune-eval" \
                else "auto"
            trainer = L.Trainer(accelerator="cpu", devices=1, strategy=strategy, logger=False, enable_progress_bar=False,
                                enable_model_summary=False, default_root_dir=f"runs/bench-integrations/{tool}")
            module = Module()
            cap_address_space(spec["budget_mib"] * 2**20)
            start = time.perf_counter()
            loss = trainer.validate(module, DataLoader(evals, batch_size=len(evals), collate_fn=collate),
                                    verbose=False)[0]["val_loss"]
            ooms = strategy._evaluator.ooms if tool == "pl-autotune-eval" else None
        return {"finished": True, "seconds": time.perf_counter() - start, "loss": float(loss),
                "reference": reference, "ooms": ooms}
    except Exception as exc:  # the evaluation died: which error
        if not is_oom(exc):
            raise
        return {"finished": False, "seconds": time.perf_counter() - start, "reference": reference,
                "error": str(exc).splitlines()[0][:100]}


EVAL_TOOLS = {
    "hf-plain-eval": ("HF Trainer", "`Trainer.evaluate()`"),
    "hf-autotune-eval": ("HF Trainer", "autotune `AutoTuneTrainer.evaluate()`"),
    "pl-plain-eval": ("Lightning", "`Trainer.validate()`, Lightning's strategy"),
    "pl-autotune-eval": ("Lightning", "`Trainer.validate()`, autotune `AutoTuneStrategy`"),
}


def evaluation_table(trials: int, budget_mib: int) -> list[str]:
    results: dict[str, list[dict]] = {tool: [] for tool in EVAL_TOOLS}
    for trial in range(trials):
        for tool in EVAL_TOOLS:
            r = run("eval", {"tool": tool, "budget_mib": budget_mib})
            results[tool].append(r)
            print(trial, tool, r, file=sys.stderr)
    lines = [f"## Evaluation batch too big: {len(EVALUATED)} sequences of {LONG} tokens in one batch, "
             f"RLIMIT_AS = virtual size + {budget_mib} MiB", "",
             f"{trials} trials per tool, each its own process. Loss error: against the same loss computed uncapped "
             "in pieces of 16 in the same process.", "",
             "| trainer | evaluation | finished | loss error (max) | eval OOMs survived | wall (s) |",
             "| --- | --- | --- | --- | --- | --- |"]
    for tool, (where, name) in EVAL_TOOLS.items():
        rs = results[tool]
        done = [r for r in rs if r["finished"]]
        if not done:
            lines.append(f"| {where} | {name} | no: {len(rs)}/{len(rs)} raised (`{rs[0]['error']}`) | - | - | - |")
            continue
        error = max(abs(r["loss"] - r["reference"]) for r in done)
        ooms = [r["ooms"] for r in done if r["ooms"] is not None]
        lines.append(f"| {where} | {name} | {len(done)}/{len(rs)} | {error:.1e} | "
                     f"{int(median(ooms)) if ooms else 'n/a'} | {median([r['seconds'] for r in done]):.2f} |")
    return lines


# ----------------------------------------------------------------------------- cost per step
def overhead(spec: dict) -> dict:
    """Median step interval with and without the integration, alternating rounds, no cap."""
    import torch
    from torch.utils.data import DataLoader

    pair, rounds = spec["pair"], spec["rounds"]
    torch.set_num_threads(1)  # a ~1 ms step on two threads of a shared 2-core VM is mostly noise
    ledger = Ledger()
    data, collate, TokenMLP = _parts(tiny=True)
    stamps: dict[str, list[float]] = {"with": [], "without": []}

    def intervals(times: list[float]) -> list[float]:
        # The first 100 steps warm up (and overlap the monitor process's start-up, once per run).
        return [b - a for a, b in zip(times[100:], times[101:])]

    for _ in range(rounds):
        for side in ("without", "with"):
            model = TokenMLP(ledger)
            times: list[float] = []
            if pair == "loop":
                optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
                loader = DataLoader(data, batch_size=8, collate_fn=collate)
                if side == "with":
                    from autotune import Tuner

                    with Tuner(model, optimizer, device="cpu", run_dir="runs/bench-integrations/overhead") as tuner:
                        for batch in loader:
                            tuner.step(batch, lambda m, b: m(**b)["loss"])
                            times.append(time.perf_counter())
                else:
                    for batch in loader:
                        model(**batch)["loss"].backward()
                        optimizer.step()
                        optimizer.zero_grad(set_to_none=True)
                        times.append(time.perf_counter())
            elif pair == "hf":
                from transformers import Trainer, TrainerCallback

                from autotune.integrations.transformers import AutoTuneTrainer

                class Stamp(TrainerCallback):
                    def on_step_end(self, *args, **kwargs):
                        times.append(time.perf_counter())

                cls = AutoTuneTrainer if side == "with" else Trainer
                args = _hf_args("runs/bench-integrations/overhead-hf")
                args.per_device_train_batch_size = 8
                cls(model=model, args=args, train_dataset=data, data_collator=collate, callbacks=[Stamp()]).train()
            else:
                import lightning as L

                from autotune.integrations.lightning import AutoTuneStrategy

                class Module(L.LightningModule):
                    def __init__(self) -> None:
                        super().__init__()
                        self.net = model

                    def training_step(self, batch, batch_idx):
                        return self.net(**batch)["loss"]

                    def configure_optimizers(self):
                        return torch.optim.SGD(self.parameters(), lr=0.01)

                class Stamp(L.Callback):
                    def on_train_batch_end(self, *args):
                        times.append(time.perf_counter())

                trainer = L.Trainer(max_epochs=1, accelerator="cpu", devices=1, callbacks=[Stamp()], logger=False,
                                    strategy=AutoTuneStrategy("cpu") if side == "with" else "auto",
                                    enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                                    default_root_dir="runs/bench-integrations/overhead-lightning")
                trainer.fit(Module(), DataLoader(data, batch_size=8, collate_fn=collate))
            stamps[side].append(median(intervals(times)))
    return {side: median(values) for side, values in stamps.items()}


def run(mode: str, spec: dict) -> dict:
    proc = subprocess.run([sys.executable, __file__, "--worker", mode, json.dumps(spec)], capture_output=True,
                          text=True, env={**os.environ, "MALLOC_ARENA_MAX": "1"}, timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"{spec} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


TOOLS = {
    "tuner": ("your loop", "autotune `Tuner.step`"),
    "accelerate": ("your loop", "Accelerate `find_executable_batch_size` (x0.9)"),
    "hf-autotune": ("HF Trainer", "autotune `AutoTuneTrainer`"),
    "hf-auto-find": ("HF Trainer", "`Trainer(auto_find_batch_size=True)`"),
    "pl-autotune": ("Lightning", "autotune `AutoTuneStrategy`"),
    "pl-batch-size-finder": ("Lightning", "`BatchSizeFinder` + Lightning's strategy"),
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds of the per-step cost")
    parser.add_argument("--budget-mib", type=int, default=BUDGET_MIB)
    parser.add_argument("--part", choices=("all", "late", "eval"), default="all",
                        help="eval: only the evaluation table (its own results file)")
    parser.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        mode, spec = args.worker
        print(json.dumps({"late": late_jump, "eval": evaluation, "overhead": overhead}[mode](json.loads(spec))))
        return
    if args.part in ("all", "eval"):
        write_results("integrations_eval", "Evaluation too big for memory: autotune vs each trainer's own (CPU, "
                      "RLIMIT_AS)", evaluation_table(args.trials, args.budget_mib))
    if args.part == "eval":
        return
    results: dict[str, list[dict]] = {tool: [] for tool in TOOLS}
    for trial in range(args.trials):
        for tool in TOOLS:  # interleaved, so machine noise hits every tool alike
            r = run("late", {"tool": tool, "budget_mib": args.budget_mib})
            results[tool].append(r)
            print(trial, tool, r, file=sys.stderr)
    lines = [
        f"{SAMPLES} token sequences in a fixed order: the first {1 - LONG_SHARE:.0%} {SHORT} tokens long, the last "
        f"{LONG_SHARE:.0%} {LONG} (padded per batch); per-token MLP {DIM}-{WIDTH}-{DIM}, SGD, batch {BATCH}, one "
        f"epoch on CPU under RLIMIT_AS = virtual size after warm-up + {args.budget_mib} MiB. {args.trials} trials "
        "per tool, interleaved, each its own process; medians. Samples trained: in completed optimizer steps (a "
        f"set per step), {SAMPLES} is each once; forwarded: every sample a forward saw, failed work included.", "",
        "| trainer | tool | finished | epoch wall (s) | samples trained | samples forwarded | OOMs survived / restarts | final (micro-)batch |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for tool, (where, name) in TOOLS.items():
        rs = results[tool]
        done = [r for r in rs if r["finished"]]
        if not done:
            lines.append(f"| {where} | {name} | no: {len(rs)}/{len(rs)} died (`{rs[0]['error']}`) | "
                         f"{median([r['seconds'] for r in rs]):.1f} until the crash | "
                         f"{int(median([r['trained'] for r in rs]))} | {int(median([r['forwarded'] for r in rs]))} | - | - |")
            continue
        ooms = [r["ooms"] for r in done if r["ooms"] is not None]
        lines.append(f"| {where} | {name} | {len(done)}/{len(rs)} | {median([r['seconds'] for r in done]):.1f} | "
                     f"{int(median([r['trained'] for r in done]))} | {int(median([r['forwarded'] for r in done]))} | "
                     f"{int(median(ooms)) if ooms else 'n/a'} | {done[0]['final']} |")
    lines += ["", "## Cost per step (no cap, a ~1 ms step: 4096 samples of 8 tokens, batch 8, MLP width 64)", "",
              "| trainer | without (ms) | with autotune (ms) | ratio |", "| --- | --- | --- | --- |"]
    for pair, where in (("loop", "your loop (`Tuner.step`)"), ("hf", "HF Trainer (`AutoTuneTrainer`)"),
                        ("lightning", "Lightning (`AutoTuneStrategy`)")):
        r = run("overhead", {"pair": pair, "rounds": args.rounds})
        print(pair, r, file=sys.stderr)
        lines.append(f"| {where} | {r['without'] * 1e3:.3f} | {r['with'] * 1e3:.3f} | {r['with'] / r['without']:.3f} |")
    lines += ["", f"Median of per-round medians of the step interval, {args.rounds} alternating rounds in one "
              "process, one torch thread, the first 100 steps of each round left out (warm-up, and the monitor "
              "process's start-up, paid once per run). autotune with its defaults (monitor process on)."]
    write_results("integrations", "Keep your loop or trainer: autotune vs each ecosystem's own, memory need jumping "
                  "late (CPU, RLIMIT_AS)", lines)


if __name__ == "__main__":
    main()
