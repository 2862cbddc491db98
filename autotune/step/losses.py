"""A batch's losses: what a step function returned, checked, and the kept micro-batches' losses
with their weights (and the outputs a step function hands back), combined only when read; an
epoch's sum on the device.

A micro-batch's loss is its mean over its samples (or the items the step function reports:
tokens, say); `Losses` keeps each with its weight and sums them when asked, so a batch in one
piece costs no tensor op, and `LossSum` folds an epoch's batches a few ops at a time.

Owns: the loss records. Touches nothing: the step core (step/core.py) fills them, the batch runner and
the trainer read them.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from autotune.common.batching import is_namedtuple, map_tensors


@dataclasses.dataclass(frozen=True, slots=True)
class StepResult:
    """What a step function may return instead of a bare loss: the micro-batch's mean `loss`, the
    `n_items` it is a mean over (tokens, say; None: its samples, as `(loss, n_items)` says), and the
    `outputs` your loop wants back (logits for an accuracy): detached, and joined across the batch's
    micro-batches in sample order (`Tuner.outputs`, `AutoTrainer.outputs`)."""

    loss: torch.Tensor
    n_items: int | torch.Tensor | None = None
    outputs: Any = None


def read_step(out: Any, source: str = "step_fn") -> tuple[torch.Tensor, Any, Any]:
    """A step's result as `(mean loss, n_items or None, outputs or None)` (see `loss_and_items`)."""
    if isinstance(out, torch.Tensor):  # most steps: a loss, already a 0-d tensor
        return (out if not out.ndim else _scalar(out, source)), None, None
    loss, items = loss_and_items(out, source)
    outputs = out.outputs if isinstance(out, StepResult) else None
    return loss, items, None if outputs is None else map_tensors(torch.Tensor.detach, outputs)


def join_outputs(parts: list[Any]) -> Any:
    """The micro-batches' outputs as the batch's, in sample order: tensors joined along their first
    dimension, tuples, lists and mappings leaf by leaf; anything else, a list of one per micro-batch."""
    if not parts:
        return None
    first = parts[0]
    if len(parts) == 1:
        return first
    if isinstance(first, torch.Tensor):
        return torch.cat(parts) if first.ndim else list(parts)
    if isinstance(first, dict):
        return {key: join_outputs([part[key] for part in parts]) for key in first}
    if is_namedtuple(first):
        return type(first)(*(join_outputs(list(leaves)) for leaves in zip(*parts)))
    if isinstance(first, (tuple, list)):
        return type(first)(join_outputs(list(leaves)) for leaves in zip(*parts))
    return list(parts)


def loss_and_items(out: Any, source: str = "step_fn") -> tuple[torch.Tensor, Any]:
    """A step's result (a loss, `(loss, n_items)` or a `StepResult`) as `(mean loss, n_items or
    None)`; a clear error naming `source` (the function the user passed: "loss_fn" or "step_fn")
    for anything else."""
    if isinstance(out, torch.Tensor):  # most steps: a loss, already a 0-d tensor
        return (out if not out.ndim else _scalar(out, source)), None
    if isinstance(out, StepResult):  # its outputs are the training step's to keep (`read_step`)
        out, source = (out.loss if out.n_items is None else (out.loss, out.n_items)), "step_fn"
        if isinstance(out, torch.Tensor):
            return _scalar(out, source), None
    if source == "step_fn" and isinstance(out, tuple) and len(out) == 2 and isinstance(out[0], torch.Tensor):
        items = out[1]
        if isinstance(items, bool) or not isinstance(items, (int, torch.Tensor)):
            raise TypeError(f"step_fn returned (loss, {type(items).__name__}): n_items must be an int or a "
                            "0-d tensor (the number of items the loss is the mean over)")
        return _scalar(out[0], source), items
    what = "a loss tensor or (loss, n_items)" if source == "step_fn" else "a loss tensor"
    raise TypeError(f"{source} must return {what}, got {type(out).__name__}"
                    + (": return the tensor, not .item()" if isinstance(out, (float, int)) else ""))


def _scalar(loss: torch.Tensor, source: str) -> torch.Tensor:
    if loss.ndim != 0:
        raise ValueError(f"{source} returned a loss of shape {tuple(loss.shape)}: it must be a 0-d tensor, the mean "
                         "over the micro-batch (reduction='mean', or .mean() it)")
    return loss


def is_zero(weight: Any) -> bool:
    """Whether a loss weight (samples or items) is a plain zero."""
    # Only a plain count can be told zero without reading the device; a tensor never is (items >= 1 by then).
    return not isinstance(weight, torch.Tensor) and weight == 0


@dataclasses.dataclass(slots=True)
class Losses:
    """The mean losses of a batch's kept micro-batches with their weights (samples, or items),
    combined only when read: a tiny model's step pays for every tensor op, and a batch in one
    piece needs none (its mean is its one micro-batch's loss)."""

    parts: list[tuple[torch.Tensor, Any]] = dataclasses.field(default_factory=list)  # (mean loss, weight)
    additive: bool = False  # the parts add up to the batch's loss as they are (a trainer's own scaling)
    outputs: list[Any] = dataclasses.field(default_factory=list)  # the step function's, by kept micro-batch

    @property
    def weight(self) -> Any:
        """What the sum is over: samples or items (an int or a tensor); 1 for additive parts; 0: none kept."""
        if self.additive:
            return 1 if self.parts else 0
        total: Any = 0
        for _, weight in self.parts:
            total = total + weight
        return total

    def total(self, device: torch.device) -> torch.Tensor:
        """The summed (not mean) loss over `weight`; a zero on `device` when nothing was kept."""
        total: torch.Tensor | None = None
        for loss, weight in self.parts:
            term = loss if self.additive else loss * weight
            total = term if total is None else total + term
        return total if total is not None else torch.zeros((), device=device)

    def mean(self, device: torch.device) -> torch.Tensor:
        """The batch's mean loss (0-d, on the device)."""
        if len(self.parts) == 1:
            return self.parts[0][0]
        weight = self.weight
        total = self.total(device)
        return total if is_zero(weight) else total / weight


class LossSum:
    """An epoch's summed loss over its weight, on the device: batches' parts are gathered and folded
    every `fold_every` of them, a few ops for the lot instead of one or two a batch."""

    def __init__(self, device: torch.device, fold_every: int = 32):
        self.device, self.fold_every = device, fold_every
        self.total = torch.zeros((), device=device)
        self.weight: Any = 0  # samples, or items where the step reports them
        self._pending: list[tuple[torch.Tensor, Any]] = []  # (loss, weight it is multiplied by)

    def add(self, losses: Losses) -> None:
        """A batch's losses (kept by reference until the next fold)."""
        self._pending += [(loss, 1) for loss, _ in losses.parts] if losses.additive else losses.parts
        self.weight = self.weight + losses.weight
        if len(self._pending) >= self.fold_every:
            self._fold()

    def mean(self) -> float | None:
        """The epoch's mean loss so far (read off the device: a synchronisation); None before any weight."""
        self._fold()
        return None if is_zero(self.weight) else float(self.total / self.weight)

    def _fold(self) -> None:
        if not self._pending:
            return
        by_count: dict[int, list[torch.Tensor]] = {}  # plain weights: most batches share one (the batch size)
        weighted: list[torch.Tensor] = []
        for loss, weight in self._pending:
            if isinstance(weight, torch.Tensor):
                weighted.append(loss * weight)
            else:
                by_count.setdefault(weight, []).append(loss)
        for count, values in by_count.items():
            self.total += torch.stack(values).sum() * count
        if weighted:
            self.total += torch.stack(weighted).sum()
        self._pending.clear()
