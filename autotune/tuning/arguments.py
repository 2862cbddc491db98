"""The arguments of `AutoTrainer` and `Tuner`, documented here and appended to the classes'
docstrings (as Hugging Face shares its docstrings with `add_start_docstrings`): each class's own
(`TRAINER`, `TUNER`), then those they share (`SHARED`), written once so the two references
cannot drift apart. The classes' files keep their code; `help(AutoTrainer)` shows it all.

Owns the text. Touches the two classes' `__doc__` only.
"""

from __future__ import annotations

from typing import Callable, TypeVar

SHARED = """        device: "cpu", "cuda", "cuda:1" or a `torch.device`; default CUDA when available.
        policies: a preset name ("default", "conservative"), a path to a TOML preset, or a
            list of policy objects; None or [] for none (an OOM is then an error at once).
        keep_effective_batch: on OOM, accumulate smaller micro-batches into the same optimizer
            step (True) or make each smaller chunk its own optimizer step (False).
        split_fn: `split_fn(batch, size) -> list of micro-batches` for batch types the
            built-in splitter does not know.
        run_dir: where the journal (events.jsonl) goes; default `runs/<timestamp>`.
        monitor: sample memory in a background process (run_dir/samples.jsonl) and turn
            it into MEMORY_HIGH / MEMORY_PRESSURE events; False turns it off.
        monitor_interval: seconds between memory samples (0.05 to 10).
        scheduler_interval: step the scheduler after each optimizer step ("step") or at each
            epoch end ("epoch"; with a Tuner, `tuner.step_scheduler()` is yours to call).
        precision: "fp32", or "bf16" / "fp16" (autocast; fp16 with a gradient scaler, saved in
            checkpoints). With either, the autocast relief changes nothing.
        clip_grad_norm: clip the whole batch's gradient norm to this once per optimizer step
            (after every micro-batch, the ranks' average and unscaling); the norm before
            clipping goes to steps.jsonl and TensorBoard.
        clip_grad_value: clip each gradient element to +-this, once per optimizer step, as
            `clip_grad_norm` is.
        compile: `torch.compile` the model (the batch dimension marked dynamic, so micro-batch
            changes do not recompile each time); a dict is passed to torch.compile as options
            (`{"backend": "aot_eager"}`). A model the user compiled is trained as it is.
        memory_cap: keep memory under this: a fraction of the device (0 < f <= 1), bytes (an
            int), or a size such as "12GiB". On CUDA it is enforced with
            `torch.cuda.set_per_process_memory_fraction`; on CPU it is a soft cap on the
            resident memory of the process and its workers that the policies keep under (the
            effective cap is the tightest of it, the cgroup limit and RLIMIT_AS). It is the
            denominator of memory pressure.
        inject_oom: probability per micro-batch of a fake `torch.OutOfMemoryError`, raised
            through the same path as a real one, to test a setup (default: the
            AUTOTUNE_INJECT_OOM environment variable, else off).
        tensorboard: write loss, throughput, memory, micro-batch and every action to
            TensorBoard in `run_dir/tb` (True) or in the folder given; needs the optional
            `tensorboard` package.
        memory_snapshot: CUDA only: keep the allocator's last 100,000 allocations (an int: that
            many) with their Python stacks, and write `run_dir/oom-<step>.pickle` at each OOM,
            for https://pytorch.org/memory_viz; the journal and `autotune report` name the
            largest allocation sites (see memory/history.py).
        shard: under torchrun, shard the model with FSDP2 (`fully_shard` on each repeated block,
            then the root) instead of replicating it with DDP. A model you sharded yourself is
            trained as it is. Either way an OOM on any rank, in forward or backward, is retried
            by every rank at the same smaller micro-batch (see sharded.py). Alone, ignored.
        on_nonfinite: a batch with NaN or inf gradients is never trained on: "skip" its optimizer
            step (the default; journaled, said once on stderr, its samples not counted as trained)
            or "stop" with `autotune.NonFiniteStep` (AutoTrainer: after a checkpoint of the last
            finite step). A model whose weights are not finite is never checkpointed.
        max_nonfinite_steps: this many optimizer steps in a row skipped on NaN or inf gradients
            (default 50, well above what a run that trains meets: fp16's loss scale, halved at each
            skip, found its level after 17 in a row from 65536 to 0.5 on targets in the
            thousands) stop the run with `autotune.TooManyNonFiniteSteps`, after a checkpoint of
            the last finite step; None or 0: never. `FitResult.nonfinite_steps` and the journal's
            `fit_end` count the steps skipped.
"""

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
        batch_size: samples per optimizer step.
        micro_batch_size: samples per forward/backward at the start; default `batch_size`.
            "auto" starts at `batch_size` and lets the policies find the largest that fits.
        shuffle: shuffle each epoch; its order is a function of (seed, epoch).
        seed: the seed of the epochs' orders (and of the injected OOMs).
        num_workers: worker processes of the DataLoader built for a map-style dataset (the
            `tune_workers` policy may raise them when the loop waits on its data).
        collate_fn: passed to that DataLoader (and the evaluation's).
        progress: show a tqdm bar with loss, micro-batch and memory.
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
        micro_batch_size: samples per forward/backward at the start (default: the whole batch).
        batch_size: the largest batch you will pass (default: the largest seen so far); the
            micro-batch never grows past it.
        seed: the injected OOMs' random stream (`inject_oom`).
        reliefs: let policies change the model (autocast, activation checkpointing, pruning)
            at the smallest micro-batch; False where another framework owns the optimizer.
        progress: a tqdm bar (AutoTrainer's).
"""

T = TypeVar("T")


def with_arguments(own: str) -> Callable[[T], T]:
    """A class decorator: an Args section of `own` then `SHARED` appended to the class's docstring."""
    def document(cls: T) -> T:
        cls.__doc__ = (cls.__doc__ or "").rstrip() + "\n\n    Args:\n" + own + SHARED
        return cls
    return document
