"""A sampler whose order is a pure function of (seed, epoch), so a run can be repeated,
compared and later resumed in the middle of an epoch."""

from __future__ import annotations

from typing import Iterator

import torch
from torch.utils.data import Sampler


class EpochSampler(Sampler[int]):
    """Indices `0..n-1`, shuffled by `seed + epoch` when `shuffle`, starting at position `start`."""

    def __init__(self, n: int, shuffle: bool = True, seed: int = 0):
        self.n = n
        self.shuffle = shuffle
        self.seed = seed
        self.epoch = 0
        self.start = 0

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        """Select the epoch's order, and skip its first `start` positions (already trained)."""
        self.epoch = epoch
        self.start = start

    def order(self) -> list[int]:
        """The full order of the current epoch."""
        if not self.shuffle:
            return list(range(self.n))
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        return torch.randperm(self.n, generator=generator).tolist()

    def __iter__(self) -> Iterator[int]:
        return iter(self.order()[self.start:])

    def __len__(self) -> int:
        return self.n - self.start
