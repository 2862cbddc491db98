"""The step core: one attempt at a batch in micro-batches, and the optimizer step.

    attempt(batch, from sample `done`, micro-batch size):
      for micro in split(batch, size):
        (fault injection: a fake OOM in forward or before backward)
        loss = step_fn(model, micro)            # under autocast with precision bf16/fp16
        (loss, n_items) = loss                  # when step_fn reports its items (tokens, say)
        backward(loss * weight)                 # weight: len(micro)/len(batch), or n_items/ref;
                                                # through the gradient scaler with fp16
        keep_effective_batch=False: optimizer step per micro-batch
      except OOM: note the size, the message, whether it was injected; keep no reference
    (the ranks reduce the gradients: averaged by samples, or summed and divided by all items)
    optimizer_step(): unscale (fp16); clip the whole batch's gradient; step; zero_grad;
      the scheduler when it steps per optimizer step; counters

Item weighting: a micro-batch's loss is its mean over its own items, so weighting it by
samples is not the batch's mean when micro-batches hold different numbers of items (padded
sequences). Each micro-batch is weighted by n_items/ref (ref: the first micro-batch's items
scaled to the whole batch, so the weights stay near samples' and a batch in one piece is
weighted exactly 1), and the accumulated gradient is then multiplied by ref/total items.

Owns: forward and backward, the loss weights, precision (autocast, gradient scaler), gradient
clipping, fault injection, the optimizer and the LR scheduler. Its rooms: losses.py (the loss
records it fills) and finite.py (the non-finite check it asks before a step). May touch: the model's
gradients, `Progress.step` and `Progress.samples_seen`. Does not decide anything: the
micro-batch size comes in, what failed goes out; OOM recovery is the trainer's.
"""

from __future__ import annotations

import dataclasses
import random
import sys
import time
from typing import Any, Callable

import torch
from loguru import logger
from torch import nn

from autotune import finite
from autotune.batching import SplitFn, map_tensors, micro_batches
from autotune.distributed import Ranks, Solo
from autotune.losses import Losses, loss_and_items
from autotune.oom import NonFiniteStep, is_oom, maybe_not_memory, oom_message
from autotune.progress import Progress
from autotune.relief.autocast import AutocastPlan, autocast_plan, precision_plan
from autotune.sharded import PeerFailed

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
    """What one attempt at a batch did."""

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

    def discard(self) -> None:
        """The attempt failed: its accumulated losses and items count for nothing."""
        self.losses.parts.clear()
        self.items, self.ref = None, None


class StepCore:
    """Forward/backward over micro-batches and the optimizer step (see the module docstring)."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any, *,
                 loss_fn: LossFn | None, step_fn: StepFn | None, split_fn: SplitFn | None, device: torch.device,
                 ranks: Solo | Ranks, counters: Progress, keep_effective_batch: bool, inject_oom: float, seed: int,
                 precision: str = "fp32", clip_grad_norm: float | None = None, clip_grad_value: float | None = None,
                 scheduler_interval: str = "step", compile: bool | dict[str, Any] = False,
                 on_nonfinite: str = "skip", backward_fn: Callable[[torch.Tensor], Any] | None = None):
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.on_nonfinite = on_nonfinite
        # Optimizer steps not taken since the caller last looked: (step, why, by whom).
        self.skipped: list[tuple[int, str, str]] = []
        self.loss_fn, self.step_fn, self.split_fn = loss_fn, step_fn, split_fn
        # What errors about the loss name.
        self.source = "loss_fn" if loss_fn is not None else "step_fn"
        self.device, self.ranks, self.counters = device, ranks, counters
        self.keep_effective_batch = keep_effective_batch
        self.inject_oom = inject_oom
        self._injector = random.Random(seed + 0x5EED + ranks.rank)  # own stream per rank
        self.precision = precision
        self.autocast: AutocastPlan | None = precision_plan(precision, device)
        self.scaler: torch.amp.GradScaler | None = (torch.amp.GradScaler(device.type)
                                                    if self.autocast is not None and self.autocast.needs_scaler else None)
        self.clip_grad_norm, self.clip_grad_value = clip_grad_norm, clip_grad_value
        self.scheduler_interval = scheduler_interval
        # torch.compile: ours (compile=True) over what forward calls, or the user's own compiled
        # model; either way the batch dimension is marked dynamic (micro-batch changes).
        self.compile_options = (compile if isinstance(compile, dict) else {}) if compile is not False else None
        self.compiled: nn.Module | None = (torch.compile(ranks.module(model), **self.compile_options)
                                           if self.compile_options is not None else None)
        self.compiled_model = self.compiled is not None or is_compiled(model)
        self.grad_norm: torch.Tensor | None = None  # the last step's gradient norm before clipping
        self.backward_fn = backward_fn  # another trainer's (HF's accelerator, Lightning's precision plugin)
        # Called in an OOM's except block, while the failed step's tensors are alive: what they held
        # (the OOM breakdown) and the CUDA allocator's state are read there (the Tuner's).
        self.on_failure: Callable[[], None] | None = None
        self.failure: str | None = None  # the optimizer step ran out of memory: training cannot go on
        self._parameters: tuple[nn.Parameter, ...] | None = None  # the model's, walked once (see `parameters`)
        self._flag = finite.flag_for(device)  # the non-finite check's, for the model's device (all_finite)
        self._late: finite.LateRead | None = None  # fused optimizers' checks, read a step late (see `settle`)
        self._told_fused = False  # the hint that a fused optimizer avoids the check's wait, given once
        self._stepped: tuple[Any, int, tuple[nn.Parameter, ...], bool] | None = None  # see `_stepped_parameters`

    @property
    def plateau(self) -> bool:
        """Whether the scheduler steps on a metric (ReduceLROnPlateau), not on a count."""
        return isinstance(self.scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)

    # ------------------------------------------------------------------------- the attempt
    def attempt(self, batch: Any, n: int, done: int, micro_batch_size: int, additive: bool = False) -> Attempt:
        """Forward and backward over the batch from sample `done` on, `micro_batch_size` at a time.
        With `keep_effective_batch` the gradients are only accumulated; the caller steps.
        `additive`: the step's losses are already scaled to add up to the batch's (a trainer
        that normalises its own loss); each is backpropagated as it is, and nothing steps."""
        stepping = not (self.keep_effective_batch or additive)
        size = min(micro_batch_size, n) if stepping else micro_batch_size
        result = Attempt(None, done, Losses(additive=additive), started=time.perf_counter())
        if self.failure is not None:
            return result  # this rank cannot go on: it only joins the agreement that says so
        seen = done
        # The whole batch in one piece (most steps): as it came, no split
        pieces = (((batch, n),) if done == 0 and size >= n and self.split_fn is None
                  else micro_batches(batch, size, start=done, split_fn=self.split_fn, total=n))
        try:
            with self.ranks.no_sync():
                for micro, m in pieces:
                    seen += m
                    self.ranks.micro_batch(last=seen >= n)
                    inject = self._draw_injection(size)
                    if inject == "forward":
                        raise torch.OutOfMemoryError(f"CUDA out of memory (injected by autotune in forward, p={self.inject_oom})")
                    loss, items = loss_and_items(self.loss(to_device(micro, self.device)), self.source)
                    if inject == "backward":
                        raise torch.OutOfMemoryError(f"CUDA out of memory (injected by autotune before backward, p={self.inject_oom})")
                    if additive:
                        self._backward(loss)
                        result.losses.parts.append((loss.detach(), 1))  # the losses add up to the batch's
                        del loss
                        continue
                    if stepping:
                        self._backward(loss)
                        self.optimizer_step(m)
                        if self.failure is not None:
                            return result
                        result.done += m
                        result.started = time.perf_counter()  # this chunk is stepped: kept
                        result.losses.parts.append((loss.detach(), m if items is None else items))
                    else:
                        self._accumulate(result, loss, items, m, n)
                    del loss
        except PeerFailed:
            # Another rank ran out of memory: this one's attempt stops at the same check, and is retried with it.
            result.peer_failed = True
            result.discard()
        except Exception as exc:
            self._note_failure(exc, result, size, keep_stepped=stepping)
        return result

    def whole_batch(self, batch: Any, n: int) -> Attempt | torch.Tensor:
        """The steady path's attempt (batch.py, alone): the whole batch in one piece, its
        gradients accumulated, nothing stepped. What `attempt(batch, n, 0, size)` does with
        size >= n, no split_fn and no fault injection, in fewer moves: a ~1 ms step pays for each.
        Returns the batch's mean loss (detached) where the step returned a plain loss, else the
        `Attempt` (failed, or weighted by the items the step reported) to go on with."""
        started = time.perf_counter()
        try:
            out = self.loss(to_device(batch, self.device))
            if type(out) is torch.Tensor and not out.ndim:
                self._backward(out)
                return out.detach()
            result = Attempt(None, 0, Losses(), started=started)
            self._accumulate(result, *loss_and_items(out, self.source), n, n)
            return result
        except Exception as exc:
            result = Attempt(None, 0, Losses(), started=started)
            self._note_failure(exc, result, n, keep_stepped=False)
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
                # items: each weights by raw items (ref 1), divided after.
                result.ref = 1 if self.ranks.sums_in_backward else _at_least_one(items * (n / m) if m != n else items)
            self._backward(loss * (items / result.ref))
            result.items = items if result.items is None else result.items + items
        result.losses.parts.append((loss.detach(), m if items is None else items))

    def _note_failure(self, exc: Exception, result: Attempt, size: int, keep_stepped: bool) -> None:
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
        if not keep_stepped:
            result.discard()

    def _draw_injection(self, size: int) -> str | None:
        # Never at micro-batch 1: an OOM there ends the run, and injected faults are meant
        # to exercise recovery. The phase decides whether a forward graph is left to free.
        if not self.inject_oom or size <= 1 or self._injector.random() >= self.inject_oom:
            return None
        return "forward" if self._injector.random() < 0.5 else "backward"

    def loss(self, micro: Any, module: nn.Module | None = None) -> Any:
        """The user's step on one micro-batch (already on the device), under the autocast in
        use: a loss or (loss, n_items). `module`: what to call (default: the training wrapper)."""
        if self.autocast is not None:
            with self.autocast.context():
                return self._forward(micro, module)
        return self._forward(micro, module)

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
        if self.backward_fn is not None:
            self.backward_fn(loss)
            return
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()

    # ------------------------------------------------------------------------- the step
    def optimizer_step(self, n_samples: int) -> None:
        """Step the optimizer on the accumulated gradients of `n_samples` samples (per rank):
        unscaled (fp16) and clipped first, as one batch's gradient. Non-finite gradients are never
        trained on: checked before the step, or, with a fused optimizer on CUDA, by the step itself
        on the device and read a step late (`finite.LateRead`, `settle`).

        An OOM inside optimizer.step() may leave some parameters updated and others not, and
        a smaller micro-batch cannot help it: it is not retried. It is kept in `failure` for
        the trainer (under torchrun every rank must learn of it before anyone stops)."""
        scaler, optimizer = self.scaler, self.optimizer
        clipping = self.clip_grad_norm is not None or self.clip_grad_value is not None
        if self._late is not None and self._late.pending:
            self.settle()  # the last step's check first: its scheduler step sets this step's LR
        late = (scaler is None and self.device.type in finite.READ_LATE_ON and self._may_read_late()
                and self._check_late(optimizer))
        if scaler is None and not late and not self._gradients_finite():
            # Never trained on: the weights stay those of the last finite step.
            if self.on_nonfinite == "stop":
                raise NonFiniteStep(f"non-finite gradients (NaN or inf) at step {self.counters.step + 1}: "
                                    "stopped before the optimizer step (on_nonfinite='stop')")
            self._skip("non-finite gradients (NaN or inf)", "autotune")
            return
        try:
            if scaler is not None and clipping:
                scaler.unscale_(optimizer)  # clip the true gradient, not the scaled one
            if clipping:
                self._clip()  # late: NaN in, NaN out, and the step is skipped either way
            if scaler is not None:
                scale = scaler.get_scale()
                scaler.step(optimizer)  # skips the step on inf/nan gradients
                scaler.update()
                if scaler.get_scale() < scale:  # it backs off only when it found inf/nan, and skipped
                    self._skip(f"inf/NaN gradients at loss scale {scale:g} (fp16)", "the gradient scaler")
                    return
            elif late:  # the fused optimizer skips its own update where the flag says so
                optimizer.grad_scale, optimizer.found_inf = None, self._late.flag.tensor
                try:
                    optimizer.step()
                finally:
                    del optimizer.grad_scale, optimizer.found_inf
            else:
                optimizer.step()
        except Exception as exc:
            if late:
                self._late.flag.clear()  # no step to read it for; the next check needs it clear
            if not is_oom(exc):
                raise
            self.failure = f"out of memory in optimizer.step() at step {self.counters.step}: {oom_message(exc)}"
            return
        self.zero_grad()
        counters = self.counters
        counters.step += 1
        samples = n_samples * self.ranks.world
        counters.samples_seen += samples
        owed = self.scheduler is not None and self.scheduler_interval == "step" and not self.plateau
        if late:
            self._late.taken(counters.step, samples, owed)  # its scheduler step once the check is read
        elif owed:
            self.scheduler.step()

    def _may_read_late(self) -> bool:
        # Alone (the ranks' agreement reads the host anyway), plain parameters, and only to skip:
        # "stop" must stop before the next batch is trained on.
        return self.on_nonfinite == "skip" and self.ranks.world == 1 and self._stepped_parameters()[1]

    def _check_late(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether this step's non-finite check is left on the device (`finite.LateRead`): the
        check went into the late flag, for a fused optimizer to skip its update on. False where
        the optimizer is not fused (said once, where it would have spared the wait) or the fused
        check refused these gradients (sparse, complex): the step checks at once then."""
        if not getattr(optimizer, "_step_supports_amp_scaling", False):  # fused=True skips on found_inf
            if not self._told_fused:
                self._told_fused = True
                logger.info(f"the NaN/inf check of each {type(optimizer).__name__} step waits for {self.device}: "
                            "an optimizer made with fused=True (Adam, AdamW, SGD, Adagrad) lets autotune leave it on "
                            "the device (on an H200, a ~2 ms step: Tuner.step 1.21x the plain step, 1.08x fused)")
            return False
        if self._late is None:
            self._late = finite.LateRead(self.device)
        flag = self._late.flag
        params, _ = self._stepped_parameters()
        try:  # into a clear flag: the last step's was read (settle) and cleared if it was set
            torch._amp_foreach_non_finite_check_and_unscale_([g for p in params if (g := p.grad) is not None],
                                                             flag.tensor, flag.one)
        except (NotImplementedError, RuntimeError):
            flag.clear()  # what it looked at before it refused may have set it
            return False
        return True

    def settle(self) -> None:
        """Read the last step's non-finite check if it was left on the device (a fused
        optimizer's step, `finite.LateRead`): a skipped step is uncounted and joins `skipped`; a
        taken one gets its scheduler step. Before anything reads the counters as final."""
        late = self._late
        if late is None or not late.pending:
            return
        if late.found():
            self.counters.step -= 1
            self.counters.samples_seen -= late.samples
            self.skipped.append((late.step, "non-finite gradients (NaN or inf)", "autotune"))
        elif late.scheduler_owed:
            self.scheduler.step()

    def _gradients_finite(self) -> bool:
        """Whether every gradient is finite (see `finite.all_finite`), read once: the only host sync this
        check adds to a step. Sharded, every rank looks at its own shards and they agree."""
        params, plain = self._stepped_parameters()
        local = ([g for p in params if (g := p.grad) is not None] if plain else
                 [g.to_local() if hasattr(g, "to_local") else g for p in params if (g := p.grad) is not None])
        try:  # every gradient on the model's device: the one fused check, without looking up the device
            ok = finite.finite_on(self._flag, local)
        except (NotImplementedError, RuntimeError):  # several devices, sparse or complex gradients
            ok = finite.all_finite(local)
        return self.ranks.finite_everywhere(ok, self.device)

    def _stepped_parameters(self) -> tuple[tuple[nn.Parameter, ...], bool]:
        # The optimizer's parameters, walked again only when it changed (pruning rebuilds it; a
        # group may be added), and whether all are plain tensors (sharded ones are DTensors).
        optimizer = self.optimizer
        cached = self._stepped
        if cached is None or cached[0] is not optimizer or cached[1] != len(optimizer.param_groups):
            params = tuple(p for group in optimizer.param_groups for p in group["params"])
            cached = self._stepped = (optimizer, len(optimizer.param_groups), params,
                                      not any(hasattr(p, "to_local") for p in params))
        return cached[2], cached[3]

    def _skip(self, why: str, by: str) -> None:
        # The batch is consumed, not trained: no step, no samples counted, no scheduler step.
        self.zero_grad()
        self.skipped.append((self.counters.step + 1, why, by))

    def _clip(self) -> None:
        params = [p for group in self.optimizer.param_groups for p in group["params"] if p.grad is not None]
        if self.clip_grad_norm is not None:
            self.grad_norm = nn.utils.clip_grad_norm_(params, self.clip_grad_norm)  # the norm before clipping
        if self.clip_grad_value is not None:
            nn.utils.clip_grad_value_(params, self.clip_grad_value)

    def step_scheduler(self, metric: float | None) -> None:
        """The scheduler's step at an epoch end (scheduler_interval="epoch") or, for
        ReduceLROnPlateau, on the metric it watches."""
        if self.scheduler is None:
            return
        self.settle()  # the last step's own scheduler step first
        if self.plateau:
            if metric is not None:
                self.scheduler.step(metric)
        else:
            self.scheduler.step()

    def reduce_gradients(self, attempt: Attempt) -> None:
        """Each rank's accumulated gradients made the batch's: averaged over ranks (weighted by
        samples), or divided by every rank's items together (weighted by items)."""
        if attempt.items is None:
            self.ranks.average_gradients()
        else:
            grads = [p.grad for group in self.optimizer.param_groups for p in group["params"] if p.grad is not None]
            self.ranks.divide_by_items(grads, attempt.ref, attempt.items)

    def reduce_gradients_with_news(self, attempt: Attempt, news: bool) -> bool:
        """`reduce_gradients`, with this rank's `news` in the same all-reduce (a replicated model
        under torchrun: distributed.Ranks.reduce_with_news): whether any rank had news."""
        return self.ranks.reduce_with_news(news, attempt.ref, attempt.items)

    def zero_grad(self) -> None:
        if self.optimizer is None:  # another trainer's optimizer: the gradients of the model's parameters
            self.drop_gradients()
            return
        self.ranks.zero_grad(self.optimizer)

    def drop_gradients(self) -> None:
        """Every parameter's gradient gone (`.grad = None`), whatever the optimizer's zero_grad would do."""
        for p in self.model.parameters():
            p.grad = None

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
        """The scheduler, the gradient scaler and the injector's random stream (the weights and
        the optimizer are the job's to take: `Solo.model_state`, sharded or not)."""
        version, keys, gauss = self._injector.getstate()
        return {"scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
                "grad_scaler": self.scaler.state_dict() if self.scaler is not None else None,
                "injector": [version, list(keys), gauss]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `state_dict` returned (a migrated checkpoint's "core": checkpoint_format.py)."""
        if self.scheduler is not None and state["scheduler"] is not None:
            self.scheduler.load_state_dict(state["scheduler"])
        if self.scaler is not None and state["grad_scaler"]:
            self.scaler.load_state_dict(state["grad_scaler"])  # fp16: the loss scale it had reached
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
        self._parameters = self._stepped = None
        if self.compiled is not None:
            self.compiled = torch.compile(self.ranks.module(self.model), **self.compile_options)
        elif self.compiled_model:
            torch._dynamo.reset()  # the user's compiled model: its cached graphs ran the old modules

    def enable_autocast(self) -> AutocastPlan | None:
        """Run forward passes under autocast from now on (a relief); None where the device has none.
        With a precision the user chose, nothing changes (see `relief/ladder.py`)."""
        if self.precision != "fp32":
            return self.autocast
        plan = autocast_plan(self.device)
        scaler = torch.amp.GradScaler(self.device.type) if plan is not None and plan.needs_scaler else None
        self.autocast, self.scaler = plan, scaler
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
