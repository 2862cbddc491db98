"""Predictive sizing end to end under a real RLIMIT_AS cap, default preset, for a CNN and a
transformer: from 8x below the run is within 10% of the largest micro-batch that fits after at
most 3 optimizer steps and at most 1 OOM; from 8x above it takes at most 2 OOMs and ends within
10%, and each OOM's breakdown of the memory adds up. "Within 10%" is checked in a fresh process: a micro-batch a tenth larger than the final one
does not fit there (and the final one fits, since the run trained at it)."""

import concurrent.futures
import json
import re
from pathlib import Path

import pytest

from tests.conftest import journal, run_python, skip_if_uncalibrated

pytestmark = pytest.mark.slow

SETUP = """
import time
import torch
from torch import nn
from torch.utils.data import TensorDataset
from autotune.memory.limits import cap_address_space, fix_mmap_threshold, single_malloc_arena
single_malloc_arena(); fix_mmap_threshold()  # before the warm-up: what it frees leaves the address space
torch.manual_seed(0)
g = torch.Generator().manual_seed(0)
CALLBACKS = []  # the user's own code after each optimizer step (benchmarks/sizing.py's EMA and memory jump)
IMAGES = MODEL in ("cnn", "cnn-bn")
if MODEL == "cnn-bn":
    # Off oneDNN: its convolution's backward crashes the process (SIGSEGV) after some refused allocations
    # under RLIMIT_AS (seen in calibrate_headroom's probes here); torch's own kernels raise an OOM.
    torch.backends.mkldnn.enabled = False
if IMAGES:
    # Few channels at 64x64: much memory a sample for little compute, so sizes that fill the room run fast
    def conv(channels_in, channels_out, stride=1):
        norm = [nn.BatchNorm2d(channels_out)] if MODEL == "cnn-bn" else []
        return [nn.Conv2d(channels_in, channels_out, 3, stride=stride, padding=1), *norm, nn.ReLU()]
    model = nn.Sequential(*conv(3, 8), *conv(8, 8), *conv(8, 16, stride=2),
                          nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10))
    # Decoded images, as uint8: a batch 8x the largest micro-batch must not fill the room by itself
    images = torch.randint(0, 256, (BATCH * STEPS, 3, 64, 64), generator=g, dtype=torch.uint8)
    data = TensorDataset(images, torch.randint(0, 10, (BATCH * STEPS,), generator=g))
    def step_fn(model, batch):
        x, y = batch
        return nn.functional.cross_entropy(model(x.float() / 255), y)
else:
    class LM(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(2000, 32)  # a long sequence over a narrow model: memory-heavy, compute-light
            self.encoder = nn.TransformerEncoder(nn.TransformerEncoderLayer(32, 2, 64, dropout=0.0, batch_first=True), 2)
            self.head = nn.Linear(32, 2000)
        def forward(self, tokens):
            return self.head(self.encoder(self.embed(tokens)))
    model = LM()
    data = torch.randint(0, 2000, (BATCH * STEPS, 129), generator=g)
    def step_fn(model, tokens):
        return nn.functional.cross_entropy(model(tokens[:, :-1]).flatten(0, 1), tokens[:, 1:].flatten())
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
if MODEL == "ema":  # the LM with an EMA copy of its weights, updated after every optimizer step
    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn
    ema = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.999), use_buffers=True)
hog = []  # JUMP_BYTES taken after step JUMP_AT: memory that something else took mid-run
def after_step(step):
    if MODEL == "ema":
        ema.update_parameters(model)
    if JUMP_AT and step == JUMP_AT:
        hog.append(torch.ones(JUMP_BYTES, dtype=torch.uint8))
class AfterStep:
    def on_step_end(self, trainer):
        after_step(trainer.step)
CALLBACKS.append(AfterStep())
step_fn(model, data[:2]).backward(); optimizer.step(); optimizer.zero_grad(set_to_none=True); after_step(0)  # warm up, then cap
from autotune import AutoTrainer
trainer = AutoTrainer(model, data, step_fn=step_fn, optimizer=optimizer, batch_size=BATCH, micro_batch_size=START,
                      device="cpu", run_dir=RUN_DIR, progress=False, monitor=False, checkpoint_interval=None,
                      policies=POLICIES, shuffle=False, callbacks=CALLBACKS)
if CALIBRATE:  # the room under which about ABOUT samples fit, measured (autotune.memory.limits)
    from autotune.memory.limits import calibrate_headroom
    def probe(size):
        try:
            step_fn(model, data[:size]).backward()
        finally:
            model.zero_grad(set_to_none=True)
    calibration = calibrate_headroom(probe, fits=ABOUT * 3 // 4, fails=ABOUT * 5 // 4)
    save({"room": calibration.headroom_bytes, "uncalibrated": str(calibration)} if calibration.headroom_bytes is None
         else {"room": calibration.headroom_bytes, "said": str(calibration)})
    raise SystemExit(0)
cap_address_space(ROOM)
from autotune import is_oom
try:
    began = time.perf_counter()
    result = trainer.fit(epochs=1)
    save({"micro": result.micro_batch_size, "ooms": result.ooms, "samples": result.samples_seen,
          "seconds": time.perf_counter() - began,
          "param_bytes": sum(p.numel() * p.element_size() for p in model.parameters())})
except Exception as exc:  # a probe (no policies): the first OOM, in a step or in the loader, ends the run
    if POLICIES or not (is_oom(exc) or "even at micro-batch" in str(exc)):
        raise
    save({"out_of_memory": True})
"""

ABOUT = {"cnn": 128, "cnn-bn": 128, "lm": 64, "ema": 64}  # the largest micro-batch that fits: the cap is measured to make it about this
ROOMS: dict[str, int] = {}  # the cap's headroom per model, measured once on this machine


def room(tmp_path, model):
    """The headroom under which 3/4 of ABOUT fits and 5/4 does not, measured in a subprocess
    that builds the run as `run` does (skips where the machine cannot tell them apart)."""
    if model not in ROOMS:
        result, _, _ = run(tmp_path, model, start=1, batch=ABOUT[model] * 2, steps=1, policies=[], headroom=0, calibrate=True)
        skip_if_uncalibrated(result)
        ROOMS[model] = result["room"]
    return ROOMS[model]


def variables(**names) -> str:
    """The lines that set SETUP's variables (and benchmarks/sizing.py's scripts'), one a name."""
    return "".join(f"{name}={value!r}\n" for name, value in names.items())


def run(tmp_path, model, start, batch, steps, policies="default", headroom=None, calibrate=False, jump_at=0,
        jump_bytes=0):
    run_dir = tmp_path / f"{model}-{start}-{'calibrate' if calibrate else Path(str(policies)).stem}"
    run_dir.mkdir()
    headroom = room(tmp_path, model) if headroom is None else headroom
    head = variables(MODEL=model, START=start, BATCH=batch, STEPS=steps, ROOM=headroom, ABOUT=ABOUT[model],
                     RUN_DIR=str(run_dir / "run"), POLICIES=policies, CALIBRATE=calibrate, JUMP_AT=jump_at,
                     JUMP_BYTES=jump_bytes)
    proc, result = run_python(head + SETUP, run_dir, timeout=240, env={"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "0", "OMP_NUM_THREADS": "1"})
    if calibrate:
        assert proc.returncode == 0 and result is not None, proc.stderr[-3000:]
        return result, [], {}
    if not policies and proc.returncode < 0:
        # A probe that died of a signal: oneDNN sometimes crashes instead of raising when an allocation
        # fails (seen at micro-batch 160 of 1024 here, with or without autotune's sampler thread)
        return {"out_of_memory": True, "signal": -proc.returncode}, [], {}
    assert proc.returncode == 0 and result is not None, proc.stderr[-3000:]
    steps = [json.loads(line) for line in (run_dir / "run" / "steps.jsonl").read_text().splitlines()]
    return result, journal(run_dir / "run"), {r["step"]: r["micro_batch_size"] for r in steps}


def fits(tmp_path, model, size, batch, steps=1):
    """Whether micro-batches of `size` train `steps` steps in a fresh process under the same cap, on
    the same batches (the loader's batch is memory too)."""
    result, _, _ = run(tmp_path, model, start=size, batch=batch, steps=steps, policies=[])
    return "out_of_memory" not in result and result["ooms"] == 0


def both(check):
    """`check(model)` for the CNN and the transformer at once (each process on one thread)."""
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        for future in [pool.submit(check, model) for model in ("cnn", "lm")]:
            future.result()


def test_from_8x_below_within_10_percent_after_3_steps(tmp_path):
    def check(model):
        batch = ABOUT[model] * 4
        result, records, by_step = run(tmp_path, model, start=ABOUT[model] // 8, batch=batch, steps=5)
        assert result["samples"] == batch * 5 and result["ooms"] <= 1, (model, result)
        final = result["micro"]
        assert by_step[4] == final and by_step[5] == final, (model, by_step)  # reached by the fourth step; stays
        assert not fits(tmp_path, model, int(final / 0.9) + 1, batch), (model, by_step, "10% larger fits")
    both(check)


def test_from_8x_above_at_most_2_ooms_within_10_percent(tmp_path):
    def check(model):
        batch = ABOUT[model] * 8
        result, records, by_step = run(tmp_path, model, start=batch, batch=batch, steps=4)
        assert result["samples"] == batch * 4 and result["ooms"] <= 2, (model, result)
        final = result["micro"]
        assert final < batch
        assert not fits(tmp_path, model, int(final / 0.9) + 1, batch), (model, by_step, "10% larger fits")
        for oom in [r for r in records if r["kind"] == "oom"]:
            check_breakdown(oom, result["param_bytes"])
    both(check)


def check_breakdown(oom, param_bytes):
    """An OOM's breakdown: the tensors' parts are what the model and AdamW hold, the process held
    about what the cap allowed (with the refused allocation, within 5% of it), and the parts add up."""
    parts = oom["breakdown"]
    assert parts["measure"] == "virtual"  # what RLIMIT_AS counts
    assert parts["weights"] == param_bytes  # no buffers in these models
    assert 2 * param_bytes <= parts["optimizer_state"] <= 2 * param_bytes + 4096  # two moments (+ step counters)
    # The step's growth may be nothing: at 8x above, the first large allocation is the one refused
    assert parts["activations_and_temporaries"] >= 0 and parts["libraries"] > 0 and parts["other"] >= 0
    assert parts["held"] <= parts["cap"]
    refused = re.search(r"allocate (\d+) bytes", oom["message"])
    if refused:  # read as the error reached Python: the failing kernel's own scratch is already freed
        assert parts["held"] + int(refused.group(1)) >= 0.95 * parts["cap"], parts
    names = ("weights", "gradients", "optimizer_state", "activations_and_temporaries", "libraries", "other")
    assert abs(sum(parts[n] for n in names) - parts["held"]) <= 0.1 * parts["held"]
