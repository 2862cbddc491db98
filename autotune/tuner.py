"""Tuner: OOM-resilient training steps for a loop you keep, and the core `AutoTrainer` is built on.

    from autotune import Tuner
    with Tuner(model, optimizer, run_dir="runs/x") as tuner:    # monitor, journal, policies
        for batch in loader:
            loss = tuner.step(batch, step_fn)   # split, retry the same batch on OOM, accumulate, step

Where each `Event` fires in one batch, and around it in AutoTrainer's loop: the one picture, in
events.py.

`accumulate(batch, step_fn)` is the same attempt without the optimizer step, for a trainer
that steps its own optimizer (the Hugging Face and Lightning integrations): gradients already
accumulated from earlier batches are set aside during the attempt and added back after it, so
a retry never loses or doubles them.

Two faces. Yours (a custom loop): `step`, `accumulate`, `step_scheduler`, `state_dict` /
`load_state_dict`, `close`, and the read-only figures (`step_count`, `micro_batch_size`, ...).
A host's (AutoTrainer, the HF and Lightning integrations): one run lifecycle, `begin`,
`train_batch`, `after_batch`, `end`, with `fire`, `listens`, `carry_out`, `checkpoint`,
`give_up_on_the_step`, `average_gradients`, `agree_on_micro_batch`, `tuning_state` /
`load_tuning_state`, and the parts a host reads: host_face.py's `HostFace`, which
tests/test_faces.py holds the hosts (and the Tuner) to. What a host lends the Tuner is a `Host`
(host_face.py too), passed at construction.

Owns: the step core, the knobs and the policies' dispatcher, the run log, the monitor link, the
relief ladder, and the rooms a batch goes through: batch.py (attempts and the agreement),
recovery.py (after an OOM), reactions.py (the policies' side). The data, epochs, evaluation and scheduled checkpoints
are the host's (AutoTrainer's, or your loop's); `state_dict()` is what your checkpoints keep.
Touches: the model (moved to the device; wrapped in DDP, or sharded, under torchrun), the CUDA
memory fraction (given back at close).
"""

from __future__ import annotations

import datetime
import functools
import os
import shutil
import time
import weakref
from pathlib import Path
from typing import Any, Callable, NoReturn, Sequence

import torch
from torch import nn

from autotune.common.actions import Relief
from autotune.common.batching import SplitFn, batch_len
from autotune.common.events import Event
from autotune.common.notices import warn
from autotune.common.progress import Progress
from autotune.common.snapshot import StepTiming
from autotune.decisions.dispatch import Dispatcher
from autotune.decisions.knobs import Knobs
from autotune.decisions.policy import Policy
from autotune.memory.cadence import MeasureCadence
from autotune.memory.demand import StepDemand
from autotune.memory.figures import one_arena_under_an_address_space_cap, warm_up_oom_path
from autotune.memory.history import AllocationHistory
from autotune.observe.journal import JOURNAL_NAME, STEPS_NAME, TENSORBOARD_NAME, RunLog
from autotune.observe.records import Kind
from autotune.ranks.distributed import from_environment
from autotune.ranks.process import Process
from autotune.run_folder import checkpoint_format
from autotune.run_folder.checkpoint import Checkpointer, RankFailed
from autotune.run_folder.rng import rng_state, set_rng_state
from autotune.run_folder.run_lock import LOCK_NAME, hold_run_dir
from autotune.run_folder.same_run import FRESH_TUNER, new_run_id, reliefs_checked
from autotune.step.core import LossFn, StepCore, StepFn
from autotune.step.optimizer_step import OptimizerStep
from autotune.training.evaluation import Evaluator
from autotune.tuning.arguments import TUNER, with_arguments
from autotune.tuning.batch import BatchOutcome, BatchRunner, add_gradients, set_aside_gradients
from autotune.tuning.config import (
    OptimizerFactory,
    check_what_is_trained,
    make_optimizer,
    make_scheduler,
    resolve_device,
    resolve_memory_cap,
    tuner_options,
)
from autotune.tuning.host_face import Wiring
from autotune.tuning.monitor_link import MonitorLink
from autotune.tuning.presets import resolve_policies
from autotune.tuning.reactions import Reactions
from autotune.tuning.recovery import OOMRecovery, read_at_failure
from autotune.tuning.relief_ladder import ReliefLadder
from autotune.tuning.run import Lent, Run


# What a Tuner's construction makes in its run folder: the lock and the run log's files.
MADE = (LOCK_NAME, JOURNAL_NAME, STEPS_NAME, TENSORBOARD_NAME)


def _entries(run_dir: Path) -> tuple[frozenset[str], int] | None:
    """The names in `run_dir`, and the size of its journal (None: there is no such folder)."""
    try:
        names = frozenset(os.listdir(run_dir))
    except (FileNotFoundError, NotADirectoryError):
        return None
    return names, _size(run_dir / JOURNAL_NAME)


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


def _leave_as_found(run_dir: Path, found: tuple[frozenset[str], int] | None) -> None:
    """Where this Tuner journaled nothing (its constructor failed, or it was closed before a run began):
    what it made in `run_dir` (`MADE`, absent from `found`, what the folder held before; None: no folder)
    removed, and the folder too where it made it and nothing else is in it. Anything else stays."""
    before, journal_size = found or (frozenset(), 0)
    if not run_dir.is_dir() or _size(run_dir / JOURNAL_NAME) != journal_size:
        return  # a run's record: kept, with the lock file that goes with it
    for name in MADE:
        path = run_dir / name
        if name in before or path.is_symlink() or not path.exists():
            continue
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink()
    if found is None and not os.listdir(run_dir):
        run_dir.rmdir()


def default_run_dir(ranks: Process) -> Path:
    """`runs/<timestamp>`, rank 0's on every rank."""
    return Path(ranks.broadcast_object(str(Path("runs") / datetime.datetime.now().strftime("%Y%m%d-%H%M%S-%f"))))


@with_arguments(TUNER)
class Tuner:
    """OOM-resilient steps on your model and optimizer, in your own loop. Its arguments are
    documented in tuning/arguments.py (`TUNER`), then its options in their record (tuning/options.py),
    appended here."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer | OptimizerFactory | None = None, *,
                 loss_fn: LossFn | None = None, step_fn: StepFn | None = None, scheduler: Any = None,
                 micro_batch_size: int | None = None, batch_size: int | None = None,
                 max_micro_batch_size: int | None = None, keep_effective_batch: bool = True,
                 device: str | torch.device | None = None,
                 policies: str | Path | Sequence[Policy] | None = "default", memory_cap: float | int | str | None = None,
                 precision: str = "fp32", clip_grad_norm: float | None = None, clip_grad_value: float | None = None,
                 scheduler_interval: str = "step", split_fn: SplitFn | None = None, run_dir: str | Path | None = None,
                 monitor: bool = True, monitor_interval: float = 0.5, tensorboard: bool | str | Path = False,
                 inject_oom: float | None = None, seed: int = 0, compile: bool | dict[str, Any] = False,
                 reliefs: bool = True, progress: bool = False, memory_snapshot: bool | int = False,
                 shard: bool = False, on_nonfinite: str = "skip", max_nonfinite_steps: int | None = 50,
                 _wiring: Wiring = Wiring()):
        check_what_is_trained(model=model, loss_fn=loss_fn, step_fn=step_fn)
        # The keywords but what is trained, as one record (config.py: checked; tuning/options.py: the fields).
        self.options = options = tuner_options(locals())
        one_arena_under_an_address_space_cap()  # before any thread of ours allocates
        host, ranks, counters, owns_optimizer = _wiring.host, _wiring.ranks, _wiring.counters, _wiring.owns_optimizer
        keep_effective_batch = options.step.keep_effective_batch
        self.ranks = ranks if ranks is not None else from_environment()
        self.device = resolve_device(self.ranks.device_for(options.device, keep_effective_batch))
        if ranks is None:  # ranks given: the host joined the job
            self.ranks.join(self.device)
        self.model = model.to(self.device)
        if owns_optimizer:
            self.ranks.wrap(self.model, self.device, shard=options.shard)
        # Before any file is written, so that an error leaves nothing behind: a bad optimizer (and the first
        # optimizer of a process imports torch._dynamo: seconds), memory_snapshot where the allocator keeps no history.
        optimizer = make_optimizer(optimizer, self.model) if owns_optimizer else None
        self.history = AllocationHistory.asked(options.memory_snapshot, self.device)
        self.keep_effective_batch, self.is_main = keep_effective_batch, self.ranks.is_main
        self.run_dir = Path(options.run_dir) if options.run_dir is not None else default_run_dir(self.ranks)
        policies = resolve_policies(options.policies)  # a preset read and checked before the folder is taken
        self._started = self._closed = False  # started: between begin() and end() (fit_start ... fit_end)
        cap_bytes = resolve_memory_cap(options.memory_cap, self.device)  # sets CUDA's fraction: given back at close
        self._memory_fraction_set = options.memory_cap is not None and self.device.type == "cuda"
        # What the folder held before: a failed construction, or a Tuner closed before it journaled anything,
        # removes what it made there and nothing else (`_leave_as_found`).
        self._found = _entries(self.run_dir) if self.is_main else None
        try:
            self._lock = hold_run_dir(self.run_dir, self.ranks)  # one writer: another process's run here is refused
            self.run_id = self.ranks.broadcast_object(new_run_id())  # rank 0's; a resume takes the checkpoint's
            self.log = RunLog(self.run_dir, writes=self.is_main, tensorboard=options.tensorboard, progress=options.progress)
            self.journal = self.log.journal  # rank 0 writes
            self.counters = counters if counters is not None else Progress()
            self.counters.on_ranks(self.ranks.world, epoch_too=True)
            self.stepper = OptimizerStep(self.model, optimizer, make_scheduler(scheduler, optimizer) if optimizer else None,
                                         device=self.device, ranks=self.ranks, counters=self.counters, options=options.step)
            self.core = StepCore(self.model, self.stepper, loss_fn=loss_fn, step_fn=step_fn, device=self.device,
                                 ranks=self.ranks, options=options.step, backward_fn=_wiring.backward_fn)
            # Sizes are known once batches are: the first one sets them unless given here.
            self.knobs = Knobs.given(options.batch_size, options.micro_batch_size, self.device, cap_bytes,
                                     ceiling=options.max_micro_batch_size)
            run = Run(self.model, self.device, self.ranks, self.knobs, self.counters, self.journal, self.run_dir,
                      keep_effective_batch, Lent(self))  # what the rooms below share
            self.dispatcher = Dispatcher(policies, self.knobs, self.journal)
            self.ladder = ReliefLadder(run, self.core, self.stepper)
            self.monitor_link = MonitorLink(self.run_dir, self.device, enabled=options.monitor and self.is_main,
                                            interval=options.monitor_interval, cap_bytes=self.knobs.memory_cap_bytes,
                                            journal=self.journal)
            self.demand = StepDemand(self.device, self.knobs.memory_cap_bytes)
            self.cadence = MeasureCadence()
            self.recovery = OOMRecovery(run, self.stepper, self.demand, self.history, dispatcher=self.dispatcher,
                                        cadence=self.cadence, reliefs_allowed=options.reliefs)
            self.batches = BatchRunner(run, self.core, self.stepper, self.cadence, self.demand, self.recovery)
            self.evaluator = Evaluator(self.core, batch_size=None, collate_fn=None, metrics=None, journal=self.journal)
            self._host = weakref.ref(host) if host is not None else None
            self.reactions = Reactions(run, self.dispatcher, self.ladder, self.monitor_link, self.demand, self.cadence,
                                       self.batches, log=self.log, stepper=self.stepper, host=self._host,
                                       reliefs_allowed=options.reliefs)
            # A host writes its own checkpoints; alone, the Tuner writes state_dict() into run_dir/checkpoints.
            self._checkpointer = None if host is not None else Checkpointer(
                self.run_dir / "checkpoints", keep=3, every=None, interval=None, ranks=self.ranks, journal=self.journal)
            # The demand's and the history's, not ours: no reference cycle
            self.core.on_failure = functools.partial(read_at_failure, self.demand, self.history, self.model, self.device)
            self._loaded = False  # a state loaded (load_state_dict): not a fresh run
            self._last_step_end: float | None = None  # a step's end: the next one's time runs from it
        except BaseException:
            self._give_back()  # the folder let go of, as found: this process or another may take it at once
            raise

    step_count = property(lambda self: self.counters.step, doc="optimizer steps taken")
    ooms = property(lambda self: self.counters.ooms, doc="out-of-memory errors survived")
    samples_seen = property(lambda self: self.counters.samples_seen, doc="samples in completed optimizer steps")
    micro_batch_size = property(lambda self: self.knobs.micro_batch_size, doc="samples per forward/backward now")
    optimizer = property(lambda self: self.stepper.optimizer, doc="the optimizer (yours: pruning remaps it in place)")
    scheduler = property(lambda self: self.stepper.scheduler, doc="the LR scheduler, or None")
    reliefs = property(lambda self: self.ladder.applied, doc="memory reliefs applied, in order")
    monitor_process = property(lambda self: self.monitor_link.process, doc="the monitor process, while one runs")
    outputs = property(lambda self: self.batches.last and self.batches.last.outputs,
                       doc="the last batch's outputs your step function handed back (`StepResult`), in sample order")

    # ------------------------------------------------------------------------- your loop
    def step(self, batch: Any, step_fn: StepFn | None = None, *, loss_fn: LossFn | None = None) -> torch.Tensor:
        """Train on `batch` until every sample of it is in a completed optimizer step: split into
        micro-batches, retried smaller on OOM, accumulated, one optimizer step. Returns the batch's mean
        loss, 0-d (`.item()` waits for the device). `step_fn`/`loss_fn` default to the constructor's."""
        core = self.core
        core.use(step_fn, loss_fn)
        n = self._begin_batch(batch)
        # What the loop accumulated before (Accelerate's accumulate() holds gradients back over
        # batches) is kept out of the attempts and added back before the step: a failed attempt's
        # gradients are dropped here, never by an optimizer wrapper's zero_grad (Accelerate's
        # skips it between sync steps). Under DDP, gradients untouched since the last step are none.
        held = (set_aside_gradients(core.parameters())
                if self.keep_effective_batch and not self.ranks.job.gradients_untouched() else None)
        outcome = self.train_batch(batch, n, held=held)
        self._after_own_batch(n, outcome)
        return outcome.mean_loss()

    def accumulate(self, batch: Any, step_fn: StepFn, *, n: int | None = None) -> BatchOutcome:
        """Forward and backward over `batch` in micro-batches with OOM retries, and no optimizer step (a trainer
        that steps its own): `step_fn(model, micro)` returns a loss already scaled so that the micro-batches'
        losses add up to the batch's (the caller knows its normalisation); gradients add onto those held."""
        self.core.use(step_fn, None)
        n = self._begin_batch(batch, n)
        held = set_aside_gradients(self.core.parameters())  # a retry drops the failed attempt's gradients, never these
        outcome = self.train_batch(batch, n, optimizer_step=False, held=held)
        add_gradients(held)
        self.counters.accumulated(n * self.ranks.world)
        self._after_own_batch(n, outcome)
        return outcome

    def _after_own_batch(self, n: int, outcome: BatchOutcome) -> None:
        # Without a loader of our own, a step's time runs from the last one's end (data wait unknown: 0).
        now = time.perf_counter()
        step_seconds, self._last_step_end, log = now - self._last_step_end, now, self.log
        if log.moves_bar or log.step_due() or not self.reactions.quiet():  # else nothing reads the timing
            self.after_batch(StepTiming(step_seconds=step_seconds, retries=outcome.retries), n, outcome)

    def evaluate(self, batch: Any, eval_fn: Callable[[nn.Module, Any], Any]) -> Any:
        """`eval_fn(model, micro_batch)` over `batch` in eval mode under `torch.no_grad()`, with a micro-batch of
        its own (an OOM halves it and runs the same samples again; the training one never moves). Returns the
        results in sample order (numbers, 0-d tensors: mean over samples; tensors: joined; tuples, dicts: by leaf)."""
        return self.evaluator.step(batch, eval_fn, self.step_count, self.counters.epoch)

    def step_scheduler(self, metric: float | None = None) -> None:
        """Step the scheduler yourself (scheduler_interval="epoch"; a ReduceLROnPlateau's metric)."""
        self.stepper.step_scheduler(metric)

    def _begin_batch(self, batch: Any, n: int | None = None) -> int:
        n = batch_len(batch) if n is None else n
        if self._started and self.knobs.sized and n <= self.knobs.batch_size:  # most batches: nothing to set up
            return n
        if self._closed:
            raise RuntimeError("this Tuner was closed: build a new one to train again")
        self.knobs.size_for(n)
        if not self._started:  # your loop's run starts at its first batch; the gradients it holds are its own
            self.begin(keep_gradients=True, batch_size=self.knobs.batch_size, tuner=True)
        return n

    # ------------------------------------------------------------------------- a host's run
    def begin(self, *, keep_gradients: bool = False, **fit_start: Any) -> None:
        """Before a run's first batch: the OOM path warmed up, stale gradients dropped (unless `keep_gradients`),
        `fit_start` journaled (with the host's fields), the monitor started, FIT_START."""
        if self._checkpointer is not None and not self._loaded:  # alone: a fresh run, as fit(resume=False) is
            self._checkpointer.refuse_another_run(FRESH_TUNER)
        self._started = True
        warm_up_oom_path(self.device, self.knobs.memory_cap_bytes)
        if not keep_gradients:
            self.stepper.zero_grad()
        self.demand.measure_room()
        self.journal.write(Kind.FIT_START, self.step_count, self.counters.epoch, device=str(self.device),
                           micro_batch_size=self.knobs.micro_batch_size, keep_effective_batch=self.keep_effective_batch,
                           memory_cap=self.knobs.memory_cap_bytes, policies=[p.name for p in self.dispatcher.policies],
                           precision=self.core.precision, clip_grad_norm=self.stepper.clip_grad_norm,
                           clip_grad_value=self.stepper.clip_grad_value, compiled=self.core.compiled_model,
                           world=self.ranks.world, run_id=self.run_id, **fit_start)
        self.monitor_link.start(self.step_count, self.counters.epoch)
        if self.history is not None:
            self.history.start()
        self._last_step_end = time.perf_counter()
        self.fire(Event.FIT_START)

    # ------------------------------------------------------------------------- one batch
    def train_batch(self, batch: Any, n: int, *, optimizer_step: bool = True,
                    proposal: Callable[[], dict[str, Any]] | None = None,
                    held: list[tuple[nn.Parameter, torch.Tensor]] | None = None) -> BatchOutcome:
        """Train on one batch until every sample of it is in a completed optimizer step (or the
        accumulated gradients: `optimizer_step=False`): batch.py. `proposal()`: the host's fields of
        each agreement (a stop signal, a checkpoint due); `held`: gradients set aside, added before the step."""
        return self.batches.run(batch, n, optimizer_step=optimizer_step, proposal=proposal, held=held)

    def give_up_on_the_step(self, why: str) -> NoReturn:
        """The optimizer step ran out of memory (on this rank or another): checkpoint, raise."""
        self.recovery.give_up_on_the_step(why)

    def average_gradients(self) -> None:
        """Average the gradients over the ranks now (alone: nothing), before a framework clips and steps."""
        self.ranks.average_gradients()

    def after_batch(self, timing: StepTiming, n: int, outcome: BatchOutcome) -> None:
        """After a batch: its figures logged, then what the policies hear and ask (reactions.py: BATCH_END,
        BATCH_MEASURED, an agreed relief carried out, the monitor's MEMORY_HIGH and MEMORY_PRESSURE)."""
        self.reactions.after_batch(timing, n, outcome)

    def carry_out(self, relief: Relief | None) -> bool:
        """Carry out a relief a policy asked for; False if there was none or it failed."""
        return self.reactions.carry_out(relief)

    def listens(self, event: Event) -> bool:
        """Whether a policy subscribed to `event` (a host skips the work of one nobody hears)."""
        return event in self.dispatcher.events

    def fire(self, event: Event, failed_micro_batch: int | None = None, timing: StepTiming | None = None,
             force: bool = False) -> None:
        """Tell the policies subscribed to `event` (`force`: whether or not), with a snapshot of the run now."""
        self.reactions.fire(event, failed_micro_batch, timing, force)

    # ------------------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        """What continuing exactly needs, for your own checkpoints (`load_state_dict` on a Tuner built alike):
        weights, optimizer, scheduler, scaler, micro-batch, reliefs, policy states, counters, random states,
        the run id; one versioned record (checkpoint_format.py). Sharded (FSDP2): this rank's shards (DTensors)."""
        self.settle()  # a checkpoint holds exact counts and the scheduler's last step
        weights, optimizer = self.ranks.job.model_state(self.model, self.stepper.optimizer)
        return checkpoint_format.build(core={**self.core.state_dict(), "model": weights, "optimizer": optimizer},
                                       tuning=self.tuning_state(), progress=self.counters.state_dict(),
                                       rng=rng_state(), run_id=self.run_id)

    def tuning_state(self) -> dict[str, Any]:
        """Only what the tuner itself decided: micro-batch, reliefs, policy states (an integration's
        checkpoint, beside the weights and optimizer its trainer saves)."""
        return checkpoint_format.tuning(self.knobs, self.ladder, self.dispatcher, self.counters)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `state_dict` returned, by this autotune or an older one (the reliefs first);
        another model's or optimizer's is refused, naming the difference (same_run.py)."""
        state = checkpoint_format.migrate(state)
        reliefs_checked(state, functools.partial(self.load_tuning_state, state["tuning"]),
                        lambda: (self.ranks.job.model_state(self.model, None)[0], self.optimizer))
        core = state["core"]
        self.ranks.job.load_model_state(self.model, self.stepper.optimizer, core["model"], core["optimizer"])
        self.run_id = state["run"]["id"] or self.run_id
        self._loaded = True  # a run continued: the folder's checkpoints may be its own
        if self._checkpointer is not None:
            self._checkpointer.store.adopted = True
        self.core.load_state_dict(core)
        self.counters.load_state_dict(state["progress"])
        self.counters.on_ranks(self.ranks.world)  # this job's from here (AutoTrainer re-splits its position)
        set_rng_state(checkpoint_format.rank_rng(state, self.ranks.rank, self.ranks.world))

    def load_tuning_state(self, tuning: dict[str, Any]) -> None:
        """Restore what `tuning_state` returned (an older autotune's too)."""
        checkpoint_format.restore_tuning(tuning, self.knobs, self.ladder, self.dispatcher, self.counters)

    def checkpoint(self, reason: str, report_failure: bool = True) -> Path | None:
        """A checkpoint now (before a relief, an OOM error): the host's, else `state_dict()` in run_dir/checkpoints."""
        if self._host is not None:
            host = self._host()
            return host.checkpoint_now(reason, report_failure) if host is not None else None
        try:
            return self._checkpointer.save(reason, self.state_dict, self.step_count, self.counters.epoch,
                                           failure=self.stepper.failure if report_failure else None)
        except RankFailed as exc:  # another rank's optimizer step ran out of memory
            self.give_up_on_the_step(str(exc))

    def settle(self) -> None:
        """Read a fused optimizer's non-finite check left on the device: exact counts, a skipped step journaled."""
        self.stepper.settle()
        if self.stepper.skipped:
            self.recovery.report_skipped(None, self.keep_effective_batch)

    # ------------------------------------------------------------------------- the end
    def agree_on_micro_batch(self) -> int:
        """At a run's end, on every rank: rank 0's micro-batch, returned (a policy may have moved this rank's
        since the last agreement; a run ends, and is checkpointed, at one size everywhere)."""
        self.knobs.follow(self.ranks.follow_rank0(self.knobs.micro_batch_size, None, self.device)[0])
        return self.knobs.micro_batch_size

    def end(self, error: BaseException | None = None, **fit_end: Any) -> None:
        """The end of a run of steps: `fit_end` journaled (with the host's fields; none: a Tuner's own run,
        marked `tuner`), FIT_END, the monitor stopped. With the `error` that ended it: `fit_failed` (with the
        host's fields: the checkpoint saved before), no FIT_END. A later batch starts a new run."""
        if not self._started:
            return
        self._started = False
        if error is not None:
            self.journal.write(Kind.FIT_FAILED, self.step_count, self.counters.epoch, samples_seen=self.samples_seen,
                               error=f"{type(error).__name__}: {error}"[:500], **fit_end)
        self.settle()
        if error is None:
            skipped = self.counters.nonfinite_steps
            self.journal.write(Kind.FIT_END, self.step_count, self.counters.epoch, samples_seen=self.samples_seen,
                               ooms=self.ooms, nonfinite_steps=skipped, micro_batch_size=self.knobs.micro_batch_size,
                               **(fit_end or {"tuner": True}))
            if skipped:  # the first skip was said when it came; how many in all, at the end
                warn(f"{skipped} optimizer step{'s' if skipped > 1 else ''} of this run skipped on non-finite "
                     f"gradients (NaN or inf): not trained on; {self.samples_seen} samples trained",
                     key=f"nonfinite total {skipped} {self.run_dir}")
            self.fire(Event.FIT_END)
        self.monitor_link.stop(wait=False)  # signalled, not waited for (reaped at close)
        self.log.flush()

    def close(self) -> None:
        """End the run, take the reliefs' hooks off, give back the CUDA memory fraction, close the logs. Idempotent."""
        if self._closed:
            return
        self.end()
        self._closed = True
        self._give_back()

    def _give_back(self) -> None:
        """What close() gives back, of what was built: all of it, or as far as a constructor that failed got."""
        built = vars(self)
        if "ladder" in built:
            self.ladder.close()
        if "monitor_link" in built:
            self.monitor_link.stop()
        if self.history is not None:
            self.history.stop()
        if self._memory_fraction_set:
            torch.cuda.set_per_process_memory_fraction(1.0, self.device)
        if "log" in built:
            self.log.close()
        if "demand" in built:
            self.demand.peak.close()
        if "_lock" in built:
            if self.is_main:  # rank 0's folder; while it is still held, so no other run's files are touched
                _leave_as_found(self.run_dir, self._found)
            self._lock.release()

    def __enter__(self) -> "Tuner":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
