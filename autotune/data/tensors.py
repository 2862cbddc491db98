"""A dataset of tensors already in memory, fetched a batch at a time.

A `TensorDataset` is the common shape of small and benchmark data: every sample is a row of
tensors that are already in memory. The DataLoader fetches such a batch one `__getitem__` per
sample and stacks the rows (~480 us for 128 rows of 784 floats here), where one gather per
tensor (`tensor[indices]`) makes the same batch in a tenth of that. On a fast step the
difference is the share of time a loop waits on its data: enough to look input-bound, and to
start a loader-worker trial that cannot win (a worker makes the same gather and sends the batch
back through shared memory).

`batched_view` gives the loader autotune builds that gather, for a `TensorDataset` (or a `Subset`
of one) with the default collate: the batch has the values, dtype and shape `default_collate`
gives (a list, one tensor per field). A custom `collate_fn` sees samples as before.

Owns: the view and its pass-through collate. Touches the dataset's tensors only to index them.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import Dataset, Subset, TensorDataset


class _GatheredTensors(Dataset):
    """A TensorDataset's tensors; `__getitems__` returns the whole batch, one tensor per field
    (what `default_collate` makes of its rows), for `take_batch` to pass on."""

    def __init__(self, dataset: TensorDataset):
        self.tensors = dataset.tensors

    def __len__(self) -> int:
        return len(self.tensors[0])

    def __getitem__(self, index: int) -> tuple[torch.Tensor, ...]:
        return tuple(tensor[index] for tensor in self.tensors)

    def __getitems__(self, indices: list[int]) -> list[torch.Tensor]:
        rows = torch.as_tensor(indices, dtype=torch.long)
        return [tensor[rows] for tensor in self.tensors]


def take_batch(batch: list[torch.Tensor]) -> list[torch.Tensor]:
    """The collate of a batched view: the gather is the batch already."""
    return batch


def batched_view(dataset: Any) -> Dataset | None:
    """`dataset` fetched a batch at a time, where it is a TensorDataset (through Subsets); else None."""
    if isinstance(dataset, TensorDataset):
        return _GatheredTensors(dataset)
    if isinstance(dataset, Subset):
        inner = batched_view(dataset.dataset)
        return None if inner is None else Subset(inner, dataset.indices)
    return None
