"""Carrying out memory reliefs between attempts, replaying them on resume, watching their effect.

A relief changes the model or the kernels it runs: bf16 autocast, activation checkpointing,
structured pruning. Policies ask for one (`knobs.relief`); the trainer hands it here at a
safe point (between attempts: after a batch, or after an OOM at the smallest micro-batch).

Owns: the reliefs applied so far and their order, the model's captured example inputs (for
tracing it when pruning), the pruning history (to prune a fresh model the same way on
resume), the effect watch. May touch: the model's structure and forward, the step core's
precision, the optimizer's param groups and state (pruning remaps them in place: the object stays
the user's, and so does what holds it), the DDP wrapper (re-wrapped).

A relief that itself runs out of memory (Torch-Pruning's importance estimate allocates, say)
leaves the model as it was: pruning replaces parameters and edits layer attributes, so the
ladder keeps a structural record of every module before it prunes (references to the same
tensors, no copies) and puts it back if anything fails. It is journaled as `relief_failed`.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from autotune.common.actions import RELIEF_NAMES, PruneChannels, Relief
from autotune.common.batching import map_tensors
from autotune.common.notices import warn
from autotune.common.oom import is_oom, oom_message
from autotune.memory.figures import free_memory
from autotune.memory.onednn import builds_bf16_kernels_under_a_hard_cap
from autotune.observe.records import Kind
from autotune.relief.checkpointing import checkpoint_blocks
from autotune.relief.pruning import (
    OptimizerRemap,
    UnsafePruning,
    adopt_unrecorded,
    prune_channels,
    remap_optimizer,
    replay_pruning,
)
from autotune.step.core import StepCore, to_device
from autotune.step.optimizer_step import OptimizerStep
from autotune.tuning.run import Run


class ReliefFailed(Exception):
    """A relief could not be carried out; the model is as it was before it was tried."""


class _InputCatcher:
    """A forward pre-hook keeping the model's first inputs (two samples, copied: a view would
    keep the whole batch alive), for tracing the model if it is ever pruned. It takes itself
    off the model once it has them: a module with a hook is called through a slower path,
    microseconds that a tiny model's every step would pay. Copies of the model (Torch-Pruning's,
    the meta dry run) share it rather than copy what holds it."""

    def __init__(self, model: nn.Module) -> None:
        self.example: tuple[tuple, dict] | None = None
        self.handle = model.register_forward_pre_hook(self, with_kwargs=True)

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if self.example is None and not _on_meta(args):
            self.example = (_first_rows_copied(args), _first_rows_copied(kwargs))
            self.handle.remove()

    def __deepcopy__(self, memo: dict) -> "_InputCatcher":
        return self


def _first_rows_copied(obj: Any, rows: int = 2) -> Any:
    return map_tensors(lambda t: (t[:rows] if t.dim() else t).detach().clone(), obj)


def _on_meta(obj: Any) -> bool:
    found: list[bool] = []
    map_tensors(lambda t: found.append(t.device.type == "meta"), obj)
    return any(found)


def _call_with(model: nn.Module, example: tuple[tuple, dict]) -> Any:
    args, kwargs = example
    return model(*args, **kwargs)


def _structure(model: nn.Module) -> list[tuple[nn.Module, dict[str, Any], dict, dict]]:
    """Every module's attributes, parameters and buffers as they are now: references, no copies."""
    return [(m, {k: v for k, v in vars(m).items() if k not in ("_parameters", "_buffers", "_modules")},
             dict(m._parameters), dict(m._buffers)) for m in model.modules()]


def _put_back(structure: list[tuple[nn.Module, dict[str, Any], dict, dict]]) -> None:
    for module, attributes, parameters, buffers in structure:
        for key in [k for k in vars(module) if k not in ("_parameters", "_buffers", "_modules")]:
            if key not in attributes:
                delattr(module, key)
        vars(module).update(attributes)
        module._parameters.clear()
        module._parameters.update(parameters)
        module._buffers.clear()
        module._buffers.update(buffers)


class ReliefLadder:
    """The reliefs of one trainer's model (see the module docstring)."""

    def __init__(self, run: Run, core: StepCore, stepper: OptimizerStep):
        self.model, self.ranks, self.journal = run.model, run.ranks, run.journal
        self.core, self.stepper = core, stepper
        self.applied: list[str] = []  # "autocast", "checkpointing", "pruning", in order
        self.last_step: int | None = None  # the step the last relief was applied at
        self.pruned_fraction = 0.0  # share of the model's parameters removed so far
        self._inputs = _InputCatcher(run.model)
        self._watch: dict[str, Any] | None = None
        self._history: list[dict[str, Any]] = []  # each prune: the traced example and Torch-Pruning's history

    def close(self) -> None:
        """Take the input catcher off the model (the reliefs applied stay)."""
        self._inputs.handle.remove()
        self._inputs.example = None

    def apply(self, action: Relief | None, step: int, epoch: int, demand: float | None, *,
              save_checkpoint: Callable[[str], Any]) -> bool:
        """Carry out `action` now (between attempts); True if it was applied. `save_checkpoint(reason)`
        writes one (before pruning). A relief that fails (it would break the model, or it ran out
        of memory itself) leaves the model as it was, is journaled as `relief_failed` and raises
        `ReliefFailed`."""
        if action is None:
            return False
        kind = RELIEF_NAMES[type(action)]
        why = None
        try:
            with self.core.kernel_room():  # pruning runs the model: its kernels, under a cap, checked as a step's
                details = self._carry_out(action, save_checkpoint)
        except UnsafePruning as exc:
            why = str(exc)
        except Exception as exc:
            if not is_oom(exc):
                raise
            why = f"out of memory while applying it: {oom_message(exc)}"
        if why is not None:  # outside `except`: what the failed try allocated can be freed now
            free_memory(self.core.device)
            self.journal.write(Kind.RELIEF_FAILED, step, epoch, relief=kind, reason=why)
            warn(f"memory relief {kind} not applied: {why}")
            raise ReliefFailed(f"{kind}: {why}")
        self.applied.append(kind)
        if kind != "autocast":
            self.core.model_changed()  # a compiled forward must see the new modules
        self.last_step = step
        self._watch = {"relief": kind, "from_step": step, "demands": []}
        self.journal.write(Kind.RELIEF, step, epoch, relief=kind, demand_before=demand, **details)
        warn(f"memory relief: {kind} ({action.reason})" + (f"; {details['note']}" if "note" in details else ""))
        free_memory(self.core.device)
        return True

    def _carry_out(self, action: Relief, save_checkpoint: Callable[[str], Any]) -> dict[str, Any]:
        if isinstance(action, PruneChannels):
            return self._prune(action.ratio, save_checkpoint)
        if RELIEF_NAMES[type(action)] == "autocast":
            if self.core.precision != "fp32":
                return {"note": f"precision={self.core.precision!r} was chosen for this run: autocast changes nothing"}
            unsafe = self._autocast_unsafe()
            if unsafe:  # counted as applied, so the ladder goes on to its next relief
                return {"note": f"skipped: {unsafe}"}
            plan = self.core.enable_autocast()
            if plan is None:
                return {"note": f"no autocast on {self.core.device.type}"}
            return {"dtype": str(plan.dtype).replace("torch.", ""), "grad_scaler": plan.needs_scaler}
        return {"blocks": checkpoint_blocks(self.model)}

    def _autocast_unsafe(self) -> str | None:
        # Why bf16 kernels would be compiled under a hard cap here (onednn.py), where one can kill the process.
        return builds_bf16_kernels_under_a_hard_cap() if self.core.device.type == "cpu" else None

    def _prune(self, ratio: float, save_checkpoint: Callable[[str], Any]) -> dict[str, Any]:
        self.ranks.job.check_prunable()  # UnsafePruning where the job's model cannot be pruned (sharded)
        if self._inputs.example is None:
            raise UnsafePruning("the model has not run yet: there is no input to trace it with")
        save_checkpoint("before_pruning")  # the unpruned model can be restored from here
        structure = _structure(self.model)
        try:
            # Traced with the model's own captured inputs, called as the training step called it.
            example = to_device(self._inputs.example, self.core.device)
            result = prune_channels(self.model, example, ratio, forward_fn=_call_with)
            remap = remap_optimizer(self.stepper.optimizer, result)  # the cut state: it may run out of memory
        except BaseException:
            _put_back(structure)  # half-pruned layers back to what they were; the optimizer was not touched
            raise
        del structure
        self._history.append({"example": map_tensors(torch.clone, example), "history": result.history})
        self._remap(remap)
        self.ranks.wrap(self.model, self.core.device)  # new parameters: a new DDP wrapper and gradient buffer
        self.pruned_fraction = 1 - (1 - self.pruned_fraction) * (1 - result.removed_fraction)
        return {"channel_ratio": ratio, "parameters_before": result.parameters_before,
                "parameters_after": result.parameters_after, "kept_whole": result.ignored,
                "parameters_removed_in_all": round(self.pruned_fraction, 4)}

    def _remap(self, remap: OptimizerRemap) -> None:
        """The pruned parameters into the same optimizer object (`OptimizerRemap.apply`), and said
        where some start with fresh state."""
        remap.apply()
        adopted = adopt_unrecorded(self.stepper.optimizer, self.model)
        if adopted:
            warn(f"{adopted} pruned parameter(s) start with fresh optimizer state (not carried over)")
        if remap.fresh:
            warn(f"{len(remap.fresh)} pruned parameter(s) start with fresh optimizer state: "
                 f"{type(self.stepper.optimizer).__name__}'s state is not shaped like its parameter "
                 f"({'; '.join(remap.fresh[:3])}{', ...' if len(remap.fresh) > 3 else ''})")

    def effect(self, demand: float | None, step: int, epoch: int) -> None:
        """A few steps after a relief, journal what the steps demand now."""
        watch = self._watch
        if watch is None or demand is None:
            return
        watch["demands"].append(demand)
        if len(watch["demands"]) >= 3:
            self.journal.write(Kind.RELIEF_EFFECT, step, epoch, relief=watch["relief"],
                               applied_at_step=watch["from_step"], demand_after=max(watch["demands"]))
            self._watch = None

    # ------------------------------------------------------------------------- checkpoints
    def state_dict(self) -> dict[str, Any]:
        # The gradient scaler's state is the optimizer step's (saved with the step core's).
        return {"applied": list(self.applied), "pruning": self._history, "pruned_fraction": self.pruned_fraction}

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        """Make this (fresh) trainer's model and forward what they were when the checkpoint was
        written: the reliefs again, in order, and a pruned model pruned the same way."""
        applied = list(saved["applied"])  # migrated: checkpoint_format.migrate_tuning
        if self.applied == applied:
            return  # this trainer is in that state already (resumed in the same process)
        if self.applied:
            raise ValueError(f"this trainer's model already has the reliefs {self.applied}, the checkpoint "
                             f"{applied}: resume into a fresh trainer built like the original one")
        prunes = iter(saved["pruning"])
        for kind in applied:
            if kind == "autocast" and not self._autocast_unsafe():  # skipped alike where it was skipped
                self.core.enable_autocast()
            elif kind == "checkpointing":
                checkpoint_blocks(self.model)
            elif kind == "pruning":
                entry = next(prunes)
                example = to_device(entry["example"], self.core.device)
                result = replay_pruning(self.model, example, entry["history"], forward_fn=_call_with)
                self.ranks.wrap(self.model, self.core.device)
                self._remap(remap_optimizer(self.stepper.optimizer, result))  # its state is loaded after
                self._history.append(entry)
            self.applied.append(kind)
        self.pruned_fraction = saved["pruned_fraction"]
        if any(kind != "autocast" for kind in applied):
            self.core.model_changed()
