"""Split a batch into micro-batches along the first dimension.

Handles tensors, numpy arrays, tuples (named ones too), lists, dicts and any nesting of
them. A list or tuple of plain values (strings, numbers) is treated as one value per
sample and sliced like a tensor; default_collate produces exactly that for strings.
Anything else needs a user `split_fn(batch, size) -> list of micro-batches`.
Tensor slices are views: splitting copies no data.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator

import torch

SplitFn = Callable[[Any, int], "list[Any]"]

_PLAIN = (str, bytes, int, float, bool, type(None))


def _is_value_list(obj: Any) -> bool:
    return isinstance(obj, (list, tuple)) and len(obj) > 0 and all(isinstance(x, _PLAIN) for x in obj)


def _sliceable(obj: Any) -> bool:
    return isinstance(obj, torch.Tensor) or type(obj).__module__ == "numpy" and hasattr(obj, "shape")


def batch_len(batch: Any) -> int:
    """Number of samples in `batch`. Raises TypeError naming what it could not measure,
    ValueError when parts of the batch disagree."""
    lengths = set()
    _collect_lengths(batch, lengths, path="batch")
    if not lengths:
        raise TypeError(f"cannot tell the number of samples in a batch of type {type(batch).__name__}; pass split_fn=")
    if len(lengths) > 1:
        raise ValueError(f"batch parts disagree on the number of samples: {sorted(lengths)}")
    return lengths.pop()


def _collect_lengths(obj: Any, lengths: set[int], path: str) -> None:
    if _sliceable(obj):
        if obj.ndim == 0:
            raise ValueError(f"{path} is a 0-d tensor: it has no sample dimension to split")
        lengths.add(obj.shape[0])
    elif _is_value_list(obj):
        lengths.add(len(obj))
    elif isinstance(obj, dict):
        for key, value in obj.items():
            _collect_lengths(value, lengths, f"{path}[{key!r}]")
    elif isinstance(obj, (list, tuple)):
        for i, value in enumerate(obj):
            _collect_lengths(value, lengths, f"{path}[{i}]")
    elif isinstance(obj, _PLAIN):
        raise TypeError(f"{path} is a single {type(obj).__name__}, not one value per sample; pass split_fn=")
    elif hasattr(obj, "__len__"):  # a user type that split_fn knows how to split
        lengths.add(len(obj))
    else:
        raise TypeError(f"cannot split {path} of type {type(obj).__name__} into micro-batches; pass split_fn=")


def map_tensors(fn: Callable[[torch.Tensor], Any], obj: Any) -> Any:
    """`obj` with `fn` applied to every tensor in it (tuples, namedtuples, lists, dicts nested
    any way); everything else as it is."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, dict):
        return type(obj)((k, map_tensors(fn, v)) for k, v in obj.items())
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple
        return type(obj)(*(map_tensors(fn, v) for v in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(map_tensors(fn, v) for v in obj)
    return obj


def slice_batch(batch: Any, start: int, stop: int) -> Any:
    """Samples `start:stop` of `batch`, keeping its structure."""
    if _sliceable(batch) or _is_value_list(batch):
        return batch[start:stop]
    if isinstance(batch, dict):
        return type(batch)((key, slice_batch(value, start, stop)) for key, value in batch.items())
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # namedtuple
        return type(batch)(*(slice_batch(value, start, stop) for value in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(slice_batch(value, start, stop) for value in batch)
    raise TypeError(f"cannot split a batch part of type {type(batch).__name__} into micro-batches; pass split_fn=")


def micro_batches(batch: Any, size: int, start: int = 0, split_fn: SplitFn | None = None) -> Iterator[tuple[Any, int]]:
    """Yield `(micro_batch, n_samples)` covering samples `start:` of `batch`, `size` at a time.

    With `split_fn`, the user's function splits the remaining samples instead.
    """
    if size < 1:
        raise ValueError(f"micro-batch size must be >= 1, got {size}")
    if split_fn is not None:
        offset = 0
        for micro in split_fn(batch, size):
            n = batch_len(micro)
            if offset < start < offset + n:
                raise ValueError(f"split_fn's micro-batches of {size} do not line up with the {start} samples already done")
            if offset >= start:
                yield micro, n
            offset += n
        return
    total = batch_len(batch)
    for lo in range(start, total, size):
        hi = min(lo + size, total)
        yield slice_batch(batch, lo, hi), hi - lo


def check_splittable(batch: Any, split_fn: SplitFn | None = None) -> int:
    """Validate that `batch` can be split (before training starts) and return its length."""
    n = batch_len(batch)
    if split_fn is None and n > 1:
        slice_batch(batch, 0, 1)
    return n
