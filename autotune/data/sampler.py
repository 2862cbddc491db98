"""A sampler whose order is a pure function of (seed, epoch), so a run can be repeated,
compared and later resumed in the middle of an epoch, on as many ranks as before or not.

Owns the order. Touches nothing.
"""

from __future__ import annotations

from typing import Iterator

import torch
from torch.utils.data import Sampler


def epoch_order(n: int, shuffle: bool, seed: int, epoch: int, padded_for: int) -> list[int]:
    """The whole job's order of one epoch: a permutation of `0..n-1` drawn from `seed + epoch`
    alone (so every world size draws the same), padded by repeating its start to a multiple of
    `padded_for` ranks, as DistributedSampler does, so every rank has as many batches."""
    if shuffle:
        order = torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch)).tolist()
    else:
        order = list(range(n))
    if padded_for > 1:
        padded = -(-n // padded_for) * padded_for
        order = (order * (padded // n + 1))[:padded]
    return order


class EpochSampler(Sampler[int]):
    """Indices `0..n-1`, shuffled by `seed + epoch` when `shuffle`, starting at position `start`.

    Under torchrun each of `world` ranks takes every world-th index of the epoch's order (see
    `epoch_order`), so the ranks' batches k together are the job's positions
    [k * global batch, (k + 1) * global batch): one global batch, whatever the world size.

    A resume on another number of ranks (`set_epoch(..., padded_for=)`) goes on in the order of
    the world the epoch began with: its padding, and the job's position `start * world` in it.
    Where the epoch's last global batch then has fewer samples than there are ranks, the order is
    padded again by repeating its start, so that every rank has a sample in it (the one case where
    a sample is trained twice in an epoch; `extra` says how many).
    """

    def __init__(self, n: int, shuffle: bool = True, seed: int = 0, rank: int = 0, world: int = 1,
                 batch_size: int | None = None):
        self.n = n
        self.batch_size = batch_size  # each rank's, to find the epoch's last global batch
        self.shuffle = shuffle
        self.seed = seed
        self.rank = rank
        self.world = world
        self.epoch = 0
        self.start = 0
        self.padded_for = world

    def set_epoch(self, epoch: int, start: int = 0, padded_for: int | None = None) -> None:
        """Select the epoch's order, and skip this rank's first `start` positions (already
        trained); `padded_for`: the world size the epoch began with (default: this one)."""
        self.epoch = epoch
        self.start = start
        self.padded_for = padded_for or self.world

    def job_order(self) -> list[int]:
        """The whole job's order for the current epoch (every rank's, interleaved)."""
        order = epoch_order(self.n, self.shuffle, self.seed, self.epoch, self.padded_for)
        return order + order[:self.extra(len(order))]

    def extra(self, length: int) -> int:
        """Samples repeated so that each of this world's ranks has one in the epoch's last
        global batch (`length`: the epoch's order's): 0 unless this world is not the one the
        epoch began with and that batch has fewer samples than there are ranks."""
        if self.padded_for == self.world or self.batch_size is None:
            return 0
        left = length - self.start * self.world
        last = left % (self.batch_size * self.world) or self.batch_size * self.world
        return self.world - last if 0 < left and last < self.world else 0

    def order(self) -> list[int]:
        """This rank's full order for the current epoch."""
        order = self.job_order()
        return order[self.rank::self.world]  # alone: all of it

    def __iter__(self) -> Iterator[int]:
        return iter(self.order()[self.start:])

    def __len__(self) -> int:
        if self.padded_for == self.world:
            return -(-self.n // self.world) - self.start
        return len(self.order()) - self.start
