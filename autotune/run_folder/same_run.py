"""The right run: which run a checkpoint belongs to, and whether this trainer can continue it.

    new_run_id()                  a Tuner's id at its start (rank 0's on every rank); a resume
                                  takes the checkpoint's, so a run keeps one id across restarts.
                                  Every checkpoint holds it ("run": {"id"}), so do the journal's
                                  fit_start and resume records
    another_runs_checkpoints(..)  fit(resume=False) where the folder holds checkpoints this run
                                  neither wrote nor resumed from: `AnotherRunsCheckpoints`, naming
                                  them, before anything is written (the old rule pruned them as
                                  the new run's, and a later resume continued the old run)
    mismatch(saved, model, opt)   before anything of a checkpoint is loaded: the model's parameter
                                  and buffer names and shapes, the optimizer's class and its
                                  parameter groups; a difference is `CheckpointMismatch`, naming it
    changed_hyperparameters(..)   the rule for what may differ: the checkpoint's hyperparameters
                                  win (a resumed run goes on as it was, as torch's
                                  `Optimizer.load_state_dict` does); each one that differs from the
                                  constructor's is listed in a warning

Owns these rules. Touches nothing: the callers hand in the state dicts and say what to do.
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any, Callable, Iterable

import torch

from autotune.common.notices import warn

# Not hyperparameters: how the optimizer computes, which a checkpoint of another machine may differ in.
IMPLEMENTATION_KEYS = frozenset({"params", "param_names", "foreach", "fused", "capturable", "differentiable"})
_SHOWN = 5  # names listed per kind of difference


class AnotherRunsCheckpoints(RuntimeError):
    """`fit(resume=False)` into a run folder that holds another run's checkpoints: refused before
    anything is written, so they are neither pruned as this run's nor resumed later by mistake.
    Continue that run with `fit(resume=True)`, or give this one another `run_dir` (or move the
    old checkpoints away)."""


class CheckpointMismatch(ValueError):
    """The checkpoint being resumed was made by another model (parameter names or shapes) or
    another optimizer (class, parameter groups): refused before anything is loaded, naming the
    difference."""


def new_run_id() -> str:
    """A run's id: 12 hex digits, unique enough to tell the runs of one folder apart."""
    return uuid.uuid4().hex[:12]


def run_id_of(state: dict[str, Any]) -> str | None:
    """The run id a checkpoint holds (None: written by an autotune before run ids)."""
    run = state.get("run")
    return run.get("id") if isinstance(run, dict) else None


FRESH_FIT = ("fit(resume=False) starts a new one", "Continue that run with fit(resume=True)")
FRESH_TUNER = ("this Tuner starts a new one (it loaded no state)", "Continue that run with "
               "tuner.load_state_dict(torch.load(its newest checkpoint, weights_only=True)) before the first step")


def another_runs_checkpoints(folder: Path, others: list[Path],
                             starting: tuple[str, str] = FRESH_FIT) -> AnotherRunsCheckpoints:
    """The error for a fresh start where `others` (newest first) are not this run's; `starting`:
    (what starts afresh, how to continue the other run instead), FRESH_FIT or FRESH_TUNER."""
    steps = _names(path.name for path in others)
    what, instead = starting
    return AnotherRunsCheckpoints(
        f"{folder} holds {len(others)} checkpoint(s) of another run ({steps}) and {what}: its checkpoints would be "
        f"pruned as this run's, and a later resume would pick either run. {instead}, or give this one another "
        "run_dir (or move that folder away)")


def mismatch(saved_weights: dict[str, Any], weights: dict[str, Any], saved_optimizer: Any, optimizer: Any,
             saved_class: str | None) -> list[str]:
    """What differs between a checkpoint's model and optimizer and this trainer's, in words (empty:
    nothing). A checkpoint with reliefs (pruning changes shapes, activation checkpointing names) is
    compared once they are applied again. `saved_class`: the optimizer's class name the checkpoint
    names (None: an older checkpoint; its groups' keys then tell another class)."""
    problems = _model_differences(saved_weights, weights)
    if optimizer is not None and saved_optimizer is not None:
        problems += _optimizer_differences(saved_optimizer, optimizer, saved_class)
    return problems


def _model_differences(saved: dict[str, Any], now: dict[str, Any]) -> list[str]:
    problems = []
    missing = [name for name in now if name not in saved]
    unexpected = [name for name in saved if name not in now]
    if missing:
        problems.append(f"the model has {len(missing)} tensor(s) the checkpoint lacks: {_names(missing)}")
    if unexpected:
        problems.append(f"the checkpoint has {len(unexpected)} tensor(s) this model lacks: {_names(unexpected)}")
    changed = [f"{name} {_shape(saved[name])} in the checkpoint, {_shape(value)} here"
               for name, value in now.items() if name in saved and _shape(saved[name]) != _shape(value)]
    if changed:
        problems.append(f"{len(changed)} tensor(s) differ in shape: {_names(changed, '; ')}")
    return problems


def _optimizer_differences(saved: dict[str, Any], optimizer: Any, saved_class: str | None) -> list[str]:
    name = type(optimizer).__name__
    if saved_class is not None and saved_class != name:
        return [f"the checkpoint's optimizer is {saved_class}, this run's is {name}"]
    saved_groups, groups = saved.get("param_groups", []), optimizer.param_groups
    if saved_class is None and saved_groups and groups:
        theirs, ours = _hyperparameter_keys(saved_groups[0]), _hyperparameter_keys(groups[0])
        if theirs != ours:
            return [(f"the checkpoint's optimizer has the hyperparameters {sorted(theirs - ours)} that this run's "
                     f"{name} lacks, and lacks {sorted(ours - theirs)}: another optimizer class")]
    if len(saved_groups) != len(groups):
        return [f"the checkpoint's {name} has {len(saved_groups)} parameter group(s), this run's {len(groups)}"]
    sizes = [(index, len(theirs["params"]), len(ours["params"])) for index, (theirs, ours)
             in enumerate(zip(saved_groups, groups)) if len(theirs["params"]) != len(ours["params"])]
    return [f"the optimizer's parameter group {index} holds {theirs} parameter(s) in the checkpoint, {ours} here"
            for index, theirs, ours in sizes]


def changed_hyperparameters(saved: dict[str, Any], optimizer: Any) -> list[str]:
    """The hyperparameters where the checkpoint's groups differ from the optimizer's as built, as
    "group G name: checkpoint X, constructor Y". A group under an LR scheduler is compared by its
    `initial_lr` (its `lr` moves with the schedule)."""
    changed = []
    for index, (theirs, ours) in enumerate(zip(saved.get("param_groups", []), optimizer.param_groups)):
        keys = [key for key in ours if key in theirs and key not in IMPLEMENTATION_KEYS]
        if "initial_lr" in ours:
            keys.remove("lr")
        changed += [f"group {index} {key}: {_plain(theirs[key])} in the checkpoint, {_plain(ours[key])} in the "
                    "constructor" for key in keys if not _same(theirs[key], ours[key])]
    return changed


def _hyperparameter_keys(group: dict[str, Any]) -> set[str]:
    return {key for key in group if key not in IMPLEMENTATION_KEYS and key != "initial_lr"}


def _shape(value: Any) -> tuple[int, ...] | None:
    return tuple(value.shape) if hasattr(value, "shape") else None


def _plain(value: Any) -> Any:
    return value.item() if isinstance(value, torch.Tensor) and value.numel() == 1 else value


def _same(a: Any, b: Any) -> bool:
    a, b = _plain(a), _plain(b)
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    try:
        return bool(a == b)
    except (RuntimeError, ValueError):  # a tensor of several values: compared as values
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)


def _names(names: Iterable[str], separator: str = ", ") -> str:
    # The first _SHOWN, then "..." where there are more.
    names = list(names)
    return separator.join(names[:_SHOWN]) + (f"{separator}..." if len(names) > _SHOWN else "")


def check_resumable(state: dict[str, Any], weights: dict[str, Any], optimizer: Any) -> list[str]:
    """Refuse (`CheckpointMismatch`) a migrated checkpoint `state` that this model (`weights`, its
    state dict as checkpoints save it) and `optimizer` cannot continue; returns the hyperparameters
    the checkpoint changes (`changed_hyperparameters`), to be said once it is loaded."""
    core = state["core"]
    problems = mismatch(core["model"], weights, core["optimizer"], optimizer, core["optimizer_class"])
    if problems:
        raise CheckpointMismatch("the checkpoint was made by another model or optimizer, not resuming it: "
                                 + "; ".join(problems))
    return changed_hyperparameters(core["optimizer"], optimizer) if optimizer is not None and core["optimizer"] else []


def reliefs_checked(state: dict[str, Any], restore_reliefs: Callable[[], None],
                    now: Callable[[], tuple[dict[str, Any], Any]]) -> None:
    """`check_resumable` around `restore_reliefs()`: before it (nothing is changed by a refusal),
    or after it where the checkpoint has reliefs (they change the model's names and shapes); the
    hyperparameters the checkpoint changes said (`say_changed`). `now()`: the model's weights as
    checkpoints save them, and the optimizer (pruning remaps it in place)."""
    if state["tuning"]["reliefs"]["applied"]:
        restore_reliefs()
        say_changed(check_resumable(state, *now()))
        return
    changed = check_resumable(state, *now())
    restore_reliefs()
    say_changed(changed)


def say_changed(changed: list[str]) -> None:
    """The warning for hyperparameters a resume took from the checkpoint over the constructor's."""
    if changed:
        warn(f"resumed with the checkpoint's optimizer hyperparameters where this run's constructor differs "
             f"({'; '.join(changed)}): a resumed run goes on as it was. To change one, set it in "
             "optimizer.param_groups after the resume (an on_fit_start callback)")
