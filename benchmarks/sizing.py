"""Sizing under a real RLIMIT_AS cap: how fast each way finds the largest micro-batch that fits.

The scenario of tests/memory/test_sizing_e2e.py (a CNN and a transformer LM, the cap after a warm-up):
from 8x below and 8x above the largest micro-batch that fits, AutoTrainer's default preset
(fit_micro_batch) beside the blind way it replaced (halve_on_oom + grow_back) and the peers on the
same model, data and cap:

- Accelerate's `find_executable_batch_size` with halving: a hand-written loop (the same batches,
  accumulated in micro-batches of the size it tries) that starts over at half the size on an OOM;
- Lightning's `BatchSizeFinder` (`Tuner.scale_batch_size`, modes "power" and "binsearch", one
  step a trial, from the same start), then training at the size it found (Lightning's batch is
  the size found: it trains the same samples in batches of that size).

For each: the optimizer steps (or probe trials) and OOMs until the run is within 10% of the
largest size, the final size over the largest, and the time to train the run's samples
(search included, imports and set-up not) against an AutoTrainer run that starts at the largest
size. The largest size is found by bisection in fresh processes, on the same batches.

Beside it, the reference a user compares with (issue 34): the largest micro-batch a plain
hand-written loop fits under the same cap, doing what AutoTrainer does (the step's batch made
under the cap, its micro-batches forwarded and accumulated into one optimizer step), probed
the same way; and the scenario a new user tried: torchvision's resnet18 at 64x64, batch 512,
SGD with momentum, the cap the warm virtual size + 320 MiB set before the trainer is built.

    python benchmarks/sizing.py [--steps 12] [--only resnet18]

Issue 58's matrix (`--matrix ROUNDS`, its own results file): the default preset from 8x below, from the
whole batch and through a jump in memory mid-run, on a CNN with BatchNorm, the LM and the LM with an EMA
copy, against the plain loop's largest, with the settled size's throughput beside the plain loop's.

    python benchmarks/sizing.py --matrix 3 --steps 8 [--plain cnn-bn=110:80,lm=66:49,ema=66:50]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
from statistics import median

ROOT = Path(__file__).parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).parent))
from common import write_results  # noqa: E402

# Each run in a fresh interpreter, as the figures in benchmarks/results/ were measured and as a user's run
# starts: the tests fork theirs from a server that has imported torch._dynamo (tests/forkserver.py), which a
# fresh run imports under its cap, at its optimizer's first call.
os.environ.setdefault("AUTOTUNE_TESTS_FRESH", "1")
from tests.conftest import run_python  # noqa: E402
from tests.memory.test_sizing_e2e import ABOUT, SETUP, fits, room, run, variables  # noqa: E402  the same scenario as the tests

MODEL_SETUP = SETUP[:SETUP.index("from autotune import AutoTrainer")]  # the model, data, step and warm-up

BATCHES = """
import copy
def batch_at(i):  # the batches AutoTrainer trains (shuffle=False): consecutive slices
    if IMAGES:
        return data.tensors[0][i * BATCH:(i + 1) * BATCH], data.tensors[1][i * BATCH:(i + 1) * BATCH]
    return data[i * BATCH:(i + 1) * BATCH]
def slice_of(batch, a, b):
    return tuple(t[a:b] for t in batch) if isinstance(batch, tuple) else batch[a:b]
"""

ACCELERATE = MODEL_SETUP + BATCHES + """
from accelerate.utils import find_executable_batch_size
initial, initial_optimizer = copy.deepcopy(model.state_dict()), copy.deepcopy(optimizer.state_dict())
tried = []
from autotune.memory.limits import cap_address_space
cap_address_space(ROOM)
began = time.perf_counter()
def halve():  # Accelerate calls it with no arguments: the size it halves is the last one tried
    return tried[-1] // 2
@find_executable_batch_size(starting_batch_size=START, reduce_batch_size_fn=halve)
def train(micro):
    tried.append(micro)  # a start over: the model and optimizer as they were
    model.load_state_dict(initial); optimizer.load_state_dict(initial_optimizer)
    for step in range(STEPS):
        batch = batch_at(step)
        for a in range(0, BATCH, micro):
            b = min(a + micro, BATCH)
            (step_fn(model, slice_of(batch, a, b)) * ((b - a) / BATCH)).backward()
        optimizer.step(); optimizer.zero_grad(set_to_none=True)
    return micro
final = train()
save({"micro": final, "ooms": len(tried) - 1, "tried": tried, "seconds": time.perf_counter() - began})
"""

LIGHTNING = MODEL_SETUP + BATCHES + """
import logging
import lightning as L
from lightning.pytorch.tuner import Tuner as LightningTuner
from torch.utils.data import DataLoader
logging.getLogger("lightning").setLevel(logging.ERROR)
samples = data if IMAGES else data[:BATCH * STEPS]
class Lit(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net, self.batch_size = model, START
        self.starts = self.ends = 0
    def training_step(self, batch, index):
        return step_fn(self.net, batch)
    def on_train_batch_start(self, batch, index):
        self.starts += 1
    def on_train_batch_end(self, outputs, batch, index):
        self.ends += 1
    def configure_optimizers(self):
        return optimizer
    def train_dataloader(self):
        return DataLoader(samples, batch_size=self.batch_size, shuffle=False)
lit = Lit()
options = dict(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
               enable_model_summary=False, default_root_dir=RUN_DIR)
search = L.Trainer(max_steps=10**6, **options)
from autotune.memory.limits import cap_address_space
cap_address_space(ROOM)
began = time.perf_counter()
found = LightningTuner(search).scale_batch_size(lit, mode=MODE, init_val=START, steps_per_trial=1, max_trials=25)
trials, ooms = lit.starts, lit.starts - lit.ends
lit.batch_size = found
L.Trainer(max_steps=max(1, BATCH * STEPS // found), **options).fit(lit)
save({"micro": found, "ooms": ooms, "trials": trials, "seconds": time.perf_counter() - began})
"""


PLAIN = MODEL_SETUP + BATCHES + """
from autotune.memory.limits import cap_address_space
cap_address_space(ROOM)
if JUMP_BYTES and not JUMP_AT:  # what a jump takes, from the start: the largest size after it
    hog.append(torch.ones(JUMP_BYTES, dtype=torch.uint8))
try:
    seconds = []
    for step in range(STEPS):
        began = time.perf_counter()
        batch = tuple(t.clone() for t in batch_at(step)) if IMAGES else batch_at(step).clone()  # made under the cap
        for a in range(0, BATCH, START):
            b = min(a + START, BATCH)
            (step_fn(model, slice_of(batch, a, b)) * ((b - a) / BATCH)).backward()
        optimizer.step(); optimizer.zero_grad(set_to_none=True); after_step(step + 1)
        seconds.append(time.perf_counter() - began)
    save({"fits": True, "step_seconds": seconds})
except Exception as exc:
    # oneDNN reports an allocation it could not make as "could not create a primitive"
    if not any(m in str(exc) for m in ("can't allocate memory", "could not create a primitive")) and \
            not isinstance(exc, MemoryError):
        raise
    save({"fits": False})
"""

# resnet18 at 64x64 under 320 MiB (issue 34): a plain loop (mode "plain", micro-batch START) or
# AutoTrainer with its default preset from micro-batch START; the cap before the trainer is built.
RESNET18 = """
import time, torch, torchvision
from torch import nn
from torch.utils.data import TensorDataset
from autotune.memory.limits import cap_address_space, fix_mmap_threshold, single_malloc_arena
single_malloc_arena(); fix_mmap_threshold()
torch.manual_seed(0)
g = torch.Generator().manual_seed(0)
model = torchvision.models.resnet18(num_classes=10)
images = torch.randint(0, 256, (BATCH * STEPS, 3, 64, 64), generator=g, dtype=torch.uint8)
labels = torch.randint(0, 10, (BATCH * STEPS,), generator=g)
def step_fn(model, batch):
    x, y = batch
    return nn.functional.cross_entropy(model(x.float() / 255), y)
optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
step_fn(model, (images[:2], labels[:2])).backward(); optimizer.step(); optimizer.zero_grad(set_to_none=True)  # warm up
cap_address_space(320 * 2**20)
try:
    if MODE == "plain":
        for step in range(STEPS):
            x, y = images[step * BATCH:(step + 1) * BATCH].clone(), labels[step * BATCH:(step + 1) * BATCH].clone()
            for a in range(0, BATCH, START):
                b = min(a + START, BATCH)
                (step_fn(model, (x[a:b], y[a:b])) * ((b - a) / BATCH)).backward()
            optimizer.step(); optimizer.zero_grad(set_to_none=True)
        save({"fits": True})
    else:
        from autotune import AutoTrainer
        trainer = AutoTrainer(model, TensorDataset(images, labels), step_fn=step_fn, optimizer=optimizer,
                              batch_size=BATCH, micro_batch_size=START, device="cpu", run_dir=RUN_DIR,
                              progress=False, checkpoint_interval=None, shuffle=False)
        result = trainer.fit(epochs=1)
        import json
        sizes = {r["step"]: r["micro_batch_size"] for r in map(json.loads, open(RUN_DIR + "/steps.jsonl"))}
        save({"micro": result.micro_batch_size, "ooms": result.ooms, "sizes": sizes,
              "oom_steps": [r["step"] for r in map(json.loads, open(RUN_DIR + "/events.jsonl")) if r["kind"] == "oom"]})
except Exception as exc:
    if MODE != "plain" or (not any(m in str(exc) for m in ("can't allocate memory", "could not create a primitive"))
                           and not isinstance(exc, MemoryError)):
        raise
    save({"fits": False})
"""
RESNET18_BATCH, RESNET18_STEPS = 512, 5


def head(tmp: Path, model: str, start: int, batch: int, steps: int, jump_bytes: int = 0, **more: object) -> str:
    """The variables the scripts of this file and of tests/memory/test_sizing_e2e.py read."""
    return variables(MODEL=model, START=start, BATCH=batch, STEPS=steps, ROOM=room(tmp, model), JUMP_AT=0,
                     JUMP_BYTES=jump_bytes, **more)


def plain_run(tmp: Path, model: str, size: int, batch: int, steps: int, jump_bytes: int = 0) -> dict:
    """The plain loop's `steps` steps at micro-batch `size` in a fresh process under the cap (`jump_bytes`
    taken before the first): {"fits": bool} and, where it fits, each step's seconds."""
    if model == "resnet18":
        script = f"MODE='plain'\nSTART={size}\nBATCH={batch}\nSTEPS={steps}\n"
        proc, result = run_python(script + RESNET18, tmp, timeout=600, env={"OMP_NUM_THREADS": "1"})
    else:
        proc, result = run_python(head(tmp, model, size, batch, steps, jump_bytes) + PLAIN, tmp, timeout=600,
                                  env={"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "0", "OMP_NUM_THREADS": "1"})
    if result is None:  # oneDNN may die of a signal where an allocation fails (see tests/memory/test_sizing_e2e.py)
        assert proc.returncode < 0, proc.stderr[-2000:]
        return {"fits": False}
    return result


def plain_fits(tmp: Path, model: str, size: int, batch: int, steps: int, jump_bytes: int = 0) -> bool:
    """Whether the plain loop trains `steps` steps at micro-batch `size` in a fresh process under the cap."""
    return plain_run(tmp, model, size, batch, steps, jump_bytes)["fits"]


def bisect_largest(fits, lo: int, hi: int) -> int:
    """The largest size `fits(size)` says fits, to within 2%, between `lo` (fits) and `hi` (does not)."""
    assert fits(lo) and not fits(hi), (lo, hi)
    while hi - lo > max(1, lo // 50):
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def largest_plain(tmp: Path, model: str, batch: int, steps: int, lo: int, hi: int, jump_bytes: int = 0) -> int:
    """The plain loop's largest fitting micro-batch: what a user's own loop fits under the same cap."""
    return bisect_largest(lambda size: plain_fits(fresh(tmp), model, size, batch, steps, jump_bytes), lo, hi)


def resnet18_rows(tmp: Path) -> list[str]:
    """The resnet18 scenario: the plain loop's largest, then AutoTrainer from 8x below it and from the whole batch."""
    batch, steps = RESNET18_BATCH, RESNET18_STEPS
    plain = largest_plain(tmp, "resnet18", batch, steps, 32, 512)
    rows = []
    for direction, start in ((f"8x below ({plain // 8})", plain // 8), (f"the whole batch ({batch})", batch)):
        run_dir = fresh(tmp)
        script = f"MODE='auto'\nSTART={start}\nBATCH={batch}\nSTEPS={steps}\nRUN_DIR={str(run_dir / 'run')!r}\n"
        proc, result = run_python(script + RESNET18, run_dir, timeout=900, env={"OMP_NUM_THREADS": "1"})
        assert proc.returncode == 0 and result is not None, proc.stderr[-3000:]
        sizes = {int(step): size for step, size in result["sizes"].items()}
        at = settled_at(sizes, plain, above_counts=True)
        ooms_by = sum(1 for step in result["oom_steps"] if at is None or step < at)
        rows.append(f"| resnet18 | {direction} | fit_micro_batch (default) | {plain} | "
                    f"{' '.join(str(sizes[s]) for s in sorted(sizes))} | {at if at is not None else 'never'} | "
                    f"{ooms_by} | {result['ooms']} | {result['micro'] / plain:.2f} |")
        print(rows[-1], file=sys.stderr)
    return rows


MATRIX_MODELS = ("cnn-bn", "lm", "ema")
JUMP_AFTER = 4  # the step after which a quarter of the room is taken, for the rest of the run


def matrix_rows(tmp: Path, steps: int, rounds: int, known: dict[str, tuple[int, int]]) -> tuple[list[str], int]:
    """Issue 58's matrix: AutoTrainer's default preset on a CNN with BatchNorm, the LM and the LM with
    an EMA copy, from 8x below the plain loop's largest, from the whole batch, and through a jump (a
    quarter of the room taken after step JUMP_AFTER, from 8x below), `rounds` times; a row a run,
    and how many rows met the bar (within 10% by the third step with at most 2 OOMs). `known`: the
    plain loop's largest before and after the jump, per model, from an earlier run of this machine
    (the bisection is most of the time); the others are bisected."""
    rows, met = [], 0
    plains = {}
    for model in MATRIX_MODELS:
        batch, jump_bytes = ABOUT[model] * 8, room(tmp, model) // 4
        before, after = known.get(model) or (
            largest_plain(tmp, model, batch, steps, ABOUT[model] // 4, ABOUT[model] * 2),
            largest_plain(tmp, model, batch, steps, ABOUT[model] // 8, ABOUT[model] * 2, jump_bytes))
        plains[model] = [(size, median(plain_run(fresh(tmp), model, size, batch, steps, jump)["step_seconds"]))
                         for size, jump in ((before, 0), (after, jump_bytes))]
        print(f"{model}: plain loop's largest {before}, {after} after the jump", file=sys.stderr)
    for round_ in range(1, rounds + 1):
        for model in MATRIX_MODELS:
            batch, jump_bytes = ABOUT[model] * 8, room(tmp, model) // 4
            (before, before_seconds), (after, after_seconds) = plains[model]
            for name, start, jump_at in ((f"8x below ({before // 8})", before // 8, 0),
                                         (f"the whole batch ({batch})", batch, 0),
                                         (f"jump after step {JUMP_AFTER}", before // 8, JUMP_AFTER)):
                folder = fresh(tmp)
                result, records, sizes = run(folder, model, start=start, batch=batch, steps=steps,
                                             jump_at=jump_at, jump_bytes=jump_bytes if jump_at else 0)
                plain, plain_seconds = (after, after_seconds) if jump_at else (before, before_seconds)
                counted = {step: size for step, size in sizes.items() if step > jump_at}
                at = settled_at(counted, plain, above_counts=True)
                ooms = sum(1 for r in records if r["kind"] == "oom" and r["step"] >= jump_at and
                           (at is None or r["step"] < at))
                seconds = [r["step_seconds"] for r in map(json.loads, (folder / f"{model}-{start}-default" / "run" /
                                                                       "steps.jsonl").read_text().splitlines())
                           if at is not None and r["step"] >= at]
                by = at - jump_at if at is not None else None
                ok = by is not None and by <= 3 and ooms <= 2
                met += ok
                rows.append(f"| {round_} | {model} | {name} | {plain} | {' '.join(str(sizes[s]) for s in sorted(sizes))} | "
                            f"{by if by is not None else 'never'} | {ooms} | {result['ooms']} | "
                            f"{result['micro'] / plain:.2f} | "
                            f"{plain_seconds / median(seconds) if seconds else float('nan'):.2f} | "
                            f"{'yes' if ok else 'no'} |")
                print(rows[-1], file=sys.stderr)
    return rows, met


def peer(tmp: Path, script: str, model: str, start: int, batch: int, steps: int, mode: str = "") -> dict:
    """One peer's run under the same cap (ACCELERATE or LIGHTNING); what it saved, or why it stopped."""
    variables = head(tmp, model, start, batch, steps, RUN_DIR=str(tmp / "run"), MODE=mode)
    proc, result = run_python(variables + script, tmp, timeout=600,
                              env={"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "0", "OMP_NUM_THREADS": "1"})
    if proc.returncode != 0 or result is None:
        last = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
        return {"failed": f"exit {proc.returncode}: {last[:160]}"}
    return result

GROW_BACK = '[[policy]]\nuse = "halve_on_oom"\n\n[[policy]]\nuse = "grow_back"\n'


def fresh(tmp: Path) -> Path:
    """A new folder for one process's run."""
    return Path(tempfile.mkdtemp(dir=tmp))


def largest(tmp: Path, model: str, batch: int, steps: int) -> int:
    """The largest micro-batch that trains a whole run (`steps` steps) in a fresh process under the
    cap, to within 2% (one step is not enough: a size can pass the first and fail a later one)."""
    return bisect_largest(lambda size: fits(fresh(tmp), model, size, batch, steps), ABOUT[model] // 2, ABOUT[model] * 2)


def settled_at(sizes: dict[int, int], best: int, above_counts: bool = False) -> int | None:
    """The first step from which every step's micro-batch is within 10% of `best` (`above_counts`:
    at least 90% of it; against the plain loop's largest, more is not a shortfall)."""
    steps = sorted(sizes)
    for i, step in enumerate(steps):
        if all(sizes[s] >= 0.9 * best and (above_counts or sizes[s] <= 1.1 * best) for s in steps[i:]):
            return step
    return None


def write_matrix(tmp: Path, steps: int, rounds: int, known: dict[str, tuple[int, int]]) -> None:
    rows, met = matrix_rows(tmp, steps, rounds, known)
    lines = [f"AutoTrainer with its default preset (fit_micro_batch), {steps} optimizer steps a run, batch 8x the "
             "model's ABOUT size, one thread, oneDNN's primitive cache off, the caps of tests/memory/test_sizing_e2e.py "
             "(measured on this machine so that about ABOUT samples fit): a CNN with BatchNorm (three convs at 64x64, "
             "ABOUT 128), the 2-layer transformer LM (128 tokens, ABOUT 64), and the same LM with an EMA copy of its "
             "weights (torch.optim.swa_utils.AveragedModel, updated after every optimizer step in a callback; the "
             "plain loop updates it after its own step). Starts: 8x below the plain loop's largest, the whole batch, "
             f"and a jump: from 8x below, a quarter of the room taken after step {JUMP_AFTER} and kept.", "",
             f"Bar: within 10% of the plain loop's largest by the third step (after the jump: the third step after "
             f"it), at most 2 OOMs until then. Met: {met} of {len(rows)}.", "",
             "| round | model | start | plain loop's largest | micro-batch of each step | settled by step | "
             "OOMs until then | OOMs in all | final / plain loop's | throughput / plain loop's at its largest | "
             "met |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |", *rows, "",
             "'Plain loop's largest': a hand-written loop under the same cap that does what AutoTrainer does (the "
             "step's batch made under the cap, micro-batches accumulated into one optimizer step, the EMA updated), "
             "bisected in fresh processes to within 2%; for the jump, with the quarter taken from its start. "
             "'Settled by step': the first step (counted from the jump, for the jump) from which every step's "
             "micro-batch is at least 90% of the plain loop's largest (more is not a shortfall). Throughput: the "
             "plain loop's median step time at its largest over AutoTrainer's median over its settled steps (the "
             "same batch a step): above 1, AutoTrainer trains faster."]
    write_results("sizing-matrix", "Sizing from three starts on three models vs the plain loop's largest (CPU)", lines)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--only", choices=("cnn", "lm", "resnet18"), help="one scenario (the results file then has its rows only)")
    parser.add_argument("--matrix", type=int, metavar="ROUNDS",
                        help="issue 58's matrix instead, ROUNDS times (results in sizing-matrix.md)")
    parser.add_argument("--plain", default="", metavar="MODEL=BEFORE:AFTER,...",
                        help="with --matrix: the plain loop's largest before and after the jump, from an earlier "
                             "run on this machine (not bisected again)")
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="sizing-"))
    if args.matrix:
        known = {}
        for item in filter(None, args.plain.split(",")):
            model, sizes = item.split("=")
            before, after = sizes.split(":")
            known[model] = (int(before), int(after))
        write_matrix(tmp, args.steps, args.matrix, known)
        return
    preset = tmp / "grow_back.toml"
    preset.write_text(GROW_BACK)
    rows = []
    for model in [m for m in ("cnn", "lm") if args.only in (None, m)]:
        for direction, start, batch in (("8x below", ABOUT[model] // 8, ABOUT[model] * 4),
                                        ("8x above", ABOUT[model] * 8, ABOUT[model] * 8)):
            best = largest(tmp, model, batch, args.steps)
            plain = largest_plain(tmp, model, batch, args.steps, ABOUT[model] // 4, ABOUT[model] * 2)
            for _ in range(4):  # at the edge a size can fit one run and not the next: then 2% lower
                reference_run, _, _ = run(fresh(tmp), model, start=best, batch=batch, steps=args.steps, policies=[])
                if "out_of_memory" not in reference_run:
                    break
                best = int(best * 0.98)
            else:
                raise RuntimeError(f"{model}: no run at the largest size found fits twice")
            reference = reference_run["seconds"]  # the fit itself: imports and set-up are not sizing
            for name, policies in (("fit_micro_batch (default)", "default"), ("grow_back", str(preset))):
                result, records, sizes = run(fresh(tmp), model, start=start, batch=batch,
                                             steps=args.steps, policies=policies)
                at = settled_at(sizes, best)
                ooms_by = sum(1 for r in records if r["kind"] == "oom" and (at is None or r["step"] < at))
                rows.append(f"| {model} | {direction} ({start}) | {name} | {plain} | {best} | "
                            f"{at if at is not None else 'never'} | {ooms_by} | {result['ooms']} | "
                            f"{result['micro'] / plain:.2f} | {result['micro'] / best:.2f} | "
                            f"{result['seconds'] / reference:.2f} |")
                print(rows[-1], file=sys.stderr)
            peers = [("Accelerate find_executable_batch_size (halving)", ACCELERATE, ""),
                     ("Lightning BatchSizeFinder (power)", LIGHTNING, "power"),
                     ("Lightning BatchSizeFinder (binsearch)", LIGHTNING, "binsearch")]
            for name, script, mode in peers:
                result = peer(fresh(tmp), script, model, start, batch, args.steps, mode)
                if "failed" in result:
                    rows.append(f"| {model} | {direction} ({start}) | {name} | {plain} | {best} | "
                                f"failed: {result['failed']} | | | | | |")
                else:
                    # Each trains the whole run at the size its search ended on: within 10% from its first
                    # real step, or never; the search before it is restarts (Accelerate) or probe steps.
                    close = abs(result["micro"] - best) <= 0.1 * best
                    before = (f"after {result['ooms']} restarts" if "tried" in result
                              else f"after {result['trials']} probe steps")
                    rows.append(f"| {model} | {direction} ({start}) | {name} | {plain} | {best} | "
                                f"{'0' if close else 'never'} ({before}) | {result['ooms']} | {result['ooms']} | "
                                f"{result['micro'] / plain:.2f} | {result['micro'] / best:.2f} | "
                                f"{result['seconds'] / reference:.2f} |")
                print(rows[-1], file=sys.stderr)
    resnet = resnet18_rows(tmp) if args.only in (None, "resnet18") else []
    lines = [f"AutoTrainer, {args.steps} optimizer steps a run, batch 4x (from below) or 8x (from above) the "
             "largest micro-batch; the models and caps of tests/memory/test_sizing_e2e.py (CNN: three convs at 64x64, "
             "100 MiB of room; LM: 2-layer transformer, 128 tokens, 230 MiB), one thread each, oneDNN's primitive "
             "cache off (see the test's docstring).", "",
             "| model | start | sizing | plain loop's largest | AutoTrainer's largest | settled at step | "
             "OOMs until then | OOMs in all | final / plain loop's | final / AutoTrainer's | "
             "time / a run started at the largest |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |", *rows, "",
             "'Plain loop's largest': a hand-written loop under the same cap that does what AutoTrainer does (the "
             "step's batch made under the cap, micro-batches accumulated into one optimizer step), bisected the "
             "same way; 'settled' is against AutoTrainer's largest in this table.", "",
             f"torchvision's resnet18 at 64x64, batch {RESNET18_BATCH}, SGD with momentum, {RESNET18_STEPS} steps, "
             "the cap the warm virtual size + 320 MiB set before the trainer is built, AutoTrainer with its "
             "defaults (monitor on), one thread:", "",
             "| model | start | sizing | plain loop's largest | micro-batch of each step | at 90% of the plain "
             "loop's or more from step | OOMs until then | OOMs in all | final / plain loop's |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |", *resnet, "",
             "'Settled at step': the first step from which every step is within 10% of the largest size (the "
             "micro-batch a step ran at is the one logged with it). 'Largest that fits': bisection of whole runs "
             "in fresh processes, then lowered 2% at a time until a second run at it fits too. Time: the "
             "training (search included) measured inside each process, over the same in an AutoTrainer run that "
             "starts at the largest size and never changes it. Lightning trains batches of the size it found "
             "(the same samples in all); Accelerate's loop and autotune accumulate micro-batches into the "
             "run's batch."]
    write_results("sizing", "Sizing under RLIMIT_AS: fit_micro_batch vs grow_back, Accelerate, Lightning (CPU)",
                  lines)


if __name__ == "__main__":
    main()
