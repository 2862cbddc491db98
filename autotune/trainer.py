"""AutoTrainer: a training loop that survives out-of-memory errors and loses nothing.

The loop, and where each `Event` fires in it, is drawn once, in events.py.

With `keep_effective_batch=True` the micro-batches of a batch are accumulated with loss
weights len(micro)/len(batch), so the optimizer step equals the one without an OOM. With
False, every micro-batch is its own optimizer step, and a retry resumes at the first
sample not yet stepped on. Either way no sample is skipped or repeated.

Owns the epoch loop, evaluation calls, scheduled checkpoints and stop signals; it is the
`Tuner`'s host (tuner.py: one batch, OOM recovery, reliefs, policies, monitor, run log), and
uses only its host face. Touches: the input pipeline (data/pipeline.py), the checkpointer
(checkpoint.py), the evaluator (evaluation.py), the callbacks.
"""

from __future__ import annotations

import functools
import os
import signal
import time
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import torch
from loguru import logger
from torch import nn
from torch.utils.data import DataLoader, Dataset, IterableDataset

from autotune.common.batching import SplitFn, batch_len
from autotune.common.events import Event
from autotune.common.notices import warn
from autotune.common.oom import OutOfMemory
from autotune.common.progress import FitResult, Progress
from autotune.common.snapshot import InputState, StepTiming
from autotune.common.validate import check_bool, check_callable, check_int
from autotune.data.pipeline import InputPipeline, changed_input
from autotune.decisions.policy import Policy
from autotune.memory.figures import gc_frozen, memory_text
from autotune.monitor.host import room_bytes
from autotune.observe.records import Kind
from autotune.ranks.distributed import from_environment
from autotune.ranks.world_change import batch_on_this_world, go_on_with_this_world
from autotune.run_folder import checkpoint_format
from autotune.run_folder.checkpoint import CheckpointDue, Checkpointer, RankFailed
from autotune.run_folder.sharded_checkpoint import template_for_shards
from autotune.step.core import LossFn, StepFn, compile_count
from autotune.step.losses import LossSum
from autotune.stops.preemption import Preempted, StopRequests
from autotune.stops.preemption import stop_signals as parse_stop_signals
from autotune.stops.stall import StallWatch
from autotune.training.batch_in_hand import END, BatchInHand
from autotune.training.callbacks import Callbacks, StopRequest
from autotune.training.evaluation import EvaluationPlan, Evaluator, Metric
from autotune.tuner import Tuner
from autotune.tuning.arguments import TRAINER, with_arguments
from autotune.tuning.config import (
    OptimizerFactory,
    check_evaluation,
    check_run_limits,
    check_sample_layout,
    check_what_is_trained,
    resolve_device,
    resolve_micro_batch,
)
from autotune.tuning.host_face import Wiring
from autotune.tuning.options import tuner_keywords


def _counter(name: str) -> property:
    return property(lambda self: getattr(self.counters, name), doc=f"`Progress.{name}` of this trainer's run")


@with_arguments(TRAINER, trainer=True)
class AutoTrainer:
    """Train `model` on `dataset`, adapting to memory limits instead of crashing. Its arguments
    are documented in tuning/arguments.py (`TRAINER`), then those it shares with `Tuner` in its options
    record (tuning/options.py), appended here."""

    def __init__(self, model: nn.Module, dataset: Dataset | DataLoader, *,
                 loss_fn: LossFn | None = None, step_fn: StepFn | None = None,
                 optimizer: torch.optim.Optimizer | OptimizerFactory | None = None, scheduler: Any = None,
                 batch_size: int = 32, micro_batch_size: int | str | None = None,
                 max_micro_batch_size: int | None = None, keep_effective_batch: bool = True,
                 device: str | torch.device | None = None, policies: str | Path | Sequence[Policy] | None = "default",
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
                 callbacks: Sequence[Any] | None = None, compile: bool | dict[str, Any] = False,
                 memory_snapshot: bool | int = False, shard: bool = False, on_nonfinite: str = "skip",
                 max_nonfinite_steps: int | None = 50, data_stall_seconds: float | None = None,
                 stop_signals: Sequence[int | str] | None = None):
        given = dict(locals())  # the keywords as passed, before any is resolved below (the Tuner's, forwarded)
        if (loss_fn is None) == (step_fn is None):
            raise ValueError("pass exactly one of loss_fn(outputs, targets) or step_fn(model, micro_batch)")
        check_run_limits(checkpoint_every=checkpoint_every, checkpoint_interval=checkpoint_interval, seed=seed,
                         keep_checkpoints=keep_checkpoints, monitor=monitor, monitor_interval=monitor_interval,
                         data_stall_seconds=data_stall_seconds)
        for name in ("keep_effective_batch", "shuffle", "progress", "shard"):  # the Tuner's too: before the data's
            check_bool("", name, given[name])
        check_callable("", "collate_fn", collate_fn, "collate_fn(samples) -> batch")
        check_what_is_trained(model=model, loss_fn=loss_fn, step_fn=step_fn)  # before the data's first sample
        # All that can be checked before the Tuner takes the run folder (a factory's scheduler is built there).
        plateau = (isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)
                   if scheduler is None or hasattr(scheduler, "state_dict") else None)
        check_evaluation(eval_dataset=eval_dataset, eval_every=eval_every, eval_batch_size=eval_batch_size,
                         metrics=metrics, scheduler_metric=scheduler_metric, plateau=plateau)
        self._stop = StopRequests(parse_stop_signals(stop_signals))  # its handlers are installed while a fit runs
        self.callbacks = Callbacks(callbacks)
        ranks = from_environment()
        device = resolve_device(ranks.device_for(device, keep_effective_batch))
        ranks.join(device)
        self.keep_effective_batch = bool(keep_effective_batch)  # checked: a bool, or numpy's
        self.input = InputPipeline(dataset, batch_size=batch_size, shuffle=shuffle, seed=seed,
                                   num_workers=num_workers, collate_fn=collate_fn, device=device, ranks=ranks,
                                   stop_signals=self._stop.signals)
        batch_size = self.input.loader.batch_size  # validated by InputPipeline, or the DataLoader's own
        micro = resolve_micro_batch(micro_batch_size, batch_size)
        if loss_fn is not None and isinstance(dataset, Dataset) and not isinstance(dataset, IterableDataset):
            check_sample_layout(dataset[0])
        try:
            # The step, OOM recovery, policies, monitor and run log: the same Tuner a custom loop uses.
            self.counters = Progress()
            # Its options by name (tuning/options.py): an option of the Tuner's that AutoTrainer shows is forwarded
            # by being a keyword of both.
            self.tuner = Tuner(model, optimizer, loss_fn=loss_fn, step_fn=step_fn, scheduler=scheduler,
                               **tuner_keywords(given, micro_batch_size=micro, batch_size=batch_size, device=device),
                               _wiring=Wiring(host=self, ranks=ranks, counters=self.counters))
            self.ranks, self.device, self.model, self.run_dir = ranks, device, self.tuner.model, self.tuner.run_dir
            self.is_main = ranks.is_main
            tuner = self.tuner
            self.core, self.knobs, self.log, self.journal = tuner.core, tuner.knobs, tuner.log, tuner.journal
            self.input.bind(self.knobs, self.journal)  # the workers in use, and where they cannot start
            if plateau is None:  # a factory's scheduler: built by the Tuner
                check_evaluation(eval_dataset=eval_dataset, eval_every=eval_every, eval_batch_size=eval_batch_size,
                                 metrics=metrics, scheduler_metric=scheduler_metric, plateau=tuner.stepper.plateau)
            self.evaluation = EvaluationPlan(self.tuner.stepper, eval_dataset, eval_every, scheduler_metric)
            self.evaluator = Evaluator(self.core, batch_size=eval_batch_size or batch_size, collate_fn=collate_fn,
                                       metrics=metrics, journal=self.journal)
            self.metrics: dict[str, float] = {}  # the last evaluation's
            # A background checkpoint copies the state into host memory: the room under the host's
            # tightest limit (the memory cap too, training on CPU).
            self.checkpointer = Checkpointer(self.run_dir / "checkpoints", keep=keep_checkpoints,
                                             every=checkpoint_every, interval=checkpoint_interval, ranks=self.ranks, journal=self.journal,
                                             room_bytes=functools.partial(room_bytes, self.knobs.host_cap_bytes))
            self._stop_request = StopRequest(ranks, device, self.callbacks)
            # Named in the note of an error, and checkpointed before it propagates where that loses nothing.
            self._in_hand = BatchInHand(self.input.describe_batch, ranks=ranks, folder=self.checkpointer.folder,
                                        find_bad=self.input.find_bad_sample,
                                        preempted=functools.partial(self.checkpointer.preempted,
                                                                    progress=self.counters),
                                        stop_pending=self._stop.pending)
            self._stall_watch = StallWatch(self._in_hand, self.input.batch_indices, self.journal, ranks=ranks,
                                           seconds=data_stall_seconds)  # a loader that never answers is named
            self._stop.interrupts = self._stall_watch.interrupts  # a stop signal during a wait unwinds it
        except BaseException:
            # The run folder let go of and left as it was found (the Tuner's close removes what it made there
            # that is still empty), so that this process, or another, can build a trainer there at once.
            self.input.close()
            if "tuner" in vars(self):
                self.tuner.close()
            raise
        self._closed = False

    step, epoch, position, batches_done, ooms, samples_seen = map(
        _counter, ("step", "epoch", "position", "batches_done", "ooms", "samples_seen"))
    optimizer = property(lambda self: self.tuner.stepper.optimizer, doc="the optimizer (yours: pruning remaps it in place)")
    scheduler = property(lambda self: self.tuner.stepper.scheduler, doc="the LR scheduler, or None")
    reliefs = property(lambda self: self.tuner.reliefs, doc="memory reliefs applied, in order")
    monitor = property(lambda self: self.tuner.monitor_process, doc="the monitor process, while one runs")
    demand = property(lambda self: self.tuner.demand, doc="the step's memory demand over the cap")
    loader = property(lambda self: self.input.loader, doc="the DataLoader in use now (rebuilt: workers, caching)")
    outputs = property(lambda self: self.tuner.outputs, doc="the last batch's outputs step_fn handed back (StepResult)")

    # ----------------------------------------------------------------------------- the loop
    def fit(self, epochs: int = 1, max_steps: int | None = None, resume: bool | str | Path = False) -> FitResult:
        """Train until `epochs` epochs (or `max_steps` optimizer steps) are done in all, or a callback
        calls `request_stop`. `resume=True`: first continue from the newest valid checkpoint in `run_dir`
        (none: start fresh); a path: from that checkpoint (a sharded model's: a folder); False: a new run,
        refused where `run_dir` holds another run's checkpoints (`AnotherRunsCheckpoints`). A deterministic
        run killed and resumed ends with the same weights and `samples_seen` as one that was not."""
        check_int("", "epochs", epochs, 1)
        check_int("", "max_steps", max_steps, 1, optional=True)
        if not isinstance(resume, (bool, str, os.PathLike)):
            raise TypeError(f"resume={resume!r}: pass True (the newest checkpoint in run_dir), False (a new run) "
                            "or the path of a checkpoint")
        if self._closed:
            raise RuntimeError("this AutoTrainer was closed: build a new one to train again")
        self.checkpointer.begin(resume, self.load_state_dict, self.counters, self.device,  # or refuse another run's
                                template=lambda: template_for_shards(self.state_dict(), self.model, self.optimizer))
        self._stop_request.clear()
        started, fitting = time.perf_counter(), os.getpid()
        self.checkpointer.restart_clock(self.step)
        self.tuner.begin(batch_size=self.knobs.batch_size, epochs=epochs, max_steps=max_steps,
                         eval_every=self.evaluation.schedule)
        logger.info(f"training on {self.device}: batch {self.knobs.batch_size}, micro-batch "
                    f"{self.knobs.micro_batch_size}, run dir {self.run_dir}")
        compiles = compile_count() if self.core.compiled_model else 0
        self.callbacks.fire("on_fit_start", self)
        self.log.open_bar(self.input.planned_batches(self.counters, epochs, max_steps, self.keep_effective_batch))
        epoch_loss = None
        # The stop signals' handlers cover the whole way out: a repeat never cuts the stop's checkpoint short.
        with self._stop:
            try:
                with self._stall_watch, gc_frozen():
                    while self.epoch < epochs and (max_steps is None or self.step < max_steps) \
                            and self._stop_request.reason is None:
                        epoch_loss = self._train_epoch(max_steps)
                self.tuner.agree_on_micro_batch()  # the run ends at one micro-batch on every rank
                # Written in the background: fit returns while it is fsynced (close(), the next save or
                # load, and the interpreter's exit wait for it).
                saved = self.checkpoint_now("end" if self._stop_request.reason is None else "stop_requested",
                                            background=True)
                signum = self.ranks.known_to_all(self._stop.signum)  # alone; under torchrun no agreement is left
                if signum is not None:
                    # A stop that came after the last batch: the run is done and saved, and still stops.
                    raise self.checkpointer.preempted(signum, saved, self.counters)
            except BaseException as exc:
                if os.getpid() != fitting:  # a child a callback forked, ending (sys.exit): not the run's end
                    raise
                # On the record before it propagates, so a crashed run's journal says why it ended. The
                # user's sys.exit is checkpointed as an error is; a stop by signal has its checkpoint.
                users_exit = isinstance(exc, SystemExit) and not isinstance(exc, Preempted)
                saved = self._in_hand.save_before_raising(exc, self.step, self.checkpoint_now) \
                    if isinstance(exc, Exception) or users_exit else None
                self.input.stop_workers()  # now, not when the exception is collected
                self.tuner.end(error=exc, **self._in_hand.failure_fields(saved))  # on the record: fit_failed
                raise
            finally:
                self.log.close_bar()
        wall = time.perf_counter() - started
        result = self.counters.fit_result(self.knobs, self.keep_effective_batch, loss=epoch_loss, wall_seconds=wall,
                                          run_dir=self.run_dir, metrics=dict(self.metrics),
                                          stopped=self._stop_request.reason)
        compiled = {"compiles": compile_count() - compiles} if self.core.compiled_model else {}
        self.tuner.end(batch_size=result.batch_size, wall_seconds=wall, loss=epoch_loss, metrics=result.metrics,
                       stopped=result.stopped, **compiled)
        self.callbacks.fire("on_fit_end", self, result)
        return result

    def evaluate(self, dataset: Dataset | DataLoader | None = None) -> dict[str, float]:
        """The mean loss (`"loss"`) and every metric over `dataset` (default: `eval_dataset`), in eval
        mode under `torch.no_grad()`, over items where the step reports them. With a micro-batch of
        its own: an OOM halves it and runs the same samples again; the training one stays as it is."""
        dataset = self.evaluation.dataset if dataset is None else dataset
        if dataset is None:
            raise ValueError("evaluate() needs a dataset: pass one, or eval_dataset= to AutoTrainer")
        try:
            metrics = self.evaluator.run(dataset, self.step, self.epoch)
        except OutOfMemory:
            self.checkpoint_now("out_of_memory")  # the training so far survives the error
            raise
        self.metrics = metrics
        logger.info("evaluation at step {}: {}", self.step, ", ".join(f"{k} {v:.4g}" for k, v in metrics.items()))
        self.callbacks.fire("on_evaluate", self, metrics)
        self.evaluation.evaluated(metrics)
        return metrics

    def request_stop(self, reason: str = "requested") -> None:
        """End the fit after the current step, with a checkpoint (early stopping, from a callback).
        `FitResult.stopped` says why; a later `fit` call goes on from there."""
        self._stop_request.ask(reason)

    def close(self) -> None:
        """Leave the user's model as given (the trainer's hook off it), give back the CUDA memory fraction,
        remove the sample cache's shared memory, close the journal, steps log and TensorBoard. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self.checkpointer.wait()  # a checkpoint still being written: on disk, and journaled, first
        self._stall_watch.stop()
        self.input.close()
        self.tuner.close()

    def __enter__(self) -> "AutoTrainer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _train_epoch(self, max_steps: int | None) -> float | None:
        self.tuner.fire(Event.EPOCH_START)
        self.model.train()
        epoch_loss_sum = LossSum(self.device)  # summed on the device: no sync per step
        if self.position == 0:  # the epoch's order is padded for the ranks it begins on
            self.counters.on_ranks(self.ranks.world, epoch_too=True)
        batches = self.input.batches(self.epoch, self.position, self.batches_done, self.counters.epoch_world,
                                     step=self.step)
        finished_epoch = True
        while True:
            wait_start = time.perf_counter()
            batch = self._in_hand.fetch(batches, self.epoch, self.position, self.batches_done, self.step, wait_start,
                                        save=self.checkpoint_now)
            if batch is END:
                break
            step_start = time.perf_counter()
            n = batch_len(batch)
            outcome = self.tuner.train_batch(batch, n, proposal=self._proposal)
            self._in_hand.done()
            step_end = time.perf_counter()
            epoch_loss_sum.add(outcome.losses)
            self.counters.batch_trained(n)
            timing = StepTiming(step_seconds=step_end - wait_start, data_wait_seconds=step_start - wait_start,
                                retries=outcome.retries)
            self.tuner.after_batch(timing, n, outcome)
            for event in self.input.on_step(timing, n, self.journal, self.step, self.epoch,
                                            profile=self.tuner.listens(Event.IO_BOUND)):
                self.tuner.fire(event, timing=timing)
            if self.input.stale(self.knobs):  # a policy changed workers or caching
                del batches  # its workers exit before the new loader's start
                batches = self.input.rebuild(self.knobs, self.journal, self.step, self.epoch, self.position)
            if self.log.show_due(step_end):
                self.log.show(step_end, loss=lambda: f"{epoch_loss_sum.mean() or 0:.4f}", micro=self.knobs.micro_batch_size,
                              mem=lambda: memory_text(self.device, self.knobs.memory_cap_bytes))
            agreed = outcome.agreed
            if signum := agreed.stop_signal:  # agreed by all ranks under torchrun
                raise self.checkpointer.preempted(signum, self.checkpoint_now(f"signal {signal.Signals(signum).name}"),
                                                  self.counters)
            self.callbacks.fire("on_step_end", self)
            if self.evaluation.due_after_step(self.step):
                self.evaluate()
            # After the step's callbacks and evaluation: a resume from this checkpoint has seen them.
            if agreed.checkpoint_due:
                self.checkpoint_now("every" if agreed.checkpoint_due == CheckpointDue.BY_STEPS else "interval")
                # Several failed in a row (a full disk): stop, every rank alike, rather than train unsaved.
                self.checkpointer.raise_if_failing(self.ranks.any(self.checkpointer.failing, self.device))
            if self._stop_request.agreed(self.journal, self.step, self.epoch):
                finished_epoch = False
                break
            if max_steps is not None and self.step >= max_steps:
                finished_epoch = False
                break
        epoch_loss = epoch_loss_sum.mean()
        if finished_epoch:
            self.counters.epoch_ended()
            self.journal.write(Kind.EPOCH_END, self.step, self.epoch - 1, samples_seen=self.samples_seen,
                               loss=epoch_loss, micro_batch_size=self.knobs.micro_batch_size)
            self.input.epoch_end(self.journal, self.step, self.epoch - 1)
            self.tuner.fire(Event.EPOCH_END)
            if self.evaluation.due_at_epoch_end():
                self.evaluate()
            self.evaluation.epoch_ended(epoch_loss)
            self.callbacks.fire("on_epoch_end", self)
            self._stop_request.agreed(self.journal, self.step, self.epoch)
        return epoch_loss

    def _proposal(self) -> dict[str, Any]:
        # Each agreement also carries a stop signal any rank received, and a checkpoint due by the batch's step.
        return {"stop_signal": self._stop.signum or 0,
                "checkpoint_due": self.checkpointer.due(self.step + (1 if self.keep_effective_batch else 0))}

    # ----------------------------------------------------------------------------- checkpoints
    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue exactly: the tuner's (weights, optimizer, scheduler,
        counters, sizes, reliefs, policy states, random states), the position in the epoch, and as
        the host's part the loader's workers, the evaluation's micro-batch and the callbacks' states
        (checkpoint_format.py has the layout)."""
        state = self.tuner.state_dict()
        state["host"] = {"num_workers": self.knobs.num_workers, "evaluation": self.evaluator.state_dict(),
                         "callbacks": self.callbacks.state_dict(), "input": self.input.input()}
        # A caller's loader's position is this rank's, as the random states are: it travels with them.
        state["rng"]["loader"] = self.input.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `state_dict` returned (by this autotune or an older one)."""
        state = checkpoint_format.migrate(state)
        saved_batch, saved_world = state["tuning"]["batch_size"], state["progress"]["world"]
        if saved_world != self.ranks.world:
            batch_size = batch_on_this_world(saved_batch, saved_world, self.ranks.world)
        elif saved_batch != self.knobs.batch_size:
            raise ValueError(f"the checkpoint was made with batch_size {saved_batch}, this trainer "
                             f"has {self.knobs.batch_size}: the position in the epoch would not line up")
        self._check_input(state["host"].get("input", {}), state["progress"]["position"])
        self.tuner.load_state_dict(state)
        self.input.load_state_dict(checkpoint_format.rank_rng(state, self.ranks.rank, self.ranks.world).get("loader"))
        host = state["host"]
        workers = host.get("num_workers", self.knobs.num_workers) if self.input.owned else self.knobs.num_workers
        if self.knobs.restore(state["tuning"]["micro_batch_size"], workers):  # as tuned before the stop
            self.input.set_workers(workers)
        if saved_world != self.ranks.world:
            go_on_with_this_world(self.counters, self.knobs, self.input, self.journal, saved_batch=saved_batch,
                                  saved_world=saved_world, world=self.ranks.world, batch_size=batch_size,
                                  run_dir=self.run_dir)
        if host.get("evaluation"):
            self.evaluator.load_state_dict(host["evaluation"])
        self.callbacks.load_state_dict(host.get("callbacks", {}))

    def _check_input(self, saved: dict[str, Any], position: int) -> None:
        # The order of an epoch is a function of the input: mid-epoch, another one would train some samples
        # twice and others never (refused, before anything is loaded); at an epoch's end the next epoch is
        # drawn from the new one (said).
        changed = changed_input(saved, self.input.input())
        if changed and position:
            raise ValueError(f"the checkpoint stopped {position} samples into an epoch of another input "
                             f"({'; '.join(changed)}): resuming it would train some of this epoch's samples twice "
                             "and others never. Resume with the input it had, or start a new run in another run_dir")
        if changed:
            warn(f"resuming at an epoch's end with another input ({'; '.join(changed)}): the next epochs are drawn "
                 "from this one")

    # ----------------------------------------------------------------------------- what a host lends its Tuner
    def checkpoint_now(self, reason: str, report_failure: bool = True, background: bool = False) -> Path | None:
        """Write a checkpoint of `state_dict()` now (`Host`: the Tuner asks before a relief and
        before an OOM error; the loop, when one is due or the fit ends)."""
        try:
            return self.checkpointer.save(reason, self.state_dict, self.step, self.epoch,
                                          failure=self.tuner.stepper.failure if report_failure else None,
                                          background=background, position=self.position,
                                          samples_seen=self.samples_seen)
        except RankFailed as exc:  # another rank's optimizer step ran out of memory
            self.tuner.give_up_on_the_step(str(exc))

    def input_state(self) -> InputState:
        """The input pipeline's figures (`Host`), for the policies' snapshots."""
        return self.input.state()
