"""The attempt: forward and backward over one batch in micro-batches, the gradients accumulated.

    attempt(batch, from sample `done`, micro-batch size):
      for micro in split(batch, size):           (the whole batch in one piece when it fits)
        (fault injection: a fake OOM in forward or before backward)
        loss = step_fn(model, micro)            # under autocast with precision bf16/fp16
        (loss, n_items) = loss                  # when step_fn reports its items (tokens, say)
        backward(loss * weight)                 # weight: len(micro)/len(batch), or n_items/ref;
                                                # through the gradient scaler with fp16
        keep_effective_batch=False: the optimizer step per micro-batch (optimizer_step.py)
      except OOM: note the size, the message, whether it was injected; keep no reference

Item weighting: a micro-batch's loss is its mean over its own items, so weighting it by
samples is not the batch's mean when micro-batches hold different numbers of items (padded
sequences). Each micro-batch is weighted by n_items/ref (ref: the first micro-batch's items
scaled to the whole batch, so the weights stay near samples' and a batch in one piece is
weighted exactly 1), and the accumulated gradient is then multiplied by ref/total items
(optimizer_step.py's `reduce_gradients`, over every rank's items).

Owns: forward and backward, the loss weights, precision (autocast; it makes the step's gradient
scaler), torch.compile, fault injection, and entering the kernel room around forward and backward
(kernel_room.py: under RLIMIT_AS, room for oneDNN's low-precision kernels checked before each op).
Its rooms: losses.py (the loss records it fills) and optimizer_step.py (the step after the attempt).
May touch: the model's gradients. Does not decide anything: the micro-batch size comes in, what
failed goes out; OOM recovery is recovery.py's.

The attempt's side state: what an attempt changes besides gradients (random streams, buffers,
BatchNorm's running statistics under micro-batches) is kept before it (rewind.py, norm_stats.py),
and its losses and outputs are held in the `Attempt`. Once every rank agreed, the batch loop calls
one of the attempt's two: `commit` (it fit: BatchNorm's statistics settled to the whole batch's,
said once a run in the journal) or `roll_back` (it failed here or on another rank: streams and
buffers put back, BatchNorm's sums and, unless its chunks were stepped, its losses and outputs
dropped). Nothing outside this module drives rewind.py or norm_stats.py.
"""

from __future__ import annotations

import dataclasses
import random
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from autotune.common.batching import map_tensors, micro_batches
from autotune.common.notices import warn
from autotune.common.oom import is_oom, maybe_not_memory, oom_message
from autotune.memory import kernel_room
from autotune.observe.journal import Journal
from autotune.observe.records import Kind
from autotune.ranks.process import Process
from autotune.ranks.sharded import PeerFailed
from autotune.step.losses import Losses, loss_and_items, read_step
from autotune.step.norm_stats import BatchNormStats
from autotune.step.optimizer_step import OptimizerStep
from autotune.step.options import StepOptions
from autotune.step.precision import AutocastPlan, autocast_plan, precision_plan
from autotune.step.rewind import Rewind

LossFn = Callable[[Any, Any], torch.Tensor]
StepFn = Callable[[nn.Module, Any], "torch.Tensor | tuple[torch.Tensor, int | torch.Tensor]"]
PRECISIONS = ("fp32", "bf16", "fp16")


def to_device(obj: Any, device: torch.device) -> Any:
    """Move every tensor in a (nested) batch to `device` (one already there is passed as it is:
    `.to()` would return it too, at a few microseconds a call)."""
    if _flat_and_there(obj, device):  # the common batch, already moved by the loader (or on CPU)
        return obj
    return map_tensors(lambda t: t if t.device == device else t.to(device, non_blocking=True), obj)


def _flat_and_there(obj: Any, device: torch.device) -> bool:
    # `(inputs, targets)` or `{name: tensor}` with every tensor on `device`: nothing to rebuild.
    parts = obj.values() if type(obj) is dict else obj if type(obj) in (tuple, list) else (obj,)
    for part in parts:
        if type(part) is not torch.Tensor or part.device != device:
            return False
    return True


@dataclasses.dataclass(slots=True)  # slots: made every batch, and read on the steady path
class Attempt:
    """What one attempt at a batch did, and what it changed besides the gradients: once every rank
    agreed whether it fit, the batch loop calls `commit` or `roll_back` (the module docstring)."""

    failed_micro_batch: int | None  # the micro-batch size that ran out of memory, or None
    done: int  # samples of the batch in completed optimizer steps (keep_effective_batch=False)
    losses: "Losses"  # of the micro-batches kept
    items: Any = None  # the batch's items, when step_fn reports them (None: weighted by samples)
    ref: Any = None  # the items each micro-batch's weight was taken against (see the module docstring)
    message: str = ""  # the OOM's first line
    injected: bool = False
    # cuDNN's NOT_SUPPORTED may not be about memory: kept (without its traceback, which pins the
    # failed attempt's tensors) to re-raise as it is if it persists at micro-batch 1
    not_supported: BaseException | None = None
    started: float = 0.0  # perf_counter when the work an OOM throws away began
    peer_failed: bool = False  # another rank ran out of memory in this attempt (sharded.py)
    core: StepCore | None = None  # whose streams, buffers and BatchNorm statistics it changed
    n: int = 0  # the batch's samples and the micro-batch size it ran at, where it ran through
    size: int = 0  # BatchNorm in micro-batches (set only then: the steady path makes none)

    def discard(self) -> None:
        """The attempt failed: its accumulated losses, outputs and items count for nothing."""
        self.losses.parts.clear()
        self.losses.outputs.clear()
        self.items, self.ref = None, None

    def commit(self) -> None:
        """Every rank agreed the attempt fit: a batch it ran in micro-batches through BatchNorm in
        training leaves the running statistics the whole batch's (norm_stats.py), said once a run."""
        core = self.core
        if core.norms.active:  # most attempts: in one piece, nothing to settle
            core._settle_norms(self)

    def roll_back(self) -> None:
        """Every rank agreed the attempt failed (here or on another rank): what it drew from the
        random streams and wrote into buffers is put back for the retry, its BatchNorm sums go, and
        so do its losses and outputs (kept, they would count twice), but with keep_effective_batch=False
        its stepped chunks stay, and so do their buffers (rewind.py kept them at each chunk's end)."""
        core = self.core
        core.rewind.restore()
        core.norms.drop()
        if core.keep_effective_batch or self.losses.additive:  # nothing of it was stepped
            self.discard()


class StepCore:
    """Forward/backward over micro-batches (see the module docstring)."""

    def __init__(self, model: nn.Module, stepper: OptimizerStep, *, loss_fn: LossFn | None, step_fn: StepFn | None,
                 device: torch.device, ranks: Process, options: StepOptions = StepOptions(),
                 backward_fn: Callable[[torch.Tensor], Any] | None = None):
        self.model, self.stepper, self.options = model, stepper, options
        self.loss_fn, self.step_fn, self.split_fn = loss_fn, step_fn, options.split_fn
        # What errors about the loss name.
        self.source = "loss_fn" if loss_fn is not None else "step_fn"
        self.device, self.ranks = device, ranks
        # The options the attempt reads, on the core itself: one attribute lookup on the steady path, not two.
        self.keep_effective_batch = options.keep_effective_batch
        self.inject_oom = options.inject_oom or 0.0  # the rate (the Tuner's record resolves the environment's)
        self._injector = random.Random(options.seed + 0x5EED + ranks.rank)  # own stream per rank
        self.precision = options.precision
        self.autocast: AutocastPlan | None = precision_plan(options.precision, device)
        # fp16's gradient scaler: the loss is scaled here, the gradients unscaled by the step.
        stepper.scaler = (torch.amp.GradScaler(device.type)
                          if self.autocast is not None and self.autocast.needs_scaler else None)
        # torch.compile: ours (compile=True) over what forward calls, or the user's own compiled
        # model; either way the batch dimension is marked dynamic (micro-batch changes).
        compile = options.compile
        self.compile_options = (compile if isinstance(compile, dict) else {}) if compile is not False else None
        self.compiled: nn.Module | None = (torch.compile(ranks.module(model), **self.compile_options)
                                           if self.compile_options is not None else None)
        self.compiled_model = self.compiled is not None or is_compiled(model)
        self.backward_fn = backward_fn  # another trainer's (HF's accelerator, Lightning's precision plugin)
        # Called in an OOM's except block, while the failed step's tensors are alive: what they held
        # (the OOM breakdown) and the CUDA allocator's state are read there (the Tuner's).
        self.on_failure: Callable[[], None] | None = None
        self._parameters: tuple[nn.Parameter, ...] | None = None  # the model's, walked once (see `parameters`)
        self._dtypes: frozenset[torch.dtype] | None = None  # the parameters' (see `kernel_room`)
        self._noted: set[torch.dtype] = set()  # low-precision dtypes the step's products were seen in, checked
        self._watching = True  # until an attempt has run under the check, every low-precision product is checked
        self._checked = False  # this attempt ran under the check
        self._cap = kernel_room.CapReader(device)  # the address-space cap, read again once a second (`kernel_room`)
        self._room: Any = None  # an attempt's `kernel_room`, for each of its forwards and backwards; None outside one
        if device.type == "cpu":
            kernel_room.warm()  # torch's answers, asked now: not first under a cap, inside a step
        self.rewind = Rewind(model, device)  # the random streams and buffers an attempt changes, kept before it
        stepper.on_skip = self.rewind.restore_buffers  # a step skipped on NaN leaves the buffers as before its batch
        self.norms = BatchNormStats(model)  # BatchNorm's running statistics over a batch in micro-batches
        self._notice_to: tuple[Journal, Path] | None = None  # where `_settle_norms` says its change, until it has

    # ------------------------------------------------------------------------- the attempt
    def attempt(self, batch: Any, n: int, done: int, micro_batch_size: int, additive: bool = False) -> Attempt:
        """Forward and backward over the batch from sample `done` on, `micro_batch_size` at a time.
        With `keep_effective_batch` the gradients are only accumulated; the caller steps.
        `additive`: the step's losses are already scaled to add up to the batch's (a trainer
        that normalises its own loss); each is backpropagated as it is, and nothing steps."""
        stepping = not (self.keep_effective_batch or additive)
        size = min(micro_batch_size, n) if stepping else micro_batch_size
        result = Attempt(None, done, Losses([], additive, []), started=time.perf_counter(), core=self)
        if self.stepper.failure is not None:
            return result  # this rank cannot go on: it only joins the agreement that says so
        self.rewind.keep()  # what a failed attempt must not leave behind (rewind.py)
        self._checked = False
        self._room = self.kernel_room()  # once an attempt: no dtype or cap it depends on changes within one
        seen = done
        # The whole batch in one piece (most steps): as it came, no split
        pieces = (((batch, n),) if done == 0 and size >= n and self.split_fn is None
                  else micro_batches(batch, size, start=done, split_fn=self.split_fn, total=n))
        # Split into micro-batches of one optimizer batch: BatchNorm's statistics over the whole batch (norm_stats.py)
        split = size < n and self.keep_effective_batch and not additive
        if split or self.norms.active:  # most attempts: one piece, nothing to set up
            self.norms.begin(split)
            result.n, result.size = n, size  # what its commit says (`_settle_norms`)
        try:
            for micro, m in pieces:
                seen += m
                self.ranks.job.micro_batch(last=seen >= n)
                inject = self._draw_injection(size) if self.inject_oom else None
                if inject == "forward":
                    raise torch.OutOfMemoryError(f"CUDA out of memory (injected by autotune in forward, p={self.inject_oom})")
                loss, items, outputs = read_step(self.loss(to_device(micro, self.device)), self.source)
                if inject == "backward":
                    raise torch.OutOfMemoryError(f"CUDA out of memory (injected by autotune before backward, p={self.inject_oom})")
                if additive:
                    self._backward(loss)
                    result.losses.parts.append((loss.detach(), 1))  # the losses add up to the batch's
                elif stepping:
                    self._backward(loss)
                    self.stepper.step(m)
                    if self.stepper.failure is not None:
                        return result
                    result.done += m
                    result.started = time.perf_counter()  # this chunk is stepped: kept
                    self.rewind.keep()  # a failure from here rewinds to this chunk's end, not the attempt's start
                    result.losses.parts.append((loss.detach(), m if items is None else items))
                else:
                    self._accumulate(result, loss, items, m, n)
                if outputs is not None:  # handed back (StepResult): kept with the micro-batch's loss
                    result.losses.outputs.append(outputs)
                del loss
        except PeerFailed:
            # Another rank ran out of memory: this one's attempt stops at the same check, and is retried with it.
            result.peer_failed = True
            result.discard()
        except Exception as exc:
            self._note_failure(exc, result, size)
        finally:
            if self.norms.active:
                self.norms.pause()
            if self.rewind.streams_move is None:  # until the first whole attempt says whether it draws
                self.rewind.attempted(whole=result.failed_micro_batch is None and not result.peer_failed)
            if self._watching and self._checked and result.failed_micro_batch is None and not result.peer_failed:
                self._watching = False  # what the step's products run in is known now (`_noted`)
            self._room = None  # outside an attempt (evaluation, a relief): asked where it is used
        return result

    def _accumulate(self, result: Attempt, loss: torch.Tensor, items: Any, m: int, n: int) -> None:
        # One micro-batch of `m` of the batch's `n` samples backpropagated, its gradient accumulated
        # as its share of the batch's, and its loss kept in `result`.
        if items is None:
            # Weight by the micro-batch's share so the accumulated gradient is the gradient of
            # the mean loss over the whole batch.
            self._backward(loss * (m / n) if m != n else loss)
        else:
            if result.ref is None:
                # Sharded, FSDP2 sums the ranks' gradients before anyone knows every rank's
                # items: each weights by raw items (ref 1), divided after (the job's answer).
                result.ref = self.ranks.job.items_reference(_at_least_one(items * (n / m) if m != n else items))
            self._backward(loss * (items / result.ref))
            result.items = items if result.items is None else result.items + items
        result.losses.parts.append((loss.detach(), m if items is None else items))

    def _settle_norms(self, attempt: Attempt) -> None:
        """`attempt` ran in micro-batches through BatchNorm in training and fit (`Attempt.commit`): the
        running statistics are the whole batch's now. Each micro-batch was normalised over itself: a
        numerics change, said once a run on stderr and in the journal (`journal_to`)."""
        modules = len(self.norms.active)
        self.norms.settle()
        if self._notice_to is None:
            return  # said already, or no run to say it in
        journal, run_dir = self._notice_to
        self._notice_to = None
        # Said once, at the first batch split: the micro-batch named is this one's ("now"); the sizes
        # after it are said by their own lines (an OOM's retry, a growth past the size given).
        change = (f"BatchNorm ({modules} modules) normalises each micro-batch over its own samples (micro-batch "
                  f"{attempt.size} now), not the batch of {attempt.n}; its running statistics are the whole batch's")
        counters = self.stepper.counters
        journal.write(Kind.NUMERICS, counters.step, counters.epoch, change=change, micro_batch_size=attempt.size,
                      batch_size=attempt.n, modules=modules)
        warn(f"{change} (docs: getting-started, what stays exact)", key=f"batchnorm micro {run_dir}")

    def journal_to(self, journal: Journal, run_dir: Path) -> None:
        """The run whose journal an attempt's numerics notice goes to (once a run), and on stderr once per `run_dir`."""
        self._notice_to = (journal, run_dir)

    def _note_failure(self, exc: Exception, result: Attempt, size: int) -> None:
        # An attempt's exception: an OOM is noted in `result` (never the exception itself, whose
        # frames pin the failed attempt's tensors); anything else goes on up.
        if not is_oom(exc):
            raise exc
        if self.on_failure is not None:
            self.on_failure()
        result.failed_micro_batch, result.message = size, oom_message(exc)
        result.injected = "injected by autotune" in result.message
        if maybe_not_memory(exc):
            if size <= 1:
                raise exc  # nothing smaller to try, and it may not be memory: the error as it is
            result.not_supported = exc.with_traceback(None)

    def _draw_injection(self, size: int) -> str | None:
        # Never at micro-batch 1: an OOM there ends the run, and injected faults are meant
        # to exercise recovery. The phase decides whether a forward graph is left to free.
        if size <= 1 or self._injector.random() >= self.inject_oom:
            return None
        return "forward" if self._injector.random() < 0.5 else "backward"

    def loss(self, micro: Any, module: nn.Module | None = None) -> Any:
        """The user's step on one micro-batch (already on the device), under the autocast in
        use: a loss or (loss, n_items). `module`: what to call (default: the training wrapper)."""
        room = self._room or self.kernel_room()
        if room is kernel_room.NOTHING and self.autocast is None:
            return self._forward(micro, module)  # most steps: nothing to enter (a `with` costs a steady step)
        with room:
            if self.autocast is not None:
                with self.autocast.context():
                    return self._forward(micro, module)
            return self._forward(micro, module)

    def kernel_room(self) -> Any:
        """Where oneDNN would build this step's low-precision kernels under an address-space cap
        (the autocast's dtype or the parameters'), the check that turns a refusal it does not
        survive into an OOM (kernel_room.py); elsewhere a context that does nothing."""
        cap = self._cap.cap()
        if cap is None:
            return kernel_room.NOTHING  # most steps: no cap, nothing to check
        if self._dtypes is None:
            self._dtypes = frozenset(p.dtype for p in self.parameters())
        dtypes = self._dtypes | self._noted
        if self.autocast is not None:
            dtypes = dtypes | {self.autocast.dtype}
        if self._watching:  # a step that casts or autocasts on its own: HF's bf16=True, Lightning's bf16-mixed
            dtypes = dtypes | kernel_room.LOW_PRECISION_SET
        room = kernel_room.guard(dtypes, cap, self._noted)
        self._checked = self._checked or isinstance(room, kernel_room.KernelRoom)
        return room

    def _forward(self, micro: Any, module: nn.Module | None) -> Any:
        if module is None:
            module = self.compiled if self.compiled is not None else self.ranks.module(self.model)
        if self.compiled_model:
            map_tensors(_mark_batch_dynamic, micro)
        if self.step_fn is not None:
            return self.step_fn(module, micro)
        if not (isinstance(micro, (tuple, list)) and len(micro) == 2):
            raise TypeError(f"with loss_fn, each batch must be (inputs, targets); got {type(micro).__name__}: "
                            "pass step_fn(model, micro_batch) for other layouts")
        inputs, targets = micro
        return self.loss_fn(module(inputs), targets)

    def forward_backward(self, micro: Any) -> None:
        """One forward and backward of `micro` as a training step runs them (the user's step,
        autocast, scaler), the gradients dropped after and nothing stepped: what a memory
        calibration measures (limits.py)."""
        try:
            loss, _ = loss_and_items(self.loss(to_device(micro, self.device)), self.source)
            self._backward(loss)
            del loss
        finally:
            self.model.zero_grad(set_to_none=True)

    def _backward(self, loss: torch.Tensor) -> None:
        room = self._room or self.kernel_room()
        if room is kernel_room.NOTHING:  # most steps
            self._backward_through(loss)
        else:
            with room:  # backward builds kernels of its own (the gradients' products)
                self._backward_through(loss)

    def _backward_through(self, loss: torch.Tensor) -> None:
        if self.backward_fn is not None:
            self.backward_fn(loss)
            return
        scaler = self.stepper.scaler
        (scaler.scale(loss) if scaler is not None else loss).backward()

    def use(self, step_fn: StepFn | None, loss_fn: LossFn | None) -> None:
        """Train with `step_fn` or `loss_fn` from now on (`Tuner.step`'s); neither: the ones given before."""
        if step_fn is not None and loss_fn is not None:
            raise ValueError("pass step_fn or loss_fn, not both")
        if step_fn is not None or loss_fn is not None:
            self.step_fn, self.loss_fn = step_fn, loss_fn
            self.source = "loss_fn" if loss_fn is not None else "step_fn"
        elif self.step_fn is None and self.loss_fn is None:
            raise ValueError("Tuner.step needs step_fn(model, micro_batch) or loss_fn(outputs, targets): "
                             "pass one here or to Tuner(...)")

    def state_dict(self) -> dict[str, Any]:
        """The scheduler, the gradient scaler (the step's) and the injector's random stream (the
        weights and the optimizer are the job's to take: `ranks.job.model_state`, sharded or not)."""
        version, keys, gauss = self._injector.getstate()
        return {**self.stepper.state_dict(), "injector": [version, list(keys), gauss],
                "optimizer_class": type(self.stepper.optimizer).__name__}  # a resume refuses another (same_run.py)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `state_dict` returned (a migrated checkpoint's "core": checkpoint_format.py)."""
        self.stepper.load_state_dict(state)
        version, keys, gauss = state["injector"]
        self._injector.setstate((version, tuple(keys), gauss))

    def parameters(self) -> tuple[nn.Parameter, ...]:
        """The model's parameters, walked once: a walk of its modules costs a ~1 ms step 7-25 us,
        and only a relief changes them (`model_changed`)."""
        if self._parameters is None:
            self._parameters = tuple(self.model.parameters())
        return self._parameters

    def model_changed(self) -> None:
        """A relief changed the model's modules: its parameters are walked again, a compiled
        forward is compiled again."""
        self._parameters = self._dtypes = None
        self.stepper.forget_parameters()
        self.rewind.forget()
        self.norms.forget()
        if self.compiled is not None:
            self.compiled = torch.compile(self.ranks.module(self.model), **self.compile_options)
        elif self.compiled_model:
            torch._dynamo.reset()  # the user's compiled model: its cached graphs ran the old modules

    def enable_autocast(self) -> AutocastPlan | None:
        """Run forward passes under autocast from now on (a relief); None where the device has none.
        With a precision the user chose, nothing changes (see `tuning/relief_ladder.py`)."""
        if self.precision != "fp32":
            return self.autocast
        plan = autocast_plan(self.device)
        scaler = torch.amp.GradScaler(self.device.type) if plan is not None and plan.needs_scaler else None
        self.autocast, self.stepper.scaler = plan, scaler
        return plan


def is_compiled(model: nn.Module) -> bool:
    """Whether `model` is what `torch.compile(module)` returned. Asked without importing
    torch._dynamo (2 s): if nothing imported it, nothing was compiled."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    return eval_frame is not None and isinstance(model, eval_frame.OptimizedModule)


def compile_count() -> int:
    """Frames torch.compile has compiled in this process so far (a recompile is one more)."""
    from torch._dynamo.utils import counters

    return int(counters["frames"]["ok"])


def _mark_batch_dynamic(t: torch.Tensor) -> None:
    # One graph for every micro-batch size (sizes 0 and 1 are still specialised by torch).
    if t.ndim:
        torch._dynamo.maybe_mark_dynamic(t, 0)


def _at_least_one(items: Any) -> Any:
    # A weight against zero items would divide by zero; a batch with no items has no gradient anyway.
    return items.clamp_min(1) if isinstance(items, torch.Tensor) else max(items, 1)
