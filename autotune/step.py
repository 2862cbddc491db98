"""The step core: one attempt at a batch in micro-batches, and the optimizer step.

    attempt(batch, from sample `done`, micro-batch size):
      for micro in split(batch, size):
        (fault injection: a fake OOM in forward or before backward)
        loss = step_fn(model, micro)            # under autocast once that relief is on
        backward(loss * len(micro) / len(batch)) # through the gradient scaler with fp16
        keep_effective_batch=False: optimizer step per micro-batch
      except OOM: note the size, the message, whether it was injected; keep no reference
    optimizer_step(): scaler.step or optimizer.step; zero_grad; scheduler.step; counters

Owns: forward and backward, the loss weights, precision (autocast plan, gradient scaler),
fault injection, the optimizer and the LR scheduler. May touch: the model's gradients,
`Progress.step` and `Progress.samples_seen`. Does not decide anything: the micro-batch
size comes in, what failed goes out; OOM recovery is the trainer's.
"""

from __future__ import annotations

import dataclasses
import random
import time
from typing import Any, Callable

import torch
from torch import nn

from autotune.batching import SplitFn, map_tensors, micro_batches
from autotune.distributed import Ranks, Solo
from autotune.oom import is_oom, maybe_not_memory, oom_message
from autotune.progress import Progress
from autotune.relief.autocast import AutocastPlan, autocast_plan

LossFn = Callable[[Any, Any], torch.Tensor]
StepFn = Callable[[nn.Module, Any], torch.Tensor]


def to_device(obj: Any, device: torch.device) -> Any:
    """Move every tensor in a (nested) batch to `device`."""
    return map_tensors(lambda t: t.to(device, non_blocking=True), obj)


@dataclasses.dataclass
class Attempt:
    """What one attempt at a batch did."""

    failed_size: int | None  # the micro-batch size that ran out of memory, or None
    done: int  # samples of the batch in completed optimizer steps (keep_effective_batch=False)
    loss_sum: torch.Tensor  # summed (not mean) loss of the samples kept
    message: str = ""  # the OOM's first line
    injected: bool = False
    # cuDNN's NOT_SUPPORTED may not be about memory: kept (without its traceback, which pins the
    # failed attempt's tensors) to re-raise as it is if it persists at micro-batch 1
    not_supported: BaseException | None = None
    started: float = 0.0  # perf_counter when the work an OOM throws away began


class StepCore:
    """Forward/backward over micro-batches and the optimizer step (see the module docstring)."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any, *,
                 loss_fn: LossFn | None, step_fn: StepFn | None, split_fn: SplitFn | None, device: torch.device,
                 ranks: Solo | Ranks, progress: Progress, keep_effective_batch: bool, inject_oom: float, seed: int):
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.loss_fn, self.step_fn, self.split_fn = loss_fn, step_fn, split_fn
        self.device, self.ranks, self.progress = device, ranks, progress
        self.keep_effective_batch = keep_effective_batch
        self.inject_oom = inject_oom
        self._injector = random.Random(seed + 0x5EED + ranks.rank)  # own stream per rank
        self.autocast: AutocastPlan | None = None
        self.scaler: torch.amp.GradScaler | None = None
        self.failure: str | None = None  # the optimizer step ran out of memory: training cannot go on

    # ------------------------------------------------------------------------- the attempt
    def attempt(self, batch: Any, n: int, done: int, micro_batch_size: int) -> Attempt:
        """Forward and backward over the batch from sample `done` on, `micro_batch_size` at a time.
        With `keep_effective_batch` the gradients are only accumulated; the caller steps."""
        size = micro_batch_size if self.keep_effective_batch else min(micro_batch_size, n)
        result = Attempt(None, done, torch.zeros((), device=self.device), started=time.perf_counter())
        if self.failure is not None:
            return result  # this rank cannot go on: it only joins the agreement that says so
        try:
            with self.ranks.no_sync():
                for micro, m in micro_batches(batch, size, start=done, split_fn=self.split_fn):
                    inject = self._draw_injection(size)
                    if inject == "forward":
                        raise torch.OutOfMemoryError(f"CUDA out of memory (injected by autotune in forward, p={self.inject_oom})")
                    loss = self._loss(to_device(micro, self.device))
                    if inject == "backward":
                        raise torch.OutOfMemoryError(f"CUDA out of memory (injected by autotune before backward, p={self.inject_oom})")
                    if self.keep_effective_batch:
                        # Weight by the micro-batch's share so the accumulated gradient is the
                        # gradient of the mean loss over the whole batch.
                        self._backward(loss * (m / n))
                    else:
                        self._backward(loss)
                        self.optimizer_step(m)
                        if self.failure is not None:
                            return result
                        result.done += m
                        result.started = time.perf_counter()  # this chunk is stepped: kept
                    result.loss_sum += loss.detach() * m
                    del loss
        except Exception as exc:
            if not is_oom(exc):
                raise
            result.failed_size, result.message = size, oom_message(exc)
            result.injected = "injected by autotune" in result.message
            if maybe_not_memory(exc):
                if size <= 1:
                    raise  # nothing smaller to try, and it may not be memory: the error as it is
                result.not_supported = exc.with_traceback(None)
            if self.keep_effective_batch:
                result.loss_sum.zero_()
        return result

    def _draw_injection(self, size: int) -> str | None:
        # Never at micro-batch 1: an OOM there ends the run, and injected faults are meant
        # to exercise recovery. The phase decides whether a forward graph is left to free.
        if not self.inject_oom or size <= 1 or self._injector.random() >= self.inject_oom:
            return None
        return "forward" if self._injector.random() < 0.5 else "backward"

    def _loss(self, micro: Any) -> torch.Tensor:
        if self.autocast is not None:
            with self.autocast.context():
                return self._forward(micro)
        return self._forward(micro)

    def _forward(self, micro: Any) -> torch.Tensor:
        module = self.ranks.module(self.model)
        if self.step_fn is not None:
            return self.step_fn(module, micro)
        if not (isinstance(micro, (tuple, list)) and len(micro) == 2):
            raise TypeError(f"with loss_fn, each batch must be (inputs, targets); got {type(micro).__name__}: "
                            "pass step_fn(model, micro_batch) for other layouts")
        inputs, targets = micro
        return self.loss_fn(module(inputs), targets)

    def _backward(self, loss: torch.Tensor) -> None:
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()

    # ------------------------------------------------------------------------- the step
    def optimizer_step(self, n_samples: int) -> None:
        """Step the optimizer on the accumulated gradients of `n_samples` samples (per rank).

        An OOM inside optimizer.step() may leave some parameters updated and others not, and
        a smaller micro-batch cannot help it: it is not retried. It is kept in `failure` for
        the trainer (under torchrun every rank must learn of it before anyone stops)."""
        try:
            if self.scaler is not None:
                self.scaler.step(self.optimizer)  # unscales; skips the step on inf/nan gradients
                self.scaler.update()
            else:
                self.optimizer.step()
        except Exception as exc:
            if not is_oom(exc):
                raise
            self.failure = f"out of memory in optimizer.step() at step {self.progress.step}: {oom_message(exc)}"
            return
        self.zero_grad()
        if self.scheduler is not None:
            self.scheduler.step()
        self.progress.step += 1
        self.progress.samples_seen += n_samples * self.ranks.world

    def zero_grad(self) -> None:
        self.ranks.zero_grad(self.optimizer)

    def state_dict(self) -> dict[str, Any]:
        """The optimizer, the scheduler and the injector's random stream (for exact resume)."""
        version, keys, gauss = self._injector.getstate()
        return {"optimizer": self.optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
                "injector": [version, list(keys), gauss]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        if self.scheduler is not None and state.get("scheduler") is not None:
            self.scheduler.load_state_dict(state["scheduler"])
        version, keys, gauss = state["injector"]
        self._injector.setstate((version, tuple(keys), gauss))

    def enable_autocast(self) -> AutocastPlan | None:
        """Run forward passes under autocast from now on (a relief); None where the device has none."""
        plan = autocast_plan(self.device)
        scaler = torch.amp.GradScaler(self.device.type) if plan is not None and plan.needs_scaler else None
        self.autocast, self.scaler = plan, scaler
        return plan
