"""The optimizer step: one batch's accumulated gradients, checked, clipped and stepped.

    step(n samples):
      the last step's late check read first (settle), where a fused optimizer left one
      non-finite gradients: never trained on ("skip": the step is not taken, said; "stop": raise);
        the buffers the batch's forward wrote put back (`on_skip`: rewind.py's), BatchNorm's running
        statistics with them, except where the check is read a step late (by then the next
        batch's forward has run over the copies: the word says they stay);
        `max_nonfinite_steps` skipped in a row: the run trains nothing (`streak_reached`, batch.py stops it)
      fp16: unscale; clip the whole batch's gradient; optimizer.step(); zero_grad
      counters: step, samples seen; the scheduler when it steps per optimizer step (a wrapper that
        held the step back, as Accelerate's does between its sync steps: the samples only)
    an OOM inside optimizer.step(): kept in `failure` (a smaller micro-batch cannot help it)

Owns: the optimizer, the LR scheduler, the gradient scaler, gradient clipping, the non-finite
check before a step (finite.py's, read at once or a step late), the steps not taken (`skipped`,
and how many in a row) and an optimizer step's OOM (`failure`). May touch: the model's gradients (reduced over the
ranks, zeroed), `Progress.step` and `Progress.samples_seen`; the model's buffers only through
`on_skip`, on a skip. Used by step.py's attempt (with
keep_effective_batch=False it steps every micro-batch) and by batch.py after the agreement.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from loguru import logger
from torch import nn

from autotune.common.oom import NonFiniteStep, is_oom, oom_message
from autotune.common.progress import Progress
from autotune.ranks.process import Process
from autotune.step import finite
from autotune.step.options import StepOptions

BUFFERS_PUT_BACK = "; the model's buffers put back as before the batch"
BUFFERS_KEPT = "; the model's buffers keep what its forward wrote (the check was read a step late)"


class OptimizerStep:
    """Steps the optimizer on accumulated gradients (see the module docstring)."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer | None, scheduler: Any, *,
                 device: torch.device, ranks: Process, counters: Progress, options: StepOptions = StepOptions()):
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.device, self.ranks, self.counters, self.options = device, ranks, counters, options
        # fp16's, set by step.py where the precision needs one (its backward scales the loss); None without
        self.scaler: torch.amp.GradScaler | None = None
        # The options a step reads, on the stepper itself: one attribute lookup on the steady path, not two.
        self.clip_grad_norm, self.clip_grad_value = options.clip_grad_norm, options.clip_grad_value
        self.scheduler_interval, self.on_nonfinite = options.scheduler_interval, options.on_nonfinite
        # Optimizer steps not taken since the caller last looked: (step, why, by whom, what of the
        # model's buffers: "" where it has none that moved, else one of BUFFERS_PUT_BACK, BUFFERS_KEPT).
        self.skipped: list[tuple[int, str, str, str]] = []
        # Puts back the buffers the skipped batch's forward wrote, whether there were any (step.py hands
        # rewind.py's `restore_buffers`); None: nothing to put back.
        self.on_skip: Callable[[], bool] | None = None
        self.max_nonfinite_steps = options.max_nonfinite_steps or None  # 0 or None: no limit
        self.nonfinite_in_a_row = 0  # steps skipped on non-finite gradients since the last one taken
        self.steps_tried = 0  # calls of `step`: the steps a batch tried, taken or not (`streak_reached`)
        self.failure: str | None = None  # the optimizer step ran out of memory: training cannot go on
        self.grad_norm: torch.Tensor | None = None  # the last step's gradient norm before clipping
        self._flag = finite.flag_for(device)  # the non-finite check's, for the model's device (all_finite)
        # Asked once: torch.device.type builds its string anew at each read (~0.25 us, every step).
        self._reads_late_here = device.type in finite.READ_LATE_ON
        self._late: finite.LateRead | None = None  # fused optimizers' checks, read a step late (see `settle`)
        self._told_fused = False  # the hint that a fused optimizer avoids the check's wait, given once
        self._stepped: tuple[Any, int, tuple[nn.Parameter, ...], bool] | None = None  # see `_stepped_parameters`
        self._watched_steps: tuple[Any, list[int]] | None = None  # see `_inner_steps`

    @property
    def plateau(self) -> bool:
        """Whether the scheduler steps on a metric (ReduceLROnPlateau), not on a count."""
        return isinstance(self.scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)

    def step(self, n_samples: int) -> None:
        """Step the optimizer on the accumulated gradients of `n_samples` samples (per rank):
        unscaled (fp16) and clipped first, as one batch's gradient. Non-finite gradients are never
        trained on: checked before the step, or, with a fused optimizer on CUDA, by the step itself
        on the device and read a step late (`finite.LateRead`, `settle`).

        An OOM inside optimizer.step() may leave some parameters updated and others not, and
        a smaller micro-batch cannot help it: it is not retried. It is kept in `failure` for
        the trainer (under torchrun every rank must learn of it before anyone stops)."""
        scaler, optimizer = self.scaler, self.optimizer
        self.steps_tried += 1
        clipping = self.clip_grad_norm is not None or self.clip_grad_value is not None
        inner_steps = self._inner_steps(optimizer)
        steps_before = inner_steps[0] if inner_steps is not None else 0
        if self._late is not None and self._late.pending:
            self.settle()  # the last step's check first: its scheduler step sets this step's LR
        late = (scaler is None and self._reads_late_here and self._may_read_late()
                and self.ranks.job.check_finite_late(lambda: self._check_late(optimizer)))
        if scaler is None and not late and not self._gradients_finite():
            # Never trained on: the weights stay those of the last finite step.
            if self.on_nonfinite == "stop":
                # The checkpoint of the last finite step comes next: its buffers too, not the NaN batch's.
                buffers = self._put_back_buffers()
                raise NonFiniteStep(f"non-finite gradients (NaN or inf) at step {self.counters.step + 1}: "
                                    f"stopped before the optimizer step (on_nonfinite='stop'){buffers}")
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
        samples = n_samples * self.ranks.world
        if inner_steps is not None and inner_steps[0] == steps_before:
            # A wrapper that steps every N calls (Accelerate's, between its sync steps) held this
            # one back: the samples wait in the accumulated gradients, and no step is counted.
            counters.accumulated(samples)
            return
        counters.stepped(samples)
        owed = self.scheduler is not None and self.scheduler_interval == "step" and not self.plateau
        if late:
            self._late.taken(counters.step, samples, owed)  # its scheduler step once the check is read
            return  # taken or not is known when the check is read (`settle`): the streak waits for it
        self.nonfinite_in_a_row = 0
        if owed:
            self.scheduler.step()

    def _inner_steps(self, optimizer: Any) -> list[int] | None:
        """For an optimizer that wraps another (Accelerate's `AcceleratedOptimizer` holds the
        user's in `.optimizer`), a one-element count of the inner one's steps, moved by a post-step
        hook: whether a call stepped is read there. None for a plain optimizer (every call steps)."""
        watched = self._watched_steps
        if watched is None or watched[0] is not optimizer:
            inner = optimizer
            while isinstance(getattr(inner, "optimizer", None), torch.optim.Optimizer):
                inner = inner.optimizer
            count: list[int] | None = None
            if inner is not optimizer:
                count = [0]
                inner.register_step_post_hook(lambda *_: count.__setitem__(0, count[0] + 1))
            watched = self._watched_steps = (optimizer, count)
        return watched[1]

    def _may_read_late(self) -> bool:
        # Plain parameters, and only to skip: "stop" must stop before the next batch is trained
        # on. (The job says whether a late check spares anything: alone, where no agreement reads
        # the host anyway.)
        return self.on_nonfinite == "skip" and self._stepped_parameters()[1]

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
            self.counters.unstepped(late.samples)
            # The copies of the buffers from before that batch were taken over by this one's keep:
            # what its forward wrote (a NaN running mean) stays, and is said.
            kept = BUFFERS_KEPT if next(self.model.buffers(), None) is not None else ""
            self.skipped.append((late.step, "non-finite gradients (NaN or inf)", "autotune", kept))
            self.nonfinite_in_a_row += 1
            return
        self.nonfinite_in_a_row = 0
        if late.scheduler_owed:
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
        return self.ranks.job.finite_everywhere(ok, self.device)

    def _stepped_parameters(self) -> tuple[tuple[nn.Parameter, ...], bool]:
        # The optimizer's parameters, walked again only when they changed (pruning: `forget_parameters`; a
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
        self.skipped.append((self.counters.step + 1, why, by, self._put_back_buffers()))
        self.nonfinite_in_a_row += 1

    def _put_back_buffers(self) -> str:
        # A skipped step leaves no trace: the buffers its batch's forward (and norm_stats.py's fold
        # of a split batch, which ran before this check) wrote go back to what they were before it.
        return BUFFERS_PUT_BACK if self.on_skip is not None and self.on_skip() else ""

    def streak_reached(self, tried_in_batch: int) -> bool:
        """Whether `max_nonfinite_steps` steps in a row were skipped on non-finite gradients, every
        one of the `tried_in_batch` this batch tried among them (so no part of the batch is in the
        weights: a checkpoint now holds the last finite step at the batch's start). A check left on
        the device that could make the count is read now (a wait for the device, only then): the
        step it guards may have been taken, or be the last of the streak."""
        limit = self.max_nonfinite_steps
        late = self._late
        if limit is None or self.nonfinite_in_a_row + (late is not None and late.pending) < limit:
            return False  # every batch: a few reads
        self.settle()
        return self.nonfinite_in_a_row >= max(limit, tried_in_batch)

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

    def reduce_gradients(self, ref: Any, items: Any) -> None:
        """Each rank's accumulated gradients made the batch's: averaged over ranks (weighted by
        samples: `items` None), or divided by every rank's items together (weighted by items,
        against `ref`: step.py's module docstring)."""
        if items is None:
            self.ranks.average_gradients()
        else:
            grads = [p.grad for group in self.optimizer.param_groups for p in group["params"] if p.grad is not None]
            self.ranks.job.divide_by_items(grads, ref, items)

    def zero_grad(self) -> None:
        if self.optimizer is None:  # another trainer's optimizer: the gradients of the model's parameters
            self.drop_gradients()
            return
        self.ranks.zero_grad(self.optimizer)

    def drop_gradients(self) -> None:
        """Every parameter's gradient gone (`.grad = None`), whatever the optimizer's zero_grad would do."""
        for p in self.model.parameters():
            p.grad = None

    def forget_parameters(self) -> None:
        """A relief replaced the model's parameters (pruning remaps the optimizer's): walked again."""
        self._stepped = None

    def state_dict(self) -> dict[str, Any]:
        """The scheduler and the gradient scaler (the optimizer is the job's to take: `ranks.job.model_state`)."""
        return {"scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
                "grad_scaler": self.scaler.state_dict() if self.scaler is not None else None}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `state_dict` returned."""
        if self.scheduler is not None and state["scheduler"] is not None:
            self.scheduler.load_state_dict(state["scheduler"])
        if self.scaler is not None and state["grad_scaler"]:
            self.scaler.load_state_dict(state["grad_scaler"])  # fp16: the loss scale it had reached
