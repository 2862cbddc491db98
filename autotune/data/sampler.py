"""A sampler whose order is a pure function of (seed, epoch), so a run can be repeated,
compared and later resumed in the middle of an epoch.

Owns the order. Touches nothing.
"""

from __future__ import annotations

from typing import Iterator

import torch
from torch.utils.data import Sampler


class EpochSampler(Sampler[int]):
    """Indices `0..n-1`, shuffled by `seed + epoch` when `shuffle`, starting at position `start`.

    Under torchrun each of `world` ranks takes every world-th index of the epoch's order,
    the order padded (by repeating its start) to a multiple of `world` as DistributedSampler
    does, so every rank has the same number of batches.
    """

    def __init__(self, n: int, shuffle: bool = True, seed: int = 0, rank: int = 0, world: int = 1):
        self.n = n
        self.shuffle = shuffle
        self.seed = seed
        self.rank = rank
        self.world = world
        self.epoch = 0
        self.start = 0

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        """Select the epoch's order, and skip its first `start` positions (already trained)."""
        self.epoch = epoch
        self.start = start

    def order(self) -> list[int]:
        """This rank's full order for the current epoch."""
        if self.shuffle:
            generator = torch.Generator().manual_seed(self.seed + self.epoch)
            order = torch.randperm(self.n, generator=generator).tolist()
        else:
            order = list(range(self.n))
        if self.world > 1:
            padded = -(-self.n // self.world) * self.world
            order = (order * (padded // self.n + 1))[:padded]
            order = order[self.rank::self.world]
        return order

    def __iter__(self) -> Iterator[int]:
        return iter(self.order()[self.start:])

    def __len__(self) -> int:
        per_rank = -(-self.n // self.world)
        return per_rank - self.start
