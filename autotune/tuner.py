"""Tuner: OOM-resilient training steps for a loop you keep, and the core `AutoTrainer` is built on.

    from autotune import Tuner
    with Tuner(model, optimizer, run_dir="runs/x") as tuner:    # monitor, journal, policies
        for batch in loader:
            loss = tuner.step(batch, step_fn)   # split, retry the same batch on OOM, accumulate, step

One batch, and where each `Event` fires (AutoTrainer's loop around it is in trainer.py)::

    step(batch):
      measured = cadence says so (cadence.py)       # a changing run: every batch; steady: 1 in 32
      while the batch is not done:                  # retry the same batch until it fits
        measured: the step's peak memory from here (memory.py's StepDemand)
        sharded (FSDP2): every rank takes rank 0's micro-batch first (sharded.py)
        attempt (step.py): forward/backward per micro-batch; except OOM: note the size
          (sharded: a check before each FSDP2 exchange; another rank's failure stops this one there)
        agree (distributed.py): one small all-reduce under torchrun, failed or not
        no failure: reduce gradients; unscale, clip; optimizer.step(); zero_grad()
        failure: zero_grad, free memory             OOM -> policies -> e.g. SetMicroBatch(n // 2)
          at the smallest size: a relief if a policy asked (checkpoint first), else
          checkpoint and raise autotune.OutOfMemory with the figures; the retry is measured
                                                    BATCH_END
      measured: the step's need and room            BATCH_MEASURED
      a relief a policy asked for; monitor samples  MEMORY_HIGH | MEMORY_PRESSURE

`accumulate(batch, step_fn)` is the same attempt without the optimizer step, for a trainer
that steps its own optimizer (the Hugging Face and Lightning integrations): gradients already
accumulated from earlier batches are set aside during the attempt and added back after it, so
a retry never loses or doubles them.

Owns: the step core, OOM recovery, the knobs and the policies' dispatcher, the run log, the
monitor link, the relief ladder. The data, epochs, evaluation and scheduled checkpoints are
the caller's (AutoTrainer's, or your loop's); `state_dict()` is what your checkpoints keep.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools
import time
import weakref
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
from torch import nn

from autotune.actions import Relief
from autotune.batching import SplitFn, batch_len
from autotune.breakdown import describe_breakdown, gradient_bytes, oom_breakdown
from autotune.cadence import MeasureCadence
from autotune import checkpoint_format
from autotune.checkpoint import Checkpointer, RankFailed, rng_state, set_rng_state
from autotune.config import (OptimizerFactory, check_step_options, injection_rate, make_optimizer, make_scheduler,
                             resolve_device, resolve_memory_cap)
from autotune.dispatch import Dispatcher
from autotune.distributed import Agreement, Ranks, Solo, from_environment
from autotune.events import Event
from autotune.journal import RunLog
from autotune.knobs import Knobs
from autotune.memory import StepDemand, describe_memory, free_memory, warm_up_oom_path
from autotune.memory_history import AllocationHistory
from autotune.monitor.link import MonitorLink
from autotune.notices import warn
from autotune.oom import OutOfMemory
from autotune.policy import Policy
from autotune.presets import resolve_policies
from autotune.progress import Progress
from autotune.relief.ladder import ReliefFailed, ReliefLadder
from autotune.snapshot import InputState, Snapshot, StepTiming
from autotune.step import Attempt, LossFn, Losses, StepCore, StepFn
from autotune.validate import check_int


@dataclasses.dataclass
class BatchOutcome:
    """What training one batch did."""

    retries: int  # OOMs survived on it
    losses: Losses  # its kept micro-batches' losses, combined when read
    device: torch.device

    @property
    def weight(self) -> Any:
        """What `loss_sum` is summed over: samples, or the step's items."""
        return self.losses.weight

    @property
    def loss_sum(self) -> torch.Tensor:
        """The summed (not mean) loss over `weight`."""
        return self.losses.total(self.device)

    def mean_loss(self) -> torch.Tensor:
        """The batch's mean loss (0-d, on the device; no op when the batch ran in one piece)."""
        return self.losses.mean(self.device)


def default_run_dir(ranks: Solo | Ranks) -> Path:
    """`runs/<timestamp>`, rank 0's on every rank."""
    return Path(ranks.broadcast_object(str(Path("runs") / datetime.datetime.now().strftime("%Y%m%d-%H%M%S-%f"))))


class Tuner:
    """OOM-resilient steps on your model and optimizer, in your own loop.

    Args:
        model: the `nn.Module` to train; moved to `device` (wrapped in DDP under torchrun).
        optimizer: an optimizer over the model's parameters, or a factory `params -> Optimizer`;
            default AdamW(lr=1e-3). Pruning (a relief) rebuilds it: use `tuner.optimizer`.
        loss_fn, step_fn: the default for `step`: `loss_fn(outputs, targets)` on `(inputs,
            targets)` batches, or `step_fn(model, micro_batch) -> loss | (loss, n_items)`.
        scheduler: an LR scheduler over the optimizer (or a factory), stepped after each
            optimizer step (`scheduler_interval="step"`) or by you (`tuner.step_scheduler()`).
        micro_batch_size: samples per forward/backward at the start (default: the whole batch).
        batch_size: the largest batch you will pass (default: the largest seen so far); the
            micro-batch never grows past it.
        keep_effective_batch: on OOM, accumulate smaller micro-batches into the same optimizer
            step (True), or step on each smaller chunk (False).
        device, policies, memory_cap, precision, clip_grad_norm, clip_grad_value, split_fn,
        run_dir, monitor, monitor_interval, tensorboard, inject_oom, seed, compile,
        memory_snapshot, shard: as for `AutoTrainer`.
        reliefs: let policies change the model (autocast, activation checkpointing, pruning)
            at the smallest micro-batch; False where another framework owns the optimizer.
        on_nonfinite: NaN or inf gradients in a batch: "skip" its optimizer step (the default, as
            the fp16 gradient scaler does; journaled, said once, its samples not counted as
            trained) or "stop" with `NonFiniteStep` before the step. Never trained on either way;
            the check costs one host sync a step. With fp16, the scaler's own skips are journaled.
        owns_optimizer: False where another trainer steps the optimizer and wraps the model
            (HF, Lightning): no optimizer here, no DDP wrapper; use `accumulate`.
        progress: a tqdm bar (AutoTrainer's); ranks, counters: AutoTrainer's and the
            integrations' (the job they joined, the counters they share).
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer | OptimizerFactory | None = None, *,
                 loss_fn: LossFn | None = None, step_fn: StepFn | None = None, scheduler: Any = None,
                 micro_batch_size: int | None = None, batch_size: int | None = None,
                 keep_effective_batch: bool = True, device: str | torch.device | None = None,
                 policies: str | Path | Sequence[Policy] | None = "default", memory_cap: float | int | str | None = None,
                 precision: str = "fp32", clip_grad_norm: float | None = None, clip_grad_value: float | None = None,
                 scheduler_interval: str = "step", split_fn: SplitFn | None = None, run_dir: str | Path | None = None,
                 monitor: bool = True, monitor_interval: float = 0.5, tensorboard: bool | str | Path = False,
                 inject_oom: float | None = None, seed: int = 0, compile: bool | dict[str, Any] = False,
                 reliefs: bool = True, progress: bool = False, owns_optimizer: bool = True,
                 ranks: Solo | Ranks | None = None, counters: Progress | None = None,
                 memory_snapshot: bool | int = False, shard: bool = False, on_nonfinite: str = "skip"):
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if loss_fn is not None and step_fn is not None:
            raise ValueError("pass one of loss_fn(outputs, targets) or step_fn(model, micro_batch), not both")
        check_int("", "micro_batch_size", micro_batch_size, 1, optional=True)
        check_int("", "batch_size", batch_size, 1, optional=True)
        if not isinstance(memory_snapshot, bool):
            check_int("", "memory_snapshot", memory_snapshot, 1)
        if micro_batch_size is not None and batch_size is not None and micro_batch_size > batch_size:
            raise ValueError(f"micro_batch_size ({micro_batch_size}) cannot exceed batch_size ({batch_size})")
        check_step_options(precision=precision, clip_grad_norm=clip_grad_norm, clip_grad_value=clip_grad_value,
                           scheduler_interval=scheduler_interval, compile=compile, on_nonfinite=on_nonfinite)
        self.ranks = ranks if ranks is not None else from_environment()
        self.device = resolve_device(self.ranks.device_for(device, keep_effective_batch))
        if ranks is None:  # ranks given: the caller joined the job
            self.ranks.join(self.device)
        self.model = model.to(self.device)
        if owns_optimizer:
            self.ranks.wrap(self.model, self.device, shard=shard)
        # Before any file is written: a bad optimizer is an error with nothing left behind
        # (and the first optimizer of a process imports torch._dynamo: seconds).
        optimizer = make_optimizer(optimizer, self.model) if owns_optimizer else None
        # Before any file is written too: memory_snapshot where the allocator keeps no history is an error.
        self.history = (AllocationHistory(self.device, max_entries=100_000 if memory_snapshot is True else memory_snapshot)
                        if memory_snapshot else None)
        self.keep_effective_batch = keep_effective_batch
        self.run_dir = Path(run_dir) if run_dir is not None else default_run_dir(self.ranks)
        self.is_main = self.ranks.is_main
        self.log = RunLog(self.run_dir, writes=self.is_main, tensorboard=tensorboard, progress=progress)
        self.journal = self.log.journal  # rank 0 writes
        self.progress = counters if counters is not None else Progress()
        self.core = StepCore(self.model, optimizer, make_scheduler(scheduler, optimizer) if optimizer else None,
                             loss_fn=loss_fn, step_fn=step_fn, split_fn=split_fn, device=self.device,
                             ranks=self.ranks, progress=self.progress, keep_effective_batch=keep_effective_batch,
                             inject_oom=injection_rate(inject_oom), seed=seed, precision=precision,
                             clip_grad_norm=clip_grad_norm, clip_grad_value=clip_grad_value,
                             scheduler_interval=scheduler_interval, compile=compile, on_nonfinite=on_nonfinite)
        # Sizes are known once batches are: the first one sets them unless given here.
        self.knobs = Knobs(batch_size=batch_size or micro_batch_size or 1,
                           micro_batch_size=micro_batch_size or batch_size or 1, device=self.device,
                           memory_cap_bytes=resolve_memory_cap(memory_cap, self.device))
        self._sized = batch_size is not None or micro_batch_size is not None
        self._batch_size_fixed = batch_size is not None
        self.dispatcher = Dispatcher(resolve_policies(policies), self.knobs, self.journal)
        self.reliefs_allowed = reliefs
        self.ladder = ReliefLadder(self.model, self.core, self.ranks, self.journal)
        self.monitor_link = MonitorLink(self.run_dir, self.device, enabled=monitor and self.is_main,
                                        interval=monitor_interval, cap_bytes=self.knobs.memory_cap_bytes,
                                        journal=self.journal)
        self.demand = StepDemand(self.device, self.knobs.memory_cap_bytes)
        self.cadence = MeasureCadence()
        self.measured = False  # whether the last batch was measured (its demand read, BATCH_MEASURED fired)
        self.allocator = None  # the last step's allocator figures (CUDA)
        self.agreed: Agreement | None = None  # the last attempt's agreement
        self.last_good_micro: int | None = None
        # What the caller adds to snapshots, and who writes checkpoints: AutoTrainer sets both.
        self.input_state: Callable[[], InputState | None] = _no_input
        self._save: weakref.WeakMethod | None = None
        self._checkpointer = Checkpointer(self.run_dir / "checkpoints", keep=3, every=None, interval=None,
                                          ranks=self.ranks, journal=self.journal)
        # The demand's and the history's, not ours: no reference cycle
        self.core.on_failure = functools.partial(_read_at_failure, self.demand, self.history, self.model, self.device)
        self.last_snapshot: dict[str, Any] | None = None  # the allocator's state at the last OOM: path, sites
        self.last_breakdown: dict[str, Any] | None = None  # where the memory went at the last OOM
        self._memory_fraction_set = memory_cap is not None and self.device.type == "cuda"
        self._started = False  # the standalone run's start is journaled on the first step
        self._holding = False  # gradients of earlier batches set aside during this one (train_batch)
        self._last_step_end: float | None = None
        self._closed = False

    step_count = property(lambda self: self.progress.step, doc="optimizer steps taken")
    ooms = property(lambda self: self.progress.ooms, doc="out-of-memory errors survived")
    samples_seen = property(lambda self: self.progress.samples_seen, doc="samples in completed optimizer steps")
    micro_batch_size = property(lambda self: self.knobs.micro_batch_size, doc="samples per forward/backward now")
    optimizer = property(lambda self: self.core.optimizer, doc="the optimizer (rebuilt when pruning)")
    scheduler = property(lambda self: self.core.scheduler, doc="the LR scheduler, or None")
    reliefs = property(lambda self: self.ladder.applied, doc="memory reliefs applied, in order")

    # ------------------------------------------------------------------------- your loop
    def step(self, batch: Any, step_fn: StepFn | None = None, *, loss_fn: LossFn | None = None) -> torch.Tensor:
        """Train on `batch` until every sample of it is in a completed optimizer step: split into
        micro-batches, retried at a smaller size on OOM, accumulated, then one optimizer step.

        Returns the batch's mean loss as a 0-d tensor (read it with `.item()` when you log:
        that waits for the device). `step_fn`/`loss_fn` default to the constructor's."""
        self._use(step_fn, loss_fn)
        n = self._begin_batch(batch)
        # What the loop accumulated before this call (Accelerate's accumulate() holds gradients
        # back over several batches) is kept out of the attempts and added back before the
        # optimizer step: a failed attempt's gradients are dropped by the Tuner itself, never
        # through an optimizer wrapper's zero_grad (Accelerate's skips it between sync steps).
        held = set_aside_gradients(self.model) if self.keep_effective_batch else None
        outcome = self.train_batch(batch, n, held=held)
        self._end_own_batch(n, outcome)
        return outcome.mean_loss()

    def accumulate(self, batch: Any, step_fn: StepFn, *, n: int | None = None) -> BatchOutcome:
        """Forward and backward over `batch` in micro-batches with OOM retries, and no optimizer
        step: for a trainer that steps its own optimizer. `step_fn(model, micro)` returns a loss
        already scaled so that the micro-batches' losses add up to the batch's (the caller knows
        its normalisation); gradients add onto those accumulated before."""
        self._use(step_fn, None)
        n = self._begin_batch(batch, n)
        held = set_aside_gradients(self.model)  # a retry drops the failed attempt's gradients, never these
        outcome = self.train_batch(batch, n, optimizer_step=False, held=held)
        add_gradients(held)
        self.progress.samples_seen += n * self.ranks.world
        self._end_own_batch(n, outcome)
        return outcome

    def _end_own_batch(self, n: int, outcome: BatchOutcome) -> None:
        # Without a loader of our own, a step's time runs from the last one's end (data wait unknown: 0).
        now = time.perf_counter()
        timing = StepTiming(step_seconds=now - self._last_step_end, data_wait_seconds=0.0, retries=outcome.retries)
        self._last_step_end = now
        self.end_batch(timing, n, outcome)

    def step_scheduler(self, metric: float | None = None) -> None:
        """Step the scheduler yourself (scheduler_interval="epoch"; a ReduceLROnPlateau's metric)."""
        self.core.step_scheduler(metric)

    def _use(self, step_fn: StepFn | None, loss_fn: LossFn | None) -> None:
        if step_fn is not None and loss_fn is not None:
            raise ValueError("pass step_fn or loss_fn, not both")
        if step_fn is not None or loss_fn is not None:
            self.core.step_fn, self.core.loss_fn = step_fn, loss_fn
        elif self.core.step_fn is None and self.core.loss_fn is None:
            raise ValueError("Tuner.step needs step_fn(model, micro_batch) or loss_fn(outputs, targets): "
                             "pass one here or to Tuner(...)")

    def _begin_batch(self, batch: Any, n: int | None = None) -> int:
        if self._closed:
            raise RuntimeError("this Tuner was closed: build a new one to train again")
        n = batch_len(batch) if n is None else n
        if not self._sized:  # the first batch: start at the whole batch
            self.knobs.batch_size = self.knobs.micro_batch_size = n
            self._sized = True
        elif n > self.knobs.batch_size and not self._batch_size_fixed:
            self.knobs.batch_size = n  # the micro-batch may grow up to the largest batch seen
        if not self._started:
            self._start_standalone()
        return n

    def _start_standalone(self) -> None:
        self._started = True
        self.begin(batch_size=self.knobs.batch_size, tuner=True)
        self.fire(Event.FIT_START)

    def begin(self, **fit_start: Any) -> None:
        """Before the first batch of a run: the OOM path warmed up, the run's start journaled
        (with the caller's `fit_start` fields), the monitor started."""
        warm_up_oom_path(self.device, self.knobs.memory_cap_bytes)
        self.core.zero_grad()
        self.demand.measure_room()
        self.journal.write("fit_start", self.step_count, self.progress.epoch, device=str(self.device),
                           micro_batch_size=self.knobs.micro_batch_size, keep_effective_batch=self.keep_effective_batch,
                           memory_cap=self.knobs.memory_cap_bytes, policies=[p.name for p in self.dispatcher.policies],
                           precision=self.core.precision, clip_grad_norm=self.core.clip_grad_norm,
                           clip_grad_value=self.core.clip_grad_value, compiled=self.core.compiled_model, **fit_start)
        self.monitor_link.start(self.step_count, self.progress.epoch)
        if self.history is not None:
            self.history.start()
        self._last_step_end = time.perf_counter()

    # ------------------------------------------------------------------------- one batch
    def train_batch(self, batch: Any, n: int, *, optimizer_step: bool = True,
                    proposal: Callable[[], dict[str, Any]] | None = None,
                    held: list[tuple[nn.Parameter, torch.Tensor]] | None = None) -> BatchOutcome:
        """Train on one batch until every sample of it is in a completed optimizer step (or, with
        `optimizer_step=False`, in the accumulated gradients). `proposal()` adds the caller's
        fields to each attempt's agreement (a stop signal, a checkpoint due). `held`: gradients
        set aside before the batch (`set_aside_gradients`), added to the batch's before its
        optimizer step; while they are held, a failed attempt's gradients are dropped from the
        parameters directly."""
        self._holding = held is not None
        done = 0  # samples whose optimizer step has completed
        tried: list[int] = []
        additive = not optimizer_step
        losses: Losses | None = None
        cadence = self.cadence
        measured = self.measured = cadence.due(self.knobs.micro_batch_size)
        rebase = not cadence.last_measured
        while done < n:
            if measured:
                self.demand.start(self.knobs.micro_batch_size, rebase=rebase)  # a retry is measured afresh
                rebase = False
            if self.ranks.sharded is not None:
                self.knobs.follow(self.ranks.sharded.same_size(self.knobs.micro_batch_size, n, self.step_count))
            attempt = self.core.attempt(batch, n, done, self.knobs.micro_batch_size, additive=additive)
            # Sharded, a rank that cannot go on (its optimizer step failed) ran no exchange: it says
            # "failed" at the others' first check, and the agreement then stops every rank.
            if self.ranks.end_attempt(attempt.failed_size is not None or self.core.failure is not None,
                                      attempt.peer_failed):
                attempt.discard()  # sharded: another rank failed, during this attempt or after it
            done = attempt.done
            # Every rank joins here, failed or not: nobody waits in a gradient all-reduce for a
            # rank that ran out of memory.
            agreed = self.agreed = self.ranks.agree(Agreement(
                failed_size=attempt.failed_size, micro_batch_size=self.knobs.micro_batch_size,
                relief=self.ranks.offer_relief(self.knobs), fatal=self.core.failure,
                **(proposal() if proposal is not None else {})), self.device)
            if agreed.failed_size is not None and (self.keep_effective_batch or additive):
                # Another rank ran out of memory: this rank's whole attempt is retried with
                # it, so its losses go too (kept, they were counted twice).
                attempt.discard()
            if losses is None:
                losses = attempt.losses
            else:  # with keep_effective_batch=False, a failed attempt's stepped chunks count too
                losses.parts += attempt.losses.parts
            self.knobs.follow(agreed.micro_batch_size)  # rank 0's
            self.ladder.agreed = agreed.relief or self.ladder.agreed
            if agreed.fatal:
                self.give_up_on_the_step(agreed.fatal)
            if agreed.failed_size is None:
                if not optimizer_step:
                    done = n
                elif self.keep_effective_batch:
                    if held and getattr(self.ranks, "bucket", None) is not None:
                        # The held gradients are views of DDP's flat buffer: added into it first
                        # (rank-alike already, so averaging leaves them as they are).
                        add_gradients(held)
                        held = None
                    self.core.reduce_gradients(attempt)
                    if held:
                        add_gradients(held)
                    self.core.optimizer_step(n)
                    done = n
                failure = self.ranks.known_to_all(self.core.failure)
                if failure:
                    self.give_up_on_the_step(failure)
                break
            # Out of the `except` block now, so the exception and its frames are gone and
            # the tensors they pinned (activations, partial gradients) can be freed.
            tried.append(agreed.failed_size)
            self._recover_from_oom(agreed.failed_size, tried, attempt)
            measured = self.measured = True  # the retry is measured, whatever the cadence said
            rebase = False  # the room was measured after the clean-up
        if self.core.skipped:
            self._report_skipped(losses)
        self.last_good_micro = self.knobs.micro_batch_size
        cadence.done(measured, self.demand.finish() if measured else None)
        return BatchOutcome(len(tried), losses if losses is not None else Losses(additive=additive), self.device)

    def _report_skipped(self, losses: Losses | None) -> None:
        """Journal the optimizer steps not taken on non-finite gradients, and tell the user once."""
        for step, why, by in self.core.skipped:
            self.journal.write("nonfinite", self.step_count, self.progress.epoch, at_step=step, error=why,
                               action=f"optimizer step skipped by {by}")
            warn(f"{why} at step {step}: the optimizer step was skipped by {by} (its samples are not counted as "
                 "trained; every one is in the run's journal)", key=f"nonfinite {by} {self.run_dir}")
        self.core.skipped.clear()
        if losses is not None and self.keep_effective_batch:
            losses.parts.clear()  # a skipped batch's loss is not the epoch's

    def _recover_from_oom(self, failed_size: int, tried: list[int], attempt: Attempt) -> None:
        """Free what the failed attempt held, tell the policies, and give up if none helped."""
        self.ranks.reset_after_failure()  # sharded: FSDP2's state as before the attempt
        # Partial gradients of the failed batch must not leak into the retry.
        if self._holding:
            drop_gradients(self.model)  # the held ones are set aside: only the attempt's are on the parameters
        else:
            self.core.zero_grad()
        free_memory(self.device)
        held, gradients, cached = self.demand.take_failure()
        self.last_breakdown = None if attempt.injected else oom_breakdown(
            self.model, self.core.optimizer, self.device, held_at_start=self.demand.held_at_start,
            held_at_failure=held, gradients_at_failure=gradients, cap=self.demand.binding_cap,
            measure=self.demand.measure, allocator_cache=cached,
            outside_torch=self.demand.others_bytes)
        self.last_snapshot = self.history.write(self.run_dir, self.step_count) if self.history is not None else None
        self.demand.measure_room()  # what is in use after the clean-up, against the cap now
        self.cadence.changed()
        self.progress.ooms += 1
        lost = time.perf_counter() - attempt.started  # the failed work and the clean-up: what the OOM cost
        self.journal.write("oom", self.step_count, self.progress.epoch, micro_batch_size=failed_size,
                           device=str(self.device), message=attempt.message, injected=attempt.injected,
                           lost_seconds=round(lost, 4), ooms=self.ooms, breakdown=self.last_breakdown,
                           **({"memory_snapshot": self.last_snapshot} if self.last_snapshot else {}))
        # One line per size that failed (the journal has every OOM): a user sees it was survived.
        warn(f"out of memory at micro-batch {failed_size} on {self.device}; retrying the same batch at a smaller "
             "micro-batch (every OOM is in the run's journal)", key=f"oom {failed_size} {self.run_dir}")
        self.fire(Event.OOM, failed_micro_batch=failed_size, force=True)
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
            # kernels it runs, under memory that is already exhausted: save the progress first
            # (where reliefs are off, carry_out only says so: no checkpoint for nothing).
            if self.reliefs_allowed:
                self.checkpoint("before_relief")
            if self.carry_out(relief):
                return  # the same batch again, with the relief
        memory = describe_memory(self.device)
        if self.last_breakdown is not None:
            memory += f"; at the failure: {describe_breakdown(self.last_breakdown)}"
        self.journal.write("out_of_memory", self.step_count, self.progress.epoch, micro_batch_size=failed_size,
                           device=str(self.device), tried=tried, memory=memory, breakdown=self.last_breakdown)
        self.checkpoint("out_of_memory")  # the progress so far survives the error
        raise OutOfMemory(
            f"out of memory on {self.device} even at micro-batch {failed_size} "
            f"(sizes tried on this batch: {', '.join(map(str, tried))}); no policy could make more room. "
            f"Memory: {memory}. Last error: {attempt.message}")

    def give_up_on_the_step(self, why: str) -> None:
        """The optimizer step ran out of memory (on this rank or another): checkpoint, raise."""
        # A smaller micro-batch cannot help an optimizer state that does not fit. Every rank
        # knows by now (alone at once; under torchrun through an agreement or a gather).
        memory = describe_memory(self.device)
        self.journal.write("out_of_memory", self.step_count, self.progress.epoch, phase="optimizer_step",
                           device=str(self.device), memory=memory, error=why)
        self.checkpoint("out_of_memory", report_failure=False)  # the weights may hold part of the failed step
        raise OutOfMemory(f"out of memory on {self.device} in optimizer.step(): the optimizer state does not fit, "
                          f"whatever the micro-batch. Memory: {memory}. {why}")

    def end_batch(self, timing: StepTiming, n: int, outcome: BatchOutcome) -> None:
        """After a batch: its figures logged, BATCH_END, BATCH_MEASURED (a measured batch: see
        cadence.py), an agreed relief carried out, and what the monitor's samples show
        (MEMORY_HIGH, MEMORY_PRESSURE) sent to the policies."""
        # One memory_stats() call a measured step (CUDA), made when the step's need was measured.
        allocator = self.allocator = self.demand.allocator
        demand = self.demand.last if self.measured else None
        if self.log.step_due():  # most steps of a long run write nothing: their figures are not gathered
            self.log.step(self.step_count, self.progress.epoch, samples=n, samples_seen=self.samples_seen,
                          micro_batch_size=self.knobs.micro_batch_size, step_seconds=timing.step_seconds,
                          data_wait_fraction=timing.data_wait_fraction, demand=demand,
                          allocated_bytes=allocator.allocated_bytes if allocator else None,
                          reserved_bytes=allocator.reserved_bytes if allocator else None,
                          loss=outcome.mean_loss, sample=self.monitor_link.latest,
                          grad_norm=self.core.grad_norm)
        self.fire(Event.BATCH_END, timing=timing)
        if self.measured:
            self.fire(Event.BATCH_MEASURED, timing=timing)
            self.ladder.effect(demand, self.step_count, self.progress.epoch)
        relief = self.ranks.relief_now(self.knobs, self.ladder.take_agreed())
        if relief is not None:
            self.carry_out(relief)
        # The allocator's figures are fresh only on a measured step: the detectors see those.
        for event in self.monitor_link.watch(allocator if self.measured else None, self.step_count,
                                             self.progress.epoch):
            self.fire(event, force=True)

    def carry_out(self, relief: Relief | None) -> bool:
        """Carry out a relief a policy asked for; False if there was none or it failed."""
        if relief is not None and not self.reliefs_allowed:
            self.dispatcher.relief_failed(relief, "reliefs are off here: the model and optimizer are another "
                                                  "trainer's")
            return False
        try:
            applied = self.ladder.apply(relief, self.step_count, self.progress.epoch, self.demand.last,
                                        checkpoint=self.checkpoint)
        except ReliefFailed as exc:
            self.dispatcher.relief_failed(relief, str(exc))  # the policy that asked learns not to ask again
            return False
        if applied:
            # What stays resident changed (pruning shrinks weights and optimizer state): demand
            # is measured from here on against the room there is now.
            self.demand.measure_room()
            self.cadence.changed()
        return applied

    def fire(self, event: Event, failed_micro_batch: int | None = None, timing: StepTiming | None = None,
             force: bool = False) -> None:
        """Tell the policies subscribed to `event`, with a snapshot of the run now."""
        # Building a snapshot reads memory figures; skip it when nobody listens.
        if not force and event not in self.dispatcher.events:
            return
        self.dispatcher.fire(event, Snapshot(
            step=self.step_count, epoch=self.progress.epoch, batch_size=self.knobs.batch_size,
            micro_batch_size=self.knobs.micro_batch_size, device=str(self.device),
            keep_effective_batch=self.keep_effective_batch, failed_micro_batch=failed_micro_batch,
            last_good_micro_batch=self.last_good_micro, step_demand=self.demand.last,
            step_memory=self.demand.last_memory, ooms=self.ooms,
            sample=self.monitor_link.latest(fresh=event is Event.OOM), window=tuple(self.monitor_link.window),
            allocator=self.allocator, timing=timing, input=self.input_state(), reliefs=tuple(self.ladder.applied),
            last_relief_step=self.ladder.last_step, pruned_fraction=self.ladder.pruned_fraction))

    # ------------------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        """What continuing exactly needs, for your own checkpoints: the model's weights, the
        optimizer, scheduler and gradient scaler, the micro-batch, reliefs, policy states,
        counters and random states, as one versioned record (checkpoint_format.py). Load it with
        `load_state_dict` on a Tuner built alike. A sharded (FSDP2) model's weights and optimizer
        state are this rank's shards (DTensors): save them with `torch.distributed.checkpoint`, as
        autotune's own checkpoints do."""
        weights, optimizer = self.ranks.model_state(self.model, self.core.optimizer)
        return checkpoint_format.build(core={**self.core.state_dict(), "model": weights, "optimizer": optimizer},
                                       tuning=self.tuning_state(), progress=self.progress.state_dict(),
                                       rng=rng_state())

    def tuning_state(self) -> dict[str, Any]:
        """Only what the tuner itself decided: micro-batch, reliefs, policy states (an integration's
        checkpoint, beside the weights and optimizer its trainer saves)."""
        return {"micro_batch_size": self.knobs.micro_batch_size, "batch_size": self.knobs.batch_size,
                "reliefs": self.ladder.state_dict(), "policies": self.dispatcher.state_dict(),
                # what the run has done so far, so a resumed integration's report counts all of it
                "counters": {"samples_seen": self.progress.samples_seen, "ooms": self.progress.ooms}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `state_dict` returned, by this autotune or an older one (the reliefs
        first: a pruned model's weights fit only a pruned model)."""
        state = checkpoint_format.migrate(state)
        self.load_tuning_state(state["tuning"])
        core = state["core"]
        self.ranks.load_model_state(self.model, self.core.optimizer, core["model"], core["optimizer"])
        self.core.load_state_dict(core)
        self.progress.load_state_dict(state["progress"])
        set_rng_state(checkpoint_format.rank_rng(state, self.ranks.rank, self.ranks.world))

    def load_tuning_state(self, tuning: dict[str, Any]) -> None:
        """Restore what `tuning_state` returned (an older autotune's too)."""
        tuning = checkpoint_format.migrate_tuning(tuning)
        self.ladder.load_state_dict(tuning["reliefs"])
        self.knobs.micro_batch_size = tuning["micro_batch_size"]
        for name, value in tuning["counters"].items():
            setattr(self.progress, name, value)
        if not self._batch_size_fixed and tuning["batch_size"]:
            self.knobs.batch_size = max(self.knobs.batch_size, tuning["batch_size"])
        self._sized = True
        self.dispatcher.load_state_dict(tuning["policies"])

    def save_checkpoints_with(self, save: Callable[[str, bool], Path | None]) -> None:
        """Let `save(reason, report_failure)` (a bound method, held weakly: no reference cycle)
        write the checkpoints before a relief or an OOM error; AutoTrainer's saves its data position too."""
        self._save = weakref.WeakMethod(save)

    def checkpoint(self, reason: str, report_failure: bool = True) -> Path | None:
        """A checkpoint now (before a relief, before an OOM error): the caller's, or, standalone,
        `state_dict()` in run_dir/checkpoints."""
        save = self._save() if self._save is not None else None
        if save is not None:
            return save(reason, report_failure)
        try:
            return self._checkpointer.save(reason, self.state_dict, self.step_count, self.progress.epoch,
                                           failure=self.core.failure if report_failure else None)
        except RankFailed as exc:  # another rank's optimizer step ran out of memory
            self.give_up_on_the_step(str(exc))
            return None

    # ------------------------------------------------------------------------- the end
    def agree_on_micro_batch(self) -> int:
        """At the end of a run, on every rank: take rank 0's micro-batch (one broadcast under
        torchrun). A policy may have moved this rank's size after the last agreement; a run
        ends, and is checkpointed, at one size everywhere. Returns it."""
        self.knobs.follow(self.ranks.follow_rank0(self.knobs.micro_batch_size, None, self.device)[0])
        return self.knobs.micro_batch_size

    def end(self) -> None:
        """The end of a run of steps (journaled as `fit_end`; the monitor stops). A later step
        starts a new run in the same journal."""
        if not self._started:
            return
        self._started = False
        self.journal.write("fit_end", self.step_count, self.progress.epoch, samples_seen=self.samples_seen,
                           ooms=self.ooms, micro_batch_size=self.knobs.micro_batch_size, tuner=True)
        self.fire(Event.FIT_END)
        self.monitor_link.stop(wait=False)
        self.log.flush()

    def close(self) -> None:
        """End the run, take the tuner's hook off the model, give back the CUDA memory fraction,
        and close the journal and logs. Idempotent."""
        if self._closed:
            return
        self.end()
        self._closed = True
        self.ladder.close()
        self.monitor_link.stop()
        if self.history is not None:
            self.history.stop()
        if self._memory_fraction_set:
            torch.cuda.set_per_process_memory_fraction(1.0, self.device)
        self.log.close()

    def __enter__(self) -> "Tuner":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def set_aside_gradients(model: nn.Module) -> list[tuple[nn.Parameter, torch.Tensor]]:
    """Take the gradients the model's parameters hold (their `.grad` is None after), to add back later."""
    held = [(p, p.grad) for p in model.parameters() if p.grad is not None]
    for p, _ in held:
        p.grad = None
    return held


def drop_gradients(model: nn.Module) -> None:
    """Every parameter's gradient gone (`.grad = None`), whatever the optimizer's zero_grad would do."""
    for p in model.parameters():
        p.grad = None


def add_gradients(held: list[tuple[nn.Parameter, torch.Tensor]]) -> None:
    """Add gradients `set_aside_gradients` took onto what the parameters hold now (or put them back)."""
    for p, grad in held:
        if p.grad is not None:
            grad.add_(p.grad)  # into the held tensor: views of it elsewhere (a bucket) stay bound
        p.grad = grad


def _no_input() -> None:
    return None


def _read_at_failure(demand: StepDemand, history: AllocationHistory | None, model: nn.Module,
                     device: torch.device) -> None:
    # In the failed step's except block, while its tensors are alive (StepCore.on_failure).
    demand.note_failure(gradient_bytes(model, device))
    if history is not None:
        history.take_at_failure()
