"""After an out-of-memory attempt: clean up, record, decide; the error when nothing is left to try.

`recover` is what the Tuner calls once every rank agreed that an attempt failed:

    clean up: the partial gradients dropped, the memory freed (outside the `except` block)
    record:   where the memory went (breakdown.py), the allocator's history (memory/history.py),
              the `oom` record and the one line a user sees
    CUDA, the batch's first OOM at a size the last batch completed at: the same size once more
              (`oom_retry`), the cache emptied after a synchronize: a block that would fit may still
              wait on another stream (pytorch #189504), and halving on that throws half the throughput
              away. A size that never completed a batch (the start, a probe upward) is not retried:
              it is too large, and a retry would only be one more OOM
    decide:   OOM -> the policies; every rank takes rank 0's size and relief; a smaller size first
              (a pending relief is dropped, and said so); at the smallest, the relief (checkpoint
              first); else the `out_of_memory` record, a checkpoint of the progress, OutOfMemory

The other end of a batch that trains nothing: the steps skipped on NaN or inf gradients journaled
and counted (`report_skipped`), and where `max_nonfinite_steps` came in a row, a checkpoint of
the last finite step and TooManyNonFiniteSteps (`give_up_on_nonfinite`).

Owns: the last failure's breakdown and snapshot. Touches: the model's gradients (dropped), the
allocator (freed), the demand's room (measured again), the cadence, the knobs (rank 0's size, the
pending relief), the counters' `ooms` and `nonfinite_steps`, the journal. What needs the whole run (the policies told,
a relief carried out, a checkpoint) is the Tuner's, lent through `run.lent` (run.py).
"""

from __future__ import annotations

import time
from typing import Any, NoReturn

import torch
from torch import nn

from autotune.common.actions import Relief
from autotune.common.events import Event
from autotune.common.notices import warn
from autotune.common.oom import OutOfMemory, TooManyNonFiniteSteps
from autotune.common.units import describe_breakdown
from autotune.decisions.dispatch import Dispatcher
from autotune.memory.breakdown import gradient_bytes, oom_breakdown
from autotune.memory.cadence import MeasureCadence
from autotune.memory.demand import StepDemand
from autotune.memory.figures import describe_memory, free_memory
from autotune.memory.history import AllocationHistory
from autotune.observe.records import Kind
from autotune.step.core import Attempt
from autotune.step.losses import Losses
from autotune.step.optimizer_step import OptimizerStep
from autotune.tuning.run import Run


class OOMRecovery:
    """What a failed attempt leaves to clean up and to record, for one Tuner's model."""

    def __init__(self, run: Run, stepper: OptimizerStep, demand: StepDemand, history: AllocationHistory | None, *,
                 dispatcher: Dispatcher, cadence: MeasureCadence, reliefs_allowed: bool):
        self.model, self.device, self.ranks, self.knobs = run.model, run.device, run.ranks, run.knobs
        self.journal, self.counters, self.run_dir, self.lent = run.journal, run.counters, run.run_dir, run.lent
        self.stepper, self.demand, self.history = stepper, demand, history
        self.dispatcher, self.cadence, self.reliefs_allowed = dispatcher, cadence, reliefs_allowed
        # The batch's first OOM retried once at the same size (CUDA; the module docstring says why).
        # The ranks agree on it without a collective: every rank has the same agreed failures.
        self.retries_same_size = self.device.type == "cuda"
        self.same_size_retries = 0  # how many were retried so, this run
        self.last_snapshot: dict[str, Any] | None = None  # the allocator's state at the last OOM: path, sites
        self.last_breakdown: dict[str, Any] | None = None  # where the memory went at the last OOM

    def recover(self, failed_micro_batch: int, tried: list[int], attempt: Attempt, *, holding: bool,
                last_good_micro_batch: int | None = None) -> None:
        """Clean up and record the failed attempt, ask the policies (OOM), and go on with what
        rank 0 decided: a smaller micro-batch, or at the smallest a relief; else give up.
        `last_good_micro_batch`: the size the last batch completed at (every rank's alike)."""
        same_size = (self.retries_same_size and len(tried) == 1 and not attempt.injected
                     and last_good_micro_batch == failed_micro_batch)
        self.clean_up(failed_micro_batch, attempt, holding)
        self.cadence.changed()
        if same_size:
            self.same_size_retries += 1
            self.journal.write(Kind.OOM_RETRY, self.counters.step, self.counters.epoch,
                               micro_batch_size=failed_micro_batch, retries=self.same_size_retries)
            self._say_oom(failed_micro_batch, "the same micro-batch once, the cache emptied")
            return
        self.lent.fire(Event.OOM, failed_micro_batch=failed_micro_batch, force=True)
        # Every rank's next move is rank 0's: the size to retry at, and any relief first.
        micro, relief = self.ranks.follow_rank0(self.knobs.micro_batch_size, self.ranks.offer_relief(self.knobs),
                                                self.device)
        self.knobs.follow(micro)
        self.settle_relief(relief)
        if self.knobs.micro_batch_size < failed_micro_batch:
            self._say_oom(failed_micro_batch, f"micro-batch {self.knobs.micro_batch_size}")
            dropped = self.knobs.drop_relief()  # a smaller micro-batch first: reliefs are the last resort
            if dropped is not None:
                self.dispatcher.relief_dropped(dropped, f"a smaller micro-batch ({self.knobs.micro_batch_size}) is "
                                               "tried first", self.counters.step, self.counters.epoch)
            return
        if attempt.not_supported is not None:
            raise attempt.not_supported  # cuDNN's NOT_SUPPORTED at the floor may not be memory: no reliefs
        relief = self.ranks.relief_now(self.knobs)
        if relief is not None:
            # Without the relief the run would stop here; a relief changes the model or the
            # kernels it runs, under memory that is already exhausted: save the progress first
            # (where reliefs are off, carry_out only says so: no checkpoint for nothing).
            if self.reliefs_allowed:
                self.lent.checkpoint("before_relief")
            if self.lent.carry_out(relief):
                return  # the same batch again, with the relief
        self.give_up(failed_micro_batch, tried, attempt)

    def settle_relief(self, agreed: Relief | None) -> None:
        """After an agreement: rank 0's relief is every rank's; one asked on another rank goes no further."""
        mine = self.knobs.settle_relief(agreed, self.ranks.is_main)
        if mine is not None:
            self.dispatcher.relief_dropped(mine, "rank 0's policies decide the reliefs", self.counters.step,
                                           self.counters.epoch)

    def clean_up(self, failed_micro_batch: int, attempt: Attempt, holding: bool) -> None:
        """Free what the failed attempt held and record it (`oom`). `holding`: gradients of
        earlier batches are set aside, so only the attempt's are on the parameters."""
        self.ranks.job.reset_after_failure()  # sharded: FSDP2's state as before the attempt
        # Partial gradients of the failed batch must not leak into the retry.
        if holding:
            self.stepper.drop_gradients()
        else:
            self.stepper.zero_grad()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # what other streams still use is freed before the cache empties
        free_memory(self.device)
        held, gradients, cached = self.demand.take_failure()
        self.last_breakdown = None if attempt.injected else oom_breakdown(
            self.model, self.stepper.optimizer, self.device, held_at_start=self.demand.held_at_start,
            held_at_failure=held, gradients_at_failure=gradients, cap=self.demand.binding_cap,
            measure=self.demand.measure, allocator_cache=cached, outside_torch=self.demand.others_bytes)
        self.last_snapshot = self.history.write(self.run_dir, self.counters.step) if self.history is not None else None
        self.demand.measure_room()  # what is in use after the clean-up, against the cap now
        self.counters.survived_oom()
        lost = time.perf_counter() - attempt.started  # the failed work and the clean-up: what the OOM cost
        self.journal.write(Kind.OOM, self.counters.step, self.counters.epoch, micro_batch_size=failed_micro_batch,
                           device=str(self.device), message=attempt.message, injected=attempt.injected,
                           lost_seconds=round(lost, 4), ooms=self.counters.ooms, breakdown=self.last_breakdown,
                           **({"memory_snapshot": self.last_snapshot} if self.last_snapshot else {}))

    def _say_oom(self, failed_micro_batch: int, retry_at: str) -> None:
        # One line per size that failed and size retried at (the journal has every OOM): a user sees
        # it was survived and what the run goes on with.
        warn(f"out of memory at micro-batch {failed_micro_batch} on {self.device}; retrying the same batch at "
             f"{retry_at} (every OOM is in the run's journal)", key=f"oom {failed_micro_batch} {retry_at} {self.run_dir}")

    def give_up(self, failed_micro_batch: int, tried: list[int], attempt: Attempt) -> NoReturn:
        """Nothing is left to try at the smallest size: record it, checkpoint the progress so far, raise."""
        memory = describe_memory(self.device)
        if self.last_breakdown is not None:
            memory += f"; at the failure: {describe_breakdown(self.last_breakdown)}"
        self.journal.write(Kind.OUT_OF_MEMORY, self.counters.step, self.counters.epoch,
                           micro_batch_size=failed_micro_batch, device=str(self.device), tried=tried, memory=memory,
                           breakdown=self.last_breakdown)
        self.lent.checkpoint("out_of_memory")  # the progress so far survives the error
        raise OutOfMemory(
            f"out of memory on {self.device} even at micro-batch {failed_micro_batch} "
            f"(sizes tried on this batch: {', '.join(map(str, tried))}); no policy could make more room. "
            f"Memory: {memory}. Last error: {attempt.message}")

    def give_up_on_the_step(self, why: str) -> NoReturn:
        """The optimizer step ran out of memory (on this rank or another): record, checkpoint, raise."""
        # A smaller micro-batch cannot help an optimizer state that does not fit. Every rank
        # knows by now (alone at once; under torchrun through an agreement or a gather).
        memory = describe_memory(self.device)
        self.journal.write(Kind.OUT_OF_MEMORY, self.counters.step, self.counters.epoch, phase="optimizer_step",
                           device=str(self.device), memory=memory, error=why)
        self.lent.checkpoint("out_of_memory", report_failure=False)  # the weights may hold part of the failed step
        raise OutOfMemory(f"out of memory on {self.device} in optimizer.step(): the optimizer state does not fit, "
                          f"whatever the micro-batch. Memory: {memory}. {why}")

    def report_skipped(self, losses: Losses | None, keep_effective_batch: bool) -> None:
        """Journal the optimizer steps not taken on non-finite gradients, and tell the user once."""
        for step, why, by, buffers in self.stepper.skipped:
            self.counters.skipped_nonfinite()
            self.journal.write(Kind.NONFINITE, self.counters.step, self.counters.epoch, at_step=step, error=why,
                               action=f"optimizer step skipped by {by}{buffers}")
            warn(f"{why} at step {step}: the optimizer step was skipped by {by} (its samples are not counted as "
                 f"trained; every one is in the run's journal){buffers}", key=f"nonfinite {by} {self.run_dir}")
        self.stepper.skipped.clear()
        if losses is not None and keep_effective_batch:
            losses.parts.clear()  # a skipped batch's loss is not the epoch's

    def give_up_on_nonfinite(self, losses: Losses | None, keep_effective_batch: bool) -> NoReturn:
        """`max_nonfinite_steps` steps in a row skipped (`OptimizerStep.streak_reached`, every rank
        alike: the ranks agree on each check): the weights are the last finite step's, so they are
        checkpointed, and the run stops. A skip read just now (a fused optimizer's) is journaled first."""
        self.report_skipped(losses, keep_effective_batch)
        in_a_row, limit = self.stepper.nonfinite_in_a_row, self.stepper.max_nonfinite_steps
        path = self.lent.checkpoint("nonfinite")
        saved = (f"The weights of the last finite step (step {self.counters.step}) are in the checkpoint {path}"
                 if path is not None else f"No checkpoint was written now (said above); the newest in "
                 f"{self.run_dir / 'checkpoints'}, if any, is the one to resume from")
        raise TooManyNonFiniteSteps(
            f"{in_a_row} optimizer steps in a row were skipped on non-finite gradients (NaN or inf), "
            f"max_nonfinite_steps={limit}: the run trains nothing, so it stopped ({self.counters.nonfinite_steps} "
            f"skipped in all, every one in the run's journal). {saved}; fix the cause (the loss, the data, the "
            "learning rate) and continue with fit(..., resume=True), or raise max_nonfinite_steps")


def read_at_failure(demand: StepDemand, history: AllocationHistory | None, model: nn.Module,
                    device: torch.device) -> None:
    """In the failed step's except block, while its tensors are alive (StepCore.on_failure)."""
    demand.note_failure(gradient_bytes(model, device))
    if history is not None:
        history.take_at_failure()
