"""BatchNorm's (and InstanceNorm's) running statistics under micro-batches: updated once per
optimizer batch, from the statistics of the whole batch, as a whole-batch forward would have
updated them.

    begin(split)   at an attempt's start, where the batch runs in several micro-batches: each
                   BatchNorm in training mode keeps its running statistics still (momentum 0 for
                   the attempt) and a hook takes its input's moments per channel (count, mean, M2)
    pause()        at the attempt's end, failed or not: hooks off, momentum back
    settle()       once every rank agreed the attempt fit: running mean and unbiased variance
                   moved by the module's momentum (None: the cumulative average) toward the whole
                   batch's, and `num_batches_tracked` + 1
    drop()         the attempt failed: the sums go (rewind.py puts the buffers back)

The moments are combined by Chan et al.'s parallel rule (counts, means, and M2, the sum of
squared deviations), never as E[x^2] - E[x]^2: a first-layer BatchNorm on raw features (a year, a
price, a sensor offset: mean 3000, std 0.05) would lose every digit of its variance to the
cancellation. Each micro-batch's mean and M2 are taken two-pass (`torch.var_mean`) of its input
less one shift per channel (the attempt's first sample's value), so every figure is of the size of
the spread, not of the offset, and float32 holds it to ~1e-7: no float64 copy of the activations
(twice their memory, under a cap; MPS has no float64) and no host sync. The shift is added back
once, at `settle`.

Normalisation inside a micro-batch still uses that micro-batch's own statistics: a numerics
change from a whole-batch forward, said once on stderr and in the journal (`numerics`).
`torch.nn.BatchNorm*d` (and its lazy forms) and InstanceNorm with running statistics follow this
rule (InstanceNorm's batch statistics are the mean over the batch's samples of each sample's mean
and unbiased variance, its momentum None means no update, and it counts no batches, as
`F.instance_norm` does); SyncBatchNorm, whose forward is a collective, is refused under torchrun
where an attempt may fail on one rank (its name in the error).

Owns: the sums and the momenta it set aside. Touches: the BatchNorm modules' momentum (during an
attempt) and running buffers (in `settle`), hooks on them while an attempt runs. Used by
step/core.py only: `begin` and `pause` around an attempt, `settle` from its `Attempt.commit` (which
says the numerics change) and `drop` from its `Attempt.roll_back`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm, _NormBase
from torch.nn.modules.instancenorm import _InstanceNorm


@dataclasses.dataclass
class Moments:
    """One BatchNorm's input over the micro-batches so far, per channel: `count` values each, their
    `mean` less `shift` and their `m2` (the sum of squared deviations from that mean)."""

    count: int
    shift: torch.Tensor
    mean: torch.Tensor
    m2: torch.Tensor

    def add(self, count: int, mean: torch.Tensor, m2: torch.Tensor) -> None:
        """Another micro-batch's moments (about the same shift), by Chan et al.'s pairwise rule."""
        total = self.count + count
        delta = mean - self.mean
        self.mean.add_(delta, alpha=count / total)
        self.m2.add_(m2).add_(delta * delta, alpha=self.count * count / total)
        self.count = total


class BatchNormStats:
    """The whole batch's statistics for each training BatchNorm (see the module docstring)."""

    def __init__(self, model: nn.Module):
        self.model = model
        self._modules: list[_NormBase] | None = None  # walked once (`forget` after a relief)
        self._hooks: list[Any] = []
        self._momenta: list[float | None] = []
        # id(module) -> its Moments (BatchNorm), or [count, sum of the samples' means, sum of their variances]
        self._sums: dict[int, Any] = {}
        self._tracked: list[torch.Tensor] = []  # num_batches_tracked before the attempt
        self.active: list[_NormBase] = []

    def modules(self) -> list[_NormBase]:
        """The model's BatchNorm and InstanceNorm modules that keep running statistics."""
        if self._modules is None:
            self._modules = [m for m in self.model.modules() if isinstance(m, (_BatchNorm, _InstanceNorm))
                             and m.track_running_stats and m.running_mean is not None]
        return self._modules

    def begin(self, split: bool) -> None:
        """At an attempt's start: `split`, the batch runs in several micro-batches."""
        self._sums.clear()
        self.active = [m for m in self.modules() if m.training] if split else []
        if not self.active:
            return
        self._momenta = [m.momentum for m in self.active]
        self._tracked = [m.num_batches_tracked.clone() for m in self.active]
        for module in self.active:
            module.momentum = 0.0  # its running statistics stay as they are during the attempt
            hook = self._sum_instances if isinstance(module, _InstanceNorm) else self._sum_input
            self._hooks.append(module.register_forward_pre_hook(hook))

    def _sum_input(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        x = args[0].detach()
        if x.dtype not in (torch.float32, torch.float64):
            x = x.float()  # half precision (autocast) holds too few digits for the moments
        count = x.numel() // x.shape[1]
        moments = self._sums.get(id(module))
        # One value per channel from the attempt's first sample, subtracted from every micro-batch's
        # input: what is left is of the size of the spread, where float32 keeps its digits.
        shift = x[(0, slice(None)) + (0,) * (x.ndim - 2)].clone() if moments is None else moments.shift
        variance, mean = torch.var_mean(x - shift.view(-1, *(1,) * (x.ndim - 2)), [0, *range(2, x.ndim)],
                                        correction=0)
        if moments is None:
            self._sums[id(module)] = Moments(count, shift, mean, variance * count)
        else:
            moments.add(count, mean, variance * count)

    def _sum_instances(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        # Per sample: its mean and unbiased variance over its positions, summed over the samples.
        x = args[0].detach().float()
        if x.dim() == module._get_no_batch_dim():
            x = x.unsqueeze(0)
        positions = x.flatten(2)
        count = torch.tensor(float(positions.shape[0]), device=x.device)
        self._add(module, [count, positions.mean(2).sum(0), positions.var(2).sum(0)])

    def _add(self, module: nn.Module, figures: list[torch.Tensor]) -> None:  # InstanceNorm's sums
        sums = self._sums.get(id(module))
        if sums is None:
            self._sums[id(module)] = figures
        else:
            for total, value in zip(sums, figures):
                total.add_(value)

    def pause(self) -> None:
        """At an attempt's end, failed or not: the hooks off and each module's momentum back."""
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        for module, momentum in zip(self.active, self._momenta):
            module.momentum = momentum

    @torch.no_grad()
    def settle(self) -> None:
        """The attempt fit: each module's running statistics moved toward the whole batch's."""
        for module, momentum, tracked in zip(self.active, self._momenta, self._tracked):
            sums = self._sums.get(id(module))
            if sums is None:
                continue  # a module the forward did not reach
            if isinstance(module, _InstanceNorm):  # the samples' own means and variances, averaged
                count, total, squares = sums
                mean, variance = total / count, squares / count
                if not momentum:
                    continue  # F.instance_norm updates nothing with momentum None, and counts no batches
                factor = momentum
            else:
                mean = sums.mean + sums.shift
                variance = sums.m2 / max(sums.count - 1, 1)  # unbiased, as BatchNorm keeps it
                module.num_batches_tracked.copy_(tracked + 1)
                factor = momentum if momentum is not None else 1.0 / float(module.num_batches_tracked)
            module.running_mean.mul_(1 - factor).add_(mean.to(module.running_mean.dtype), alpha=factor)
            module.running_var.mul_(1 - factor).add_(variance.to(module.running_var.dtype), alpha=factor)
        self.drop()

    def drop(self) -> None:
        """The attempt failed (or is settled): its sums go."""
        self._sums.clear()
        self.active = []

    def forget(self) -> None:
        """A relief changed the model's modules: walked again."""
        self._modules = None
