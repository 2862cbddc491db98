"""The step's options: how a batch is split, computed, checked and stepped, as the user chose it.

One frozen record, `StepOptions`, built once by the Tuner from its keywords (a part of its own record,
tuning/options.py) and read by `StepCore` and `OptimizerStep` at construction. Each field's doc is the
user's doc of the keyword (common/options.py; tuning/arguments.py shows it in `AutoTrainer`'s and
`Tuner`'s docstrings).

Owns the step's options and their docs. Touches nothing.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from autotune.common.batching import SplitFn
from autotune.common.options import option


@dataclasses.dataclass(frozen=True)
class StepOptions:
    """What `StepCore` and `OptimizerStep` are told (the defaults: `Tuner`'s)."""

    keep_effective_batch: bool = option(True, """on OOM, accumulate smaller micro-batches into the same optimizer
        step (True) or make each smaller chunk its own optimizer step (False).""")
    split_fn: SplitFn | None = option(None, """`split_fn(batch, size) -> list of micro-batches` for batch types the
        built-in splitter does not know.""")
    scheduler_interval: str = option("step", """step the scheduler after each optimizer step ("step") or at each
        epoch end ("epoch"; with a Tuner, `tuner.step_scheduler()` is yours to call).""")
    precision: str = option("fp32", """"fp32", or "bf16" / "fp16" (autocast; fp16 with a gradient scaler, saved in
        checkpoints). With either, the autocast relief changes nothing.""")
    clip_grad_norm: float | None = option(None, """clip the whole batch's gradient norm to this once per optimizer
        step (after every micro-batch, the ranks' average and unscaling); the norm before clipping goes to
        steps.jsonl and TensorBoard.""")
    clip_grad_value: float | None = option(None, """clip each gradient element to +-this, once per optimizer step,
        as `clip_grad_norm` is.""")
    compile: bool | dict[str, Any] = option(False, """`torch.compile` the model (the batch dimension marked
        dynamic, so micro-batch changes do not recompile each time); a dict is passed to torch.compile as
        options (`{"backend": "aot_eager"}`). A model the user compiled is trained as it is.""")
    # In the Tuner's record, the rate itself: the environment variable is read once, when it is built.
    inject_oom: float | None = option(None, """probability per micro-batch of a fake `torch.OutOfMemoryError`,
        raised through the same path as a real one, to test a setup (default: the AUTOTUNE_INJECT_OOM
        environment variable, else off).""")
    seed: int = option(0, "the injected OOMs' random stream (`inject_oom`).",
                       trainer="the seed of the epochs' orders (and of the injected OOMs).")
    on_nonfinite: str = option("skip", """a batch with NaN or inf gradients is never trained on: "skip" its
        optimizer step (the default; journaled, said once on stderr, its samples not counted as trained) or
        "stop" with `autotune.NonFiniteStep` (AutoTrainer: after a checkpoint of the last finite step). A model
        whose weights are not finite is never checkpointed.""")
    max_nonfinite_steps: int | None = option(50, """this many optimizer steps in a row skipped on NaN or inf
        gradients (default 50, well above what a run that trains meets: fp16's loss scale, halved at each skip,
        found its level after 17 in a row from 65536 to 0.5 on targets in the thousands) stop the run with
        `autotune.TooManyNonFiniteSteps`, after a checkpoint of the last finite step; None or 0: never.
        `FitResult.nonfinite_steps` and the journal's `fit_end` count the steps skipped.""")
