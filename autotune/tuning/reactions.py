"""What follows a batch, and the policies' side of a run: the batch's figures to the run log, what
the policies are told (an event, with a snapshot of the run), what they ask for that changes the
model (a relief, carried out at a safe point), and what the monitor's samples add after each
batch (MEMORY_HIGH, MEMORY_PRESSURE).

Owns: the last step's allocator figures the snapshots and the log carry. Touches: the run log
(a step's line when due), the dispatcher (it asks the policies), the relief ladder (it changes
the model), the monitor link (its samples), the demand's room and the cadence after a relief.
A checkpoint before a relief that prunes is the Tuner's, lent through `run.lent` (run.py).
"""

from __future__ import annotations

import weakref

from autotune.common.actions import Relief
from autotune.common.events import Event
from autotune.common.snapshot import Snapshot, StepTiming
from autotune.decisions.dispatch import Dispatcher
from autotune.memory.cadence import MeasureCadence
from autotune.memory.demand import StepDemand
from autotune.observe.journal import RunLog
from autotune.step.optimizer_step import OptimizerStep
from autotune.tuning.batch import BatchOutcome, BatchRunner
from autotune.tuning.monitor_link import MonitorLink
from autotune.tuning.relief_ladder import ReliefFailed, ReliefLadder
from autotune.tuning.run import Run


class Reactions:
    """Events to the policies, reliefs to the model, for one Tuner (see the module docstring)."""

    def __init__(self, run: Run, dispatcher: Dispatcher, ladder: ReliefLadder, monitor_link: MonitorLink,
                 demand: StepDemand, cadence: MeasureCadence, batches: BatchRunner, *, log: RunLog,
                 stepper: OptimizerStep, host: weakref.ref | None, reliefs_allowed: bool):
        self.knobs, self.counters, self.ranks, self.device = run.knobs, run.counters, run.ranks, run.device
        self.keep_effective_batch, self.lent = run.keep_effective_batch, run.lent
        self.dispatcher, self.ladder, self.monitor_link = dispatcher, ladder, monitor_link
        self.demand, self.cadence, self.batches, self.log, self.stepper = demand, cadence, batches, log, stepper
        self.host, self.reliefs_allowed = host, reliefs_allowed
        self.allocator = None  # the last measured step's allocator figures (CUDA)
        self.hears_every_batch = Event.BATCH_END in dispatcher.events  # a policy listens to BATCH_END

    def quiet(self) -> bool:
        """Whether `after_batch` has nothing to do after this batch: it was not measured, nobody
        listens to BATCH_END, no relief waits, the monitor has no news. Most batches of a steady
        run: their figures are not gathered, no snapshot is built."""
        knobs = self.knobs
        return (not self.batches.measured and not self.hears_every_batch and knobs.relief is None
                and knobs.relief_agreed is None and not self.monitor_link.news())

    def after_batch(self, timing: StepTiming, n: int, outcome: BatchOutcome) -> None:
        """After a batch of `n` samples: its figures logged (a line when due; the bar), then, unless
        `quiet`, BATCH_END, BATCH_MEASURED (a measured batch: cadence.py), an agreed relief
        carried out, and what the monitor's samples show sent to the policies."""
        log, counters, measured = self.log, self.counters, self.batches.measured
        if log.moves_bar:
            log.advance()
        if measured:  # one memory_stats() call a measured step (CUDA), made when its need was
            self.allocator = self.demand.allocator
        if log.step_due():  # most steps of a long run write nothing: their figures are not gathered
            allocator = self.allocator
            log.step(counters.step, counters.epoch, samples=n, samples_seen=counters.samples_seen,
                     micro_batch_size=self.knobs.micro_batch_size, step_seconds=timing.step_seconds,
                     data_wait_fraction=timing.data_wait_fraction, demand=self.demand.last if measured else None,
                     allocated_bytes=allocator.allocated_bytes if allocator else None,
                     reserved_bytes=allocator.reserved_bytes if allocator else None,
                     loss=outcome.mean_loss, sample=self.monitor_link.latest, grad_norm=self.stepper.grad_norm)
        if self.quiet():
            return
        self.fire(Event.BATCH_END, timing=timing)
        if measured:
            self.fire(Event.BATCH_MEASURED, timing=timing)
            self.ladder.effect(self.demand.last, counters.step, counters.epoch)
        relief = self.ranks.relief_now(self.knobs)
        if relief is not None:
            self.carry_out(relief)
        # The allocator's figures are fresh only on a measured step: the detectors see those.
        for event in self.monitor_link.watch(self.allocator if measured else None, counters.step, counters.epoch):
            self.fire(event, force=True)

    def carry_out(self, relief: Relief | None) -> bool:
        """Carry out a relief a policy asked for; False if there was none or it failed."""
        if relief is not None and not self.reliefs_allowed:
            self.dispatcher.relief_failed(relief, "reliefs are off here: the model and optimizer are another "
                                                  "trainer's")
            return False
        try:
            applied = self.ladder.apply(relief, self.counters.step, self.counters.epoch, self.demand.last,
                                        save_checkpoint=self.lent.checkpoint)
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
        host = self.host() if self.host is not None else None
        counters, knobs, ladder = self.counters, self.knobs, self.ladder
        self.dispatcher.fire(event, Snapshot(
            step=counters.step, epoch=counters.epoch, batch_size=knobs.batch_size,
            micro_batch_size=knobs.micro_batch_size, device=str(self.device),
            keep_effective_batch=self.keep_effective_batch, failed_micro_batch=failed_micro_batch,
            last_good_micro_batch=self.batches.last_good_micro, step_demand=self.demand.last,
            step_memory=self.demand.last_memory, ooms=counters.ooms,
            sample=self.monitor_link.latest(fresh=event is Event.OOM), window=tuple(self.monitor_link.window),
            allocator=self.allocator, timing=timing, input=host.input_state() if host is not None else None,
            reliefs=tuple(ladder.applied), last_relief_step=ladder.last_step, pruned_fraction=ladder.pruned_fraction))
