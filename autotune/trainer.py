"""AutoTrainer: a training loop that survives out-of-memory errors and loses nothing.

The loop, and where each `Event` fires (the one copy of this picture; events.py points here)::

    fit():                                          FIT_START; callbacks.on_fit_start
      for epoch:                                    EPOCH_START
        for batch in loader:                        (time blocked in next() = data wait)
          while the batch is not done:              # retry the same batch until it fits
            attempt (step.py):
              for micro in split(batch, micro_batch_size):
                loss = step(model, micro) * len(micro) / len(batch)   # or by items: (loss, n_items)
                loss.backward()
              except OOM: note the size that failed (keep no reference to the exception)
            agree (distributed.py): under torchrun every rank joins one small all-reduce,
              failed or not; alone, the agreement is this process's own proposal
            no failure: average gradients (torchrun; by items when the step counts them);
              unscale, clip; optimizer.step(); zero_grad()
            failure: clean up outside `except`: zero_grad(set_to_none), gc, empty_cache
                                                    OOM -> policies -> e.g. SetMicroBatch(n // 2)
              at the smallest size, a relief if a policy asked (checkpoint first), else
              raise autotune.OutOfMemory with the figures (checkpoint first)
                                                    BATCH_END
          a relief a policy asked for (relief/ladder.py): autocast, checkpointing, pruning
          monitor samples, step timing -> detectors MEMORY_HIGH | MEMORY_PRESSURE | IO_BOUND
          a policy changed workers or caching: rebuild the loader at this position
          a signal (agreed by all ranks): checkpoint and stop
                                                    callbacks.on_step_end
          every `eval_every` steps: evaluate()      (evaluation.py; callbacks.on_evaluate)
          a due checkpoint (agreed by all ranks)
          a callback asked to stop: checkpoint, end the fit
                                                    EPOCH_END
        eval_every="epoch": evaluate(); per-epoch scheduler step; callbacks.on_epoch_end
                                                    FIT_END; callbacks.on_fit_end

With `keep_effective_batch=True` the micro-batches of a batch are accumulated with loss
weights len(micro)/len(batch), so the optimizer step equals the one without an OOM. With
False, every micro-batch is its own optimizer step, and a retry resumes at the first
sample not yet stepped on. Either way no sample is skipped or repeated.

This file assembles the parts and holds the loop and OOM recovery. The parts, each in a
room of its own: config.py (arguments), step.py (forward/backward, optimizer step),
distributed.py (Solo/Ranks, the agreement), knobs.py + dispatch.py (policies' actions),
relief/ladder.py, checkpoint.py, monitor/link.py, journal.py (the run log), data/pipeline.py.
"""

from __future__ import annotations

import datetime
import gc
import signal
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence

import torch
from loguru import logger
from torch import nn
from torch.utils.data import DataLoader, Dataset, IterableDataset

from autotune.actions import Relief
from autotune.batching import SplitFn, batch_len
from autotune.callbacks import Callbacks
from autotune.checkpoint import CheckpointDue, Checkpointer, RankFailed, rank_rng_state, rng_state, set_rng_state
from autotune.config import (OptimizerFactory, check_evaluation, check_run_limits, check_sample_layout,
                             check_step_options, injection_rate, make_optimizer, make_scheduler, resolve_device,
                             resolve_memory_cap, resolve_micro_batch)
from autotune.data.pipeline import InputPipeline
from autotune.dispatch import Dispatcher
from autotune.distributed import Agreement, from_environment
from autotune.evaluation import Evaluator, Metric
from autotune.events import Event
from autotune.journal import RunLog
from autotune.knobs import Knobs
from autotune.memory import StepDemand, allocator_stats, describe_memory, free_memory, memory_text, warm_up_oom_path
from autotune.monitor.link import MonitorLink
from autotune.oom import OutOfMemory
from autotune.policy import Policy
from autotune.preemption import StopRequests
from autotune.presets import resolve_policies
from autotune.progress import FitResult, Progress
from autotune.relief.ladder import ReliefFailed, ReliefLadder
from autotune.snapshot import Snapshot, StepTiming
from autotune.step import Attempt, LossFn, StepCore, StepFn, compile_count
from autotune.validate import check_int


def _is_zero(weight: Any) -> bool:
    # Only a plain count can be told zero without reading the device; a tensor never is (items >= 1 by then).
    return not isinstance(weight, torch.Tensor) and weight == 0


def _counter(name: str) -> property:
    return property(lambda self: getattr(self.progress, name), doc=f"`Progress.{name}` of this trainer's run")


class AutoTrainer:
    """Train `model` on `dataset`, adapting to memory limits instead of crashing.

    Args:
        model: the `nn.Module` to train; moved to `device`.
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
        keep_effective_batch: on OOM, accumulate smaller micro-batches into the same step
            (True) or make each smaller chunk its own optimizer step (False).
        device: "cpu", "cuda", "cuda:1" or a `torch.device`; default CUDA when available.
        policies: a preset name ("default", "conservative"), a path to a TOML preset, or a
            list of policy objects.
        run_dir: where the journal (events.jsonl) goes; default `runs/<timestamp>`.
        shuffle, seed: the sample order of each epoch is a function of (seed, epoch).
        num_workers, collate_fn: passed to the DataLoader built for a map-style dataset (the
            `tune_workers` policy may raise num_workers when the loop waits on its data).
        split_fn: `split_fn(batch, size) -> list of micro-batches` for batch types the
            built-in splitter does not know.
        progress: show a tqdm bar with loss, micro-batch and memory.
        monitor: sample memory in a background process (run_dir/samples.jsonl) and turn
            it into MEMORY_HIGH / MEMORY_PRESSURE events; False turns it off.
        monitor_interval: seconds between memory samples (0.05 to 10).
        scheduler: an LR scheduler over `optimizer` (or a factory optimizer -> scheduler),
            saved in checkpoints; stepped per `scheduler_interval` ("step": each optimizer
            step, "epoch": each epoch end). A ReduceLROnPlateau steps on `scheduler_metric`
            (default: the evaluation loss, or the epoch's training loss without `eval_dataset`).
        precision: "fp32", or "bf16" / "fp16" (autocast; fp16 with a gradient scaler, saved in
            checkpoints). With either, the autocast relief changes nothing.
        clip_grad_norm, clip_grad_value: clip the whole batch's gradient once per optimizer
            step (after every micro-batch, the ranks' average and unscaling); the norm before
            clipping goes to steps.jsonl and TensorBoard.
        eval_dataset, eval_every, eval_batch_size, metrics: evaluate every `eval_every` steps
            or each "epoch" (the default with an eval_dataset), `eval_batch_size` samples a
            batch (default `batch_size`) with an eval micro-batch of its own; `metrics` maps
            names to `fn(outputs, targets)` (loss_fn) or `fn(outputs, micro_batch)` (step_fn),
            each the mean over the micro-batch or `(mean, n_items)`. See `evaluate`.
        callbacks: objects with any of on_fit_start, on_step_end, on_evaluate, on_epoch_end,
            on_fit_end (see callbacks.py); their state_dict() goes into checkpoints.
        compile: `torch.compile` the model (the batch dimension marked dynamic, so micro-batch
            changes do not recompile each time); a dict is passed to torch.compile as options
            (`{"backend": "aot_eager"}`). A model the user compiled is trained as it is.
        checkpoint_every: write a checkpoint every this many optimizer steps (at steps N, 2N, ...).
        checkpoint_interval: and/or every this many seconds (default 900; None: off). A
            checkpoint is also written at the end of `fit`, on SIGTERM/SIGINT, and before
            giving up on an OOM. `run_dir/checkpoints/`, the last `keep_checkpoints` kept.
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
    """

    def __init__(self, model: nn.Module, dataset: Dataset | DataLoader, *,
                 loss_fn: LossFn | None = None, step_fn: StepFn | None = None,
                 optimizer: torch.optim.Optimizer | OptimizerFactory | None = None, scheduler: Any = None,
                 batch_size: int = 32, micro_batch_size: int | str | None = None, keep_effective_batch: bool = True,
                 device: str | torch.device | None = None, policies: str | Path | Sequence[Policy] = "default",
                 memory_cap: float | int | str | None = None, inject_oom: float | None = None,
                 shuffle: bool = True, seed: int = 0, num_workers: int = 0,
                 collate_fn: Callable[[list], Any] | None = None, split_fn: SplitFn | None = None,
                 run_dir: str | Path | None = None, checkpoint_every: int | None = None,
                 checkpoint_interval: float | None = 900.0, keep_checkpoints: int = 3,
                 progress: bool = True, monitor: bool = True, monitor_interval: float = 0.5,
                 tensorboard: bool | str | Path = False, precision: str = "fp32",
                 clip_grad_norm: float | None = None, clip_grad_value: float | None = None,
                 scheduler_interval: str = "step", scheduler_metric: str | None = None,
                 eval_dataset: Dataset | DataLoader | None = None, eval_every: int | str | None = None,
                 eval_batch_size: int | None = None, metrics: Mapping[str, Metric] | None = None,
                 callbacks: Sequence[Any] | None = None, compile: bool | dict[str, Any] = False):
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if (loss_fn is None) == (step_fn is None):
            raise ValueError("pass exactly one of loss_fn(outputs, targets) or step_fn(model, micro_batch)")
        check_run_limits(checkpoint_every=checkpoint_every, checkpoint_interval=checkpoint_interval,
                         keep_checkpoints=keep_checkpoints, seed=seed, monitor=monitor, monitor_interval=monitor_interval)
        check_step_options(precision=precision, clip_grad_norm=clip_grad_norm, clip_grad_value=clip_grad_value,
                           scheduler_interval=scheduler_interval, compile=compile)
        self.callbacks = Callbacks(callbacks)
        self.ranks = from_environment()
        self.device = resolve_device(self.ranks.device_for(device, keep_effective_batch))
        self.ranks.join(self.device)
        self.model = model.to(self.device)
        self.ranks.wrap(self.model, self.device)
        self.keep_effective_batch = keep_effective_batch
        self.input = InputPipeline(dataset, batch_size=batch_size, shuffle=shuffle, seed=seed,
                                   num_workers=num_workers, collate_fn=collate_fn, device=self.device, ranks=self.ranks)
        batch_size = self.input.loader.batch_size  # validated by InputPipeline, or the DataLoader's own
        micro = resolve_micro_batch(micro_batch_size, batch_size)
        if loss_fn is not None and isinstance(dataset, Dataset) and not isinstance(dataset, IterableDataset):
            check_sample_layout(dataset[0])
        optimizer = make_optimizer(optimizer, self.model)
        if run_dir is None:  # every rank uses rank 0's
            run_dir = self.ranks.broadcast_object(str(Path("runs") / datetime.datetime.now().strftime("%Y%m%d-%H%M%S-%f")))
        self.run_dir = Path(run_dir)
        self.is_main = self.ranks.is_main
        self.log = RunLog(self.run_dir, writes=self.is_main, tensorboard=tensorboard, progress=progress)
        self.journal = self.log.journal  # rank 0 writes
        self.knobs = Knobs(batch_size=batch_size, micro_batch_size=micro, device=self.device,
                           memory_cap_bytes=resolve_memory_cap(memory_cap, self.device),
                           num_workers=self.input.num_workers)
        self.dispatcher = Dispatcher(resolve_policies(policies), self.knobs, self.journal)
        self.progress = Progress()
        self.core = StepCore(self.model, optimizer, make_scheduler(scheduler, optimizer), loss_fn=loss_fn,
                             step_fn=step_fn, split_fn=split_fn, device=self.device, ranks=self.ranks,
                             progress=self.progress, keep_effective_batch=keep_effective_batch,
                             inject_oom=injection_rate(inject_oom), seed=seed, precision=precision,
                             clip_grad_norm=clip_grad_norm, clip_grad_value=clip_grad_value,
                             scheduler_interval=scheduler_interval, compile=compile)
        check_evaluation(eval_dataset=eval_dataset, eval_every=eval_every, eval_batch_size=eval_batch_size,
                         metrics=metrics, scheduler_metric=scheduler_metric, plateau=self.core.plateau)
        self.eval_dataset = eval_dataset
        self.eval_every = eval_every if eval_every is not None or eval_dataset is None else "epoch"
        # What a ReduceLROnPlateau steps on: an evaluation's figure, or the epoch's training loss.
        self.scheduler_metric = scheduler_metric or ("loss" if eval_dataset is not None else "train_loss")
        self.evaluator = Evaluator(self.core, batch_size=eval_batch_size or batch_size, collate_fn=collate_fn,
                                   metrics=metrics, journal=self.journal)
        self.metrics: dict[str, float] = {}  # the last evaluation's
        self.checkpointer = Checkpointer(self.run_dir / "checkpoints", keep=keep_checkpoints, every=checkpoint_every,
                                         interval=checkpoint_interval, ranks=self.ranks, journal=self.journal)
        self.ladder = ReliefLadder(self.model, self.core, self.ranks, self.journal)
        self.monitor_link = MonitorLink(self.run_dir, self.device, enabled=monitor and self.is_main,
                                        interval=monitor_interval, cap_bytes=self.knobs.memory_cap_bytes,
                                        journal=self.journal)
        self.demand = StepDemand(self.device, self.knobs.memory_cap_bytes)
        self._last_good_micro: int | None = None
        self._allocator = None
        self._agreed: Agreement | None = None  # the last attempt's agreement: stop, checkpoint due
        self._loader_version = self.knobs.loader_version
        self._stop_request: str | None = None  # request_stop's reason
        self._memory_fraction_set = memory_cap is not None and self.device.type == "cuda"  # close() gives it back
        self._closed = False

    step, epoch, position, batches_done, ooms, samples_seen = map(
        _counter, ("step", "epoch", "position", "batches_done", "ooms", "samples_seen"))
    optimizer = property(lambda self: self.core.optimizer, doc="the optimizer (rebuilt when pruning)")
    scheduler = property(lambda self: self.core.scheduler, doc="the LR scheduler, or None")
    reliefs = property(lambda self: self.ladder.applied, doc="memory reliefs applied, in order")
    monitor = property(lambda self: self.monitor_link.process, doc="the monitor process, while one runs")
    loader = property(lambda self: self.input.loader, doc="the DataLoader in use now (rebuilt when a policy "
                                                          "changes workers or caching)")

    # ----------------------------------------------------------------------------- the loop
    def fit(self, epochs: int = 1, max_steps: int | None = None, resume: bool | str | Path = False) -> FitResult:
        """Train until `epochs` epochs (or `max_steps` optimizer steps) are done in all, or a
        callback calls `request_stop`.

        With `resume=True`, first continue from the newest valid checkpoint in `run_dir`
        (none: start fresh, and say so); with a path, from that checkpoint file. A
        deterministic run that is killed and resumed ends with the same weights and
        `samples_seen` as one that was not.
        """
        check_int("", "epochs", epochs, 1)
        check_int("", "max_steps", max_steps, 1, optional=True)
        if self._closed:
            raise RuntimeError("this AutoTrainer was closed: build a new one to train again")
        if resume is not False:
            path = None if resume is True else Path(resume)
            self.checkpointer.resume(self.load_state_dict, self.progress, self.device, path=path)
        self._stop_request = None
        warm_up_oom_path(self.device, self.knobs.memory_cap_bytes)
        self.core.zero_grad()
        self.demand.measure_room()
        started = time.perf_counter()
        self.checkpointer.restart_clock(self.step)
        self.journal.write("fit_start", self.step, self.epoch, device=str(self.device),
                           batch_size=self.knobs.batch_size, micro_batch_size=self.knobs.micro_batch_size,
                           keep_effective_batch=self.keep_effective_batch, epochs=epochs, max_steps=max_steps,
                           memory_cap=self.knobs.memory_cap_bytes, policies=[p.name for p in self.dispatcher.policies],
                           precision=self.core.precision, clip_grad_norm=self.core.clip_grad_norm,
                           clip_grad_value=self.core.clip_grad_value, compiled=self.core.compiled_model,
                           eval_every=self.eval_every if self.eval_dataset is not None else None)
        logger.info(f"training on {self.device}: batch {self.knobs.batch_size}, micro-batch "
                    f"{self.knobs.micro_batch_size}, run dir {self.run_dir}")
        self.monitor_link.start(self.step, self.epoch)
        compiles = compile_count() if self.core.compiled_model else 0
        self._fire(Event.FIT_START)
        self.callbacks.fire("on_fit_start", self)
        self.log.open_bar(self.input.planned_batches(self.progress, epochs, max_steps, self.keep_effective_batch))
        # A full gc.collect() after an OOM walks every object torch and the user's code
        # created (~0.2 s). Freezing what exists now leaves it only the objects made
        # during training, the failed attempt's among them. Skipped if the caller froze.
        freeze = gc.get_freeze_count() == 0
        if freeze:
            gc.freeze()
        epoch_loss = None
        try:
            with StopRequests() as self._stop:
                while self.epoch < epochs and (max_steps is None or self.step < max_steps) \
                        and self._stop_request is None:
                    epoch_loss = self._train_epoch(max_steps)
            self._checkpoint("end" if self._stop_request is None else "stop_requested")
        except BaseException as exc:
            # On the record before it propagates, so a crashed run's journal says why it ended.
            self.journal.write("fit_failed", self.step, self.epoch, error=f"{type(exc).__name__}: {exc}"[:500],
                               samples_seen=self.samples_seen)
            raise
        finally:
            self.log.close_bar()
            self.log.flush()
            if freeze:
                gc.unfreeze()
            self.monitor_link.stop()
        wall = time.perf_counter() - started
        step_size = self.knobs.batch_size if self.keep_effective_batch else min(self.knobs.micro_batch_size,
                                                                                 self.knobs.batch_size)
        result = FitResult(samples_seen=self.samples_seen, steps=self.step, epochs=self.epoch, batch_size=step_size,
                           micro_batch_size=self.knobs.micro_batch_size, ooms=self.ooms, loss=epoch_loss,
                           wall_seconds=wall, run_dir=self.run_dir, metrics=dict(self.metrics),
                           stopped=self._stop_request)
        compiled = {"compiles": compile_count() - compiles} if self.core.compiled_model else {}
        self.journal.write("fit_end", self.step, self.epoch, samples_seen=result.samples_seen, ooms=self.ooms,
                           batch_size=result.batch_size, micro_batch_size=result.micro_batch_size,
                           wall_seconds=wall, loss=epoch_loss, metrics=result.metrics, stopped=result.stopped,
                           **compiled)
        self.log.flush()
        self._fire(Event.FIT_END)
        self.callbacks.fire("on_fit_end", self, result)
        return result

    def evaluate(self, dataset: Dataset | DataLoader | None = None) -> dict[str, float]:
        """The mean loss (`"loss"`) and every metric over `dataset` (default: `eval_dataset`),
        in eval mode under `torch.no_grad()`, averaged over items where the step reports them.
        Evaluation has a micro-batch of its own: an OOM halves it and runs the same samples
        again (none is lost), and the training micro-batch stays as it is."""
        dataset = self.eval_dataset if dataset is None else dataset
        if dataset is None:
            raise ValueError("evaluate() needs a dataset: pass one, or eval_dataset= to AutoTrainer")
        try:
            metrics = self.evaluator.run(dataset, self.step, self.epoch)
        except OutOfMemory:
            self._checkpoint("out_of_memory")  # the training so far survives the error
            raise
        self.metrics = metrics
        logger.info("evaluation at step {}: {}", self.step, ", ".join(f"{k} {v:.4g}" for k, v in metrics.items()))
        self.callbacks.fire("on_evaluate", self, metrics)
        if self.core.plateau and self.scheduler_metric != "train_loss":
            self.core.step_scheduler(metrics[self.scheduler_metric])
        return metrics

    def request_stop(self, reason: str = "requested") -> None:
        """End the fit after the current step, with a checkpoint (early stopping, from a callback).
        `FitResult.stopped` says why; a later `fit` call goes on from there."""
        self._stop_request = str(reason)

    def close(self) -> None:
        """Leave the user's model as it was given (the trainer's hook off it), give back the CUDA
        memory fraction, and close the journal, steps log and TensorBoard. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self.ladder.close()
        self.monitor_link.stop()
        if self._memory_fraction_set:
            torch.cuda.set_per_process_memory_fraction(1.0, self.device)
        self.log.close()

    def __enter__(self) -> "AutoTrainer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _train_epoch(self, max_steps: int | None) -> float | None:
        self._fire(Event.EPOCH_START)
        self.model.train()
        loss_sum = torch.zeros((), device=self.device)  # summed on the device: no sync per step
        loss_weight: Any = 0  # samples, or items where the step reports them
        batches = self.input.batches(self.epoch, self.position, self.batches_done)
        finished_epoch = True
        while True:
            wait_start = time.perf_counter()
            try:
                batch = next(batches)
            except StopIteration:
                break
            step_start = time.perf_counter()
            n = batch_len(batch)
            self.demand.start()
            retries, batch_loss, weight = self._train_batch(batch, n)
            self._last_good_micro = self.knobs.micro_batch_size
            self.demand.finish()
            step_end = time.perf_counter()
            loss_sum += batch_loss
            loss_weight = loss_weight + weight
            self.progress.position += n
            self.progress.batches_done += 1
            # One memory_stats() call a step (CUDA); its peak was reset by self.demand.start().
            self._allocator = allocator_stats(self.device, reset_peak=False)
            timing = StepTiming(step_seconds=step_end - wait_start, data_wait_seconds=step_start - wait_start,
                                retries=retries)
            self._log_step(timing, n, batch_loss, weight)
            self._fire(Event.BATCH_END, timing=timing)
            self.ladder.effect(self.demand.last, self.step, self.epoch)
            self._carry_out(self.ranks.relief_now(self.knobs, self.ladder.take_agreed()))
            for event in self.monitor_link.watch(self._allocator, self.step, self.epoch):
                self._fire(event, force=True)
            for event in self.input.on_step(timing, n, self.journal, self.step, self.epoch):
                self._fire(event, timing=timing)
            if self.knobs.loader_version != self._loader_version:  # a policy changed workers or caching
                del batches  # its workers exit before the new loader's start
                batches = self._rebuild_loader()
            self.log.show(step_end, loss=lambda: f"{float(loss_sum / loss_weight) if not _is_zero(loss_weight) else 0:.4f}",
                          micro=self.knobs.micro_batch_size,
                          mem=lambda: memory_text(self.device, self.knobs.memory_cap_bytes))
            if self._agreed.stop_signal:  # agreed by all ranks under torchrun
                signum = self._agreed.stop_signal
                raise self.checkpointer.preempted(signum, self._checkpoint(f"signal {signal.Signals(signum).name}"),
                                                  self.progress)
            self.callbacks.fire("on_step_end", self)
            if isinstance(self.eval_every, int) and self.step % self.eval_every == 0:
                self.evaluate()
            # After the step's callbacks and evaluation: a resume from this checkpoint has seen them.
            if self._agreed.checkpoint_due:
                self._checkpoint("every" if self._agreed.checkpoint_due == CheckpointDue.BY_STEPS else "interval")
            if self._stop_requested():
                finished_epoch = False
                break
            if max_steps is not None and self.step >= max_steps:
                finished_epoch = False
                break
        epoch_loss = float(loss_sum / loss_weight) if not _is_zero(loss_weight) else None
        if finished_epoch:
            self.progress.epoch += 1
            self.progress.position = self.progress.batches_done = 0
            self.journal.write("epoch_end", self.step, self.epoch - 1, samples_seen=self.samples_seen,
                               loss=epoch_loss, micro_batch_size=self.knobs.micro_batch_size)
            self.input.epoch_end(self.journal, self.step, self.epoch - 1)
            self._fire(Event.EPOCH_END)
            if self.eval_every == "epoch":
                self.evaluate()
            if self.core.scheduler_interval == "epoch" and not self.core.plateau:
                self.core.step_scheduler(None)
            elif self.core.plateau and self.scheduler_metric == "train_loss":
                self.core.step_scheduler(epoch_loss)
            self.callbacks.fire("on_epoch_end", self)
            self._stop_requested()
        return epoch_loss

    def _stop_requested(self) -> bool:
        # Under torchrun a stop any rank's callback asked for stops every rank at the same step
        # (one small all-reduce a step, only when there are callbacks).
        if self.callbacks and self.ranks.world > 1:
            if self.ranks.any(self._stop_request is not None, self.device) and self._stop_request is None:
                self._stop_request = "another rank's callback asked to stop"
        if self._stop_request is not None:
            self.journal.write("stop_requested", self.step, self.epoch, reason=self._stop_request)
            logger.info(f"stopping at step {self.step}: {self._stop_request}")
            return True
        return False

    def _train_batch(self, batch: Any, n: int) -> tuple[int, torch.Tensor, Any]:
        """Train on one batch until every sample of it is in a completed optimizer step.

        Returns the number of OOMs survived on it, its summed (not mean) loss and what that is
        summed over (samples, or the step's items).
        """
        done = 0  # samples whose optimizer step has completed
        tried: list[int] = []
        loss_sum = torch.zeros((), device=self.device)
        weight: Any = 0
        while done < n:
            attempt = self.core.attempt(batch, n, done, self.knobs.micro_batch_size)
            done = attempt.done
            loss_sum += attempt.loss_sum  # with keep_effective_batch=False: the chunks already stepped
            weight = weight + attempt.weight
            # Every rank joins here, failed or not: nobody waits in a gradient all-reduce for a
            # rank that ran out of memory. A checkpoint is due by the step this batch ends at.
            agreed = self._agreed = self.ranks.agree(Agreement(
                failed_size=attempt.failed_size, micro_batch_size=self.knobs.micro_batch_size,
                stop_signal=self._stop.signum or 0,
                checkpoint_due=self.checkpointer.due(self.step + (1 if self.keep_effective_batch else 0)),
                relief=self.ranks.offer_relief(self.knobs), fatal=self.core.failure), self.device)
            self.knobs.follow(agreed.micro_batch_size)  # rank 0's
            self.ladder.agreed = agreed.relief or self.ladder.agreed
            if agreed.fatal:
                self._give_up_on_the_step(agreed.fatal)
            if agreed.failed_size is None:
                if self.keep_effective_batch:
                    self.core.reduce_gradients(attempt)
                    self.core.optimizer_step(n)
                    done = n
                failure = self.ranks.known_to_all(self.core.failure)
                if failure:
                    self._give_up_on_the_step(failure)
                break
            # Out of the `except` block now, so the exception and its frames are gone and
            # the tensors they pinned (activations, partial gradients) can be freed.
            tried.append(agreed.failed_size)
            self._recover_from_oom(agreed.failed_size, tried, attempt)
        return len(tried), loss_sum, weight

    def _recover_from_oom(self, failed_size: int, tried: list[int], attempt: Attempt) -> None:
        """Free what the failed attempt held, tell the policies, and give up if none helped."""
        self.core.zero_grad()  # partial gradients of the failed batch must not leak into the retry
        free_memory(self.device)
        self.progress.ooms += 1
        lost = time.perf_counter() - attempt.started  # the failed work and the clean-up: what the OOM cost
        self.journal.write("oom", self.step, self.epoch, micro_batch_size=failed_size, device=str(self.device),
                           message=attempt.message, injected=attempt.injected, lost_seconds=round(lost, 4),
                           ooms=self.ooms)
        logger.warning(f"out of memory at micro-batch {failed_size} on {self.device}; retrying the same batch")
        self._fire(Event.OOM, failed_micro_batch=failed_size, force=True)
        # Every rank's next move is rank 0's: the size to retry at, and any relief first.
        micro, relief = self.ranks.follow_rank0(self.knobs.micro_batch_size, self.ranks.offer_relief(self.knobs),
                                                self.device)
        self.knobs.follow(micro)
        self.ladder.agreed = relief or self.ladder.agreed
        if self.knobs.micro_batch_size < failed_size:
            self.knobs.take_relief()  # a smaller micro-batch first: reliefs are the last resort
            self.ladder.take_agreed()
            return
        if attempt.not_supported is not None:
            raise attempt.not_supported  # cuDNN's NOT_SUPPORTED at the floor may not be memory: no reliefs
        relief = self.ranks.relief_now(self.knobs, self.ladder.take_agreed())
        if relief is not None:
            # Without the relief the run would stop here; a relief changes the model or the
            # kernels it runs, under memory that is already exhausted: save the progress first.
            self._checkpoint("before_relief")
            if self._carry_out(relief):
                return  # the same batch again, with the relief
        memory = describe_memory(self.device)
        self.journal.write("out_of_memory", self.step, self.epoch, micro_batch_size=failed_size,
                           device=str(self.device), tried=tried, memory=memory)
        self._checkpoint("out_of_memory")  # the progress so far survives the error
        raise OutOfMemory(
            f"out of memory on {self.device} even at micro-batch {failed_size} "
            f"(sizes tried on this batch: {', '.join(map(str, tried))}); no policy could make more room. "
            f"Memory: {memory}. Last error: {attempt.message}")

    def _give_up_on_the_step(self, why: str) -> None:
        # A smaller micro-batch cannot help an optimizer state that does not fit. Every rank
        # knows by now (alone at once; under torchrun through an agreement or a gather).
        memory = describe_memory(self.device)
        self.journal.write("out_of_memory", self.step, self.epoch, phase="optimizer_step", device=str(self.device),
                           memory=memory, error=why)
        self._checkpoint("out_of_memory", report_failure=False)  # the weights may hold part of the failed step
        raise OutOfMemory(f"out of memory on {self.device} in optimizer.step(): the optimizer state does not fit, "
                          f"whatever the micro-batch. Memory: {memory}. {why}")

    def _carry_out(self, relief: Relief | None) -> bool:
        try:
            applied = self.ladder.apply(relief, self.step, self.epoch, self.demand.last, checkpoint=self._checkpoint)
        except ReliefFailed as exc:
            self.dispatcher.relief_failed(relief, str(exc))  # the policy that asked learns not to ask again
            return False
        if applied:
            # What stays resident changed (pruning shrinks weights and optimizer state): demand
            # is measured from here on against the room there is now.
            self.demand.measure_room()
        return applied

    # ----------------------------------------------------------------------------- helpers
    def _fire(self, event: Event, failed_micro_batch: int | None = None, timing: StepTiming | None = None,
              force: bool = False) -> None:
        # Building a snapshot reads memory figures; skip it when nobody listens.
        if not force and not any(event in p.events for p in self.dispatcher.policies):
            return
        self.dispatcher.fire(event, Snapshot(
            step=self.step, epoch=self.epoch, batch_size=self.knobs.batch_size,
            micro_batch_size=self.knobs.micro_batch_size, device=str(self.device),
            keep_effective_batch=self.keep_effective_batch, failed_micro_batch=failed_micro_batch,
            last_good_micro_batch=self._last_good_micro, step_demand=self.demand.last, ooms=self.ooms,
            sample=self.monitor_link.latest(fresh=event is Event.OOM), window=tuple(self.monitor_link.window),
            allocator=self._allocator, timing=timing, input=self.input.state(), reliefs=tuple(self.ladder.applied),
            last_relief_step=self.ladder.last_step, pruned_fraction=self.ladder.pruned_fraction))

    def _log_step(self, timing: StepTiming, samples: int, batch_loss: torch.Tensor, loss_weight: Any) -> None:
        allocator = self._allocator
        self.log.step(self.step, self.epoch, samples=samples, samples_seen=self.samples_seen,
                      micro_batch_size=self.knobs.micro_batch_size, step_seconds=timing.step_seconds,
                      data_wait_fraction=timing.data_wait_fraction, demand=self.demand.last,
                      allocated_bytes=allocator.allocated_bytes if allocator else None,
                      reserved_bytes=allocator.reserved_bytes if allocator else None,
                      batch_loss=batch_loss, loss_weight=loss_weight, sample=self.monitor_link.latest,
                      grad_norm=self.core.grad_norm)

    def _rebuild_loader(self) -> Iterator[Any]:
        self._loader_version = self.knobs.loader_version
        host_cap = self.knobs.memory_cap_bytes if self.device.type == "cpu" else None
        return self.input.rebuild(self.knobs.num_workers, self.knobs.sample_cache, self.journal, self.step,
                                  self.epoch, self.position, host_cap_bytes=host_cap)

    # ----------------------------------------------------------------------------- checkpoints
    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue exactly: weights, optimizer, scheduler, counters,
        position in the epoch, sizes, reliefs, policy states and random states."""
        return {"format": 1, "model": self.model.state_dict(), **self.core.state_dict(), **self.progress.state_dict(),
                "batch_size": self.knobs.batch_size, "micro_batch_size": self.knobs.micro_batch_size,
                "num_workers": self.knobs.num_workers, "reliefs": self.ladder.state_dict(),
                "policies": self.dispatcher.state_dict(), "evaluation": self.evaluator.state_dict(),
                "callbacks": self.callbacks.state_dict(), "rng": rng_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `state_dict` returned."""
        if state.get("reliefs"):
            self.ladder.load_state_dict(state["reliefs"])  # a pruned model's weights fit only a pruned model
        self.model.load_state_dict(state["model"])
        self.core.load_state_dict(state)
        self.progress.load_state_dict(state)
        if state["batch_size"] != self.knobs.batch_size:
            raise ValueError(f"the checkpoint was made with batch_size {state['batch_size']}, this trainer has "
                             f"{self.knobs.batch_size}: the position in the epoch would not line up")
        workers = state.get("num_workers", self.knobs.num_workers) if self.input.owned else self.knobs.num_workers
        if self.knobs.restore(state["micro_batch_size"], workers):  # as tuned before the stop
            self.input.set_workers(workers)
        self.dispatcher.load_state_dict(state["policies"])
        if state.get("evaluation"):
            self.evaluator.load_state_dict(state["evaluation"])
        self.callbacks.load_state_dict(state.get("callbacks", {}))
        set_rng_state(rank_rng_state(state, self.ranks.rank, self.ranks.world))

    def _checkpoint(self, reason: str, report_failure: bool = True) -> Path | None:
        try:
            return self.checkpointer.save(reason, self.state_dict, self.step, self.epoch,
                                          failure=self.core.failure if report_failure else None,
                                          position=self.position, samples_seen=self.samples_seen)
        except RankFailed as exc:  # another rank's optimizer step ran out of memory
            self._give_up_on_the_step(str(exc))
