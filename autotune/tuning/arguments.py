"""The arguments of `AutoTrainer` and `Tuner`, shown in the classes' docstrings (as Hugging Face
shares its docstrings with `add_start_docstrings`): each class's own, documented here (`TRAINER`,
`TUNER`: what it trains and, for AutoTrainer, its data, evaluation, checkpoints and stops), then the
Tuner's options it takes, each documented once at its field of the options records
(tuning/options.py, step/options.py), so that the two references cannot drift apart. The classes'
files keep their code; `help(AutoTrainer)` shows it all, and the API reference renders the same
text (docs/hooks/runtime_docstrings.py).

Owns the text of the arguments that are not options. Touches the two classes' `__doc__` only.
"""

from __future__ import annotations

import inspect
import textwrap
from typing import Callable, TypeVar

from autotune.common.options import keywords
from autotune.tuning.options import TunerOptions

TRAINER = """        model: the `nn.Module` to train; moved to `device`.
        dataset: a map-style `Dataset` (batched here, with `batch_size`), or a `DataLoader`
            (its `batch_size` is the batch).
        loss_fn: `loss_fn(outputs, targets) -> mean loss`; batches are `(inputs, targets)`.
        step_fn: instead of `loss_fn`, `step_fn(model, micro_batch) -> mean loss` for any layout,
            or `-> (mean loss, n_items)`: the loss is the mean over n_items items (label tokens,
            say) and micro-batches are weighted by items, so a batch's step is the same at any
            micro-batch size.
        optimizer: an optimizer over the model's parameters, or a factory `params -> Optimizer`;
            default AdamW(lr=1e-3).
        shuffle: shuffle each epoch; its order is a function of (seed, epoch).
        num_workers: worker processes of the DataLoader built for a map-style dataset (the
            `tune_workers` policy may raise them when the loop waits on its data).
        collate_fn: passed to that DataLoader (and the evaluation's).
        scheduler: an LR scheduler over `optimizer` (or a factory optimizer -> scheduler),
            saved in checkpoints; stepped per `scheduler_interval` ("step": each optimizer
            step, "epoch": each epoch end).
        scheduler_metric: what a ReduceLROnPlateau scheduler steps on: an evaluation's figure
            (default "loss"), or, without an `eval_dataset`, the epoch's training loss ("train_loss").
        eval_dataset: a dataset (or DataLoader) to evaluate on, with an eval micro-batch of its
            own; see `evaluate`.
        eval_every: evaluate every this many steps, or each "epoch" (the default with an
            eval_dataset).
        eval_batch_size: samples an evaluation batch (default `batch_size`).
        metrics: names mapped to `fn(outputs, targets)` (loss_fn) or `fn(outputs, micro_batch)`
            (step_fn), each the mean over the micro-batch or `(mean, n_items)`.
        callbacks: objects with any of on_fit_start, on_step_end, on_evaluate, on_epoch_end,
            on_fit_end (see callbacks.py); their state_dict() goes into checkpoints.
        checkpoint_every: write a checkpoint every this many optimizer steps (at steps N, 2N, ...).
        checkpoint_interval: and/or every this many seconds (default 900; None: off). A
            checkpoint is also written at the end of `fit`, on a stop signal, on `sys.exit` in your
            code, and before giving up on an OOM, in `run_dir/checkpoints/`.
        keep_checkpoints: how many of the newest checkpoints are kept (older ones are removed).
        data_stall_seconds: a wait for a batch longer than this is named on stderr (the epoch,
            the batch, the dataset indices being fetched) and journaled (`data_stalled`); default
            20 times the mean time between batches, 30 s to 10 min (2 min for a fit's first).
            A stop signal during a wait checkpoints the last completed step and stops.
        stop_signals: the signals that end a fit with a checkpoint of the last completed step
            and exit 128 + the signal's number (`autotune.stops.preemption.Preempted`): names
            ("SIGUSR2") or numbers; default SIGTERM, SIGINT, SIGHUP, SIGUSR1; () for none (each
            then acts as it would without autotune). A repeat does not abandon the stop (Ctrl-C
            pressed three times does); one the process ignores when fit starts (`nohup`'s
            SIGHUP) stays ignored; the workers of the DataLoader built here ignore them (the
            trainer stops them after its checkpoint). See docs/long-runs.md, "Signals".
"""

TUNER = """        model: the `nn.Module` to train; moved to `device` (wrapped in DDP under torchrun).
        optimizer: an optimizer over the model's parameters, or a factory `params -> Optimizer`;
            default AdamW(lr=1e-3). Pruning (a relief) keeps it, remapped in place.
        loss_fn: the default for `step`: `loss_fn(outputs, targets)` on `(inputs, targets)` batches.
        step_fn: or the default for `step`: `step_fn(model, micro_batch) -> loss | (loss, n_items)`.
        scheduler: an LR scheduler over the optimizer (or a factory), stepped after each
            optimizer step (`scheduler_interval="step"`) or by you (`tuner.step_scheduler()`).
"""

T = TypeVar("T")
WIDTH = 100  # of a rendered line, indentation included


def with_arguments(own: str, *, trainer: bool = False) -> Callable[[T], T]:
    """A class decorator: an Args section of `own`, then of every Tuner option the class takes (its
    signature's keywords among the records' fields; `trainer`: AutoTrainer's wording where it has
    one), appended to the class's docstring."""
    def document(cls: T) -> T:
        takes = inspect.signature(cls).parameters
        options = "".join(textwrap.fill(option.trainer if trainer and option.trainer else option.doc, WIDTH,
                                        initial_indent=f"        {option.name}: ", subsequent_indent=" " * 12,
                                        break_long_words=False, break_on_hyphens=False) + "\n"
                          for option in keywords(TunerOptions) if option.name in takes)
        cls.__doc__ = (cls.__doc__ or "").rstrip() + "\n\n    Args:\n" + own + options
        return cls
    return document
