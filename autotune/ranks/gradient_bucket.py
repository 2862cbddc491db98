"""The flat gradient buffers a replicated job all-reduces: every gradient a view into one buffer a
(dtype, device), so averaging is one in-place all-reduce a buffer, and a batch's item count and
the ranks' news ride in the same collective (whole_model.Replicated.reduce_with_news).

Owns: the buffers and the parameters' `.grad` views into them. Touches: the parameters' `.grad`.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch
import torch.distributed as dist


class GradientBucket:
    """All gradients as views of flat buffers, one per (dtype, device) of the parameters (bf16
    weights beside fp32 norms make two), so averaging them is one in-place all-reduce a buffer
    with no copies. Gradients are zeroed in place (never set to None) to keep the views."""

    def __init__(self, parameters: Iterable[torch.nn.Parameter]):
        self.params = [p for p in parameters if p.requires_grad]
        groups: dict[tuple[torch.dtype, torch.device], list[torch.nn.Parameter]] = {}
        for p in self.params:
            groups.setdefault((p.dtype, p.device), []).append(p)
        # A batch's item count and the ranks' news (whole_model.Replicated.reduce_with_news) ride in the
        # same all-reduce as the gradients: two slots more in the first buffer wide enough to count
        # exactly (fp32 and up); else a buffer of their own.
        counter = next((key for key in groups if key[0] in (torch.float32, torch.float64)), None)
        self.groups = [(params, torch.zeros(sum(p.numel() for p in params) + 2 * (key == counter), dtype=key[0],
                                            device=key[1]))
                       for key, params in groups.items()]
        if counter is None:
            device = self.params[0].device if self.params else torch.device("cpu")
            self.groups.append(([], torch.zeros(2, dtype=torch.float64, device=device)))
            counter_at = len(self.groups) - 1
        else:
            counter_at = list(groups).index(counter)
        self.count, self.news = self.groups[counter_at][1][-2:-1], self.groups[counter_at][1][-1:]
        self._zeroed: list[int] | None = None  # the buffers' versions when `zero` last ran
        self.bind()

    def bind(self) -> None:
        """Point every parameter's .grad at its slice of its buffer (again, if something reset it)."""
        for params, flat in self.groups:
            offset = 0
            for p in params:
                view = flat[offset:offset + p.numel()].view_as(p)
                if p.grad is not view:
                    if p.grad is not None:
                        view.copy_(p.grad)
                    else:  # no gradient this step (an optimizer's zero_grad set it to None): not the last step's
                        view.zero_()
                    p.grad = view
                offset += p.numel()

    def _gradients(self) -> list[torch.Tensor]:
        # Each buffer's gradient slots (the count slot left out).
        return [flat[:sum(p.numel() for p in params)] for params, flat in self.groups if params]

    def average(self, world: int, news: bool | None = None) -> bool | None:
        """The gradients summed over ranks and divided by `world`; with `news`, whether any rank had
        some (summed in the same all-reduce)."""
        self.bind()
        if news is not None:
            self.news.fill_(int(news))
        for params, flat in self.groups:
            # A buffer that only counts has nothing to average, unless the news rides in it. With
            # news, every buffer, as sum_over_items does: a rank whose attempt failed before its
            # first micro-batch (no items) must make the same collectives as the others.
            if params or news is not None:
                dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        told = None if news is None else bool(self.news.item())
        for params, flat in self.groups:
            if params:
                flat /= world
        return told

    def sum_over_items(self, ref: Any, items: Any, news: bool | None = None) -> bool | None:
        """The gradients (weighted `ref`) summed over ranks and divided by every rank's `items`;
        with `news`, whether any rank had some (summed in the same all-reduce)."""
        self.bind()
        grads = self._gradients()
        for grad in grads:
            grad.mul_(ref)
        if isinstance(items, torch.Tensor):
            self.count.copy_(items.reshape(1))
        else:
            self.count.fill_(items)
        self.news.fill_(int(bool(news)))
        for _, flat in self.groups:
            dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        count = self.count.clamp_min(1)
        for grad in grads:
            grad.div_(count.to(grad.device))
        return None if news is None else bool(self.news.item())

    def zero(self) -> None:
        for _, flat in self.groups:
            flat.zero_()
        self.bind()
        self._zeroed = [flat._version for _, flat in self.groups]

    def untouched(self) -> bool:
        """Whether the gradients are still the zeros `zero` left, in the buffers: nothing wrote into
        them since (a view's in-place change counts in its buffer's version) and nothing replaced
        a parameter's `.grad`. A step then has no gradients of the caller's to hold back."""
        if self._zeroed != [flat._version for _, flat in self.groups]:
            return False
        for params, flat in self.groups:
            offset = 0
            for p in params:
                grad = p.grad
                if grad is None or grad._base is not flat or grad.storage_offset() != offset:
                    return False
                offset += p.numel()
        return True
