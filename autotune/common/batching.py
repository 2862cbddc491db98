"""Split a batch into micro-batches by sample, and count what a batch holds.

What each part of a batch is, read the same way for counting and for splitting:

- a tensor or numpy array: samples along its first dimension (slices are views: no copy);
- a mapping (dict, `UserDict`, Hugging Face `BatchEncoding`, ...) or a namedtuple: fields,
  each split the same way; the result keeps the mapping's type;
- a list or tuple of plain values (strings, numbers): one value per sample;
- any other list or tuple is a *sequence of fields* when every item holds the batch's
  number of samples (`(inputs, targets)`, `[input_ids, attention_mask]`), and otherwise a
  *sequence of samples*, one item each, when it has that many items and its items are
  alike (the same type; tensors of one dtype and rank): torchvision's detection collate
  `tuple(zip(*batch))` gives a tuple of images of different sizes and a tuple of per-image
  target dicts. The batch's number of samples comes from the parts that read only one way;
  where both readings fit, a sequence is read as fields.
- `PerSample([...])` and `Fields((...))` say which one a sequence is where the data cannot
  (a tuple of 3 same-size images in a batch of 3 reads as fields otherwise).

Anything else needs a user `split_fn(batch, size) -> list of micro-batches`.

Owns: splitting batches and counting samples. Touches nothing (the data is read, not changed).
"""

from __future__ import annotations

import collections
from collections.abc import Mapping
from typing import Any, Callable, Iterator

import torch

SplitFn = Callable[[Any, int], "list[Any]"]

_PLAIN = (str, bytes, int, float, bool, type(None))


class PerSample(list):
    """A list whose items are one sample each: split by item, never read as fields.

    `collate_fn=lambda b: tuple(PerSample(part) for part in zip(*b))` marks a detection batch.
    """


class Fields(tuple):
    """A tuple whose items are fields, each holding every sample of the batch in its first
    dimension: split item by item, never read as a sequence of samples."""


def _is_value_list(obj: Any) -> bool:
    return isinstance(obj, (list, tuple)) and len(obj) > 0 and all(isinstance(x, _PLAIN) for x in obj)


def _sliceable(obj: Any) -> bool:
    return isinstance(obj, torch.Tensor) or type(obj).__module__ == "numpy" and hasattr(obj, "shape")


def is_namedtuple(obj: Any) -> bool:
    return isinstance(obj, tuple) and hasattr(obj, "_fields")


def _alike(items: Any) -> bool:
    """Whether a sequence's items could be samples of one dataset."""
    first = items[0]
    if not all(type(x) is type(first) for x in items):
        return False
    if _sliceable(first):
        return all(x.ndim == first.ndim and x.dtype == first.dtype for x in items)
    if isinstance(first, Mapping):
        return all(x.keys() == first.keys() for x in items)
    return True


def _counts(obj: Any, path: str) -> set[int]:
    """Every sample count `obj` can be read as (one for most parts; two for a sequence that
    reads both as fields and as samples). Raises naming the part that cannot be counted."""
    if _sliceable(obj):
        if obj.ndim == 0:
            raise ValueError(f"{path} is a 0-d tensor: it has no sample dimension to split")
        return {obj.shape[0]}
    if isinstance(obj, PerSample) or _is_value_list(obj):
        return {len(obj)}
    if isinstance(obj, Mapping):
        return _agreed({f"{path}[{k!r}]": v for k, v in obj.items()}, path, strict=True)
    if isinstance(obj, Fields) or is_namedtuple(obj):
        return _agreed({f"{path}[{i}]": v for i, v in enumerate(obj)}, path, strict=True)
    if isinstance(obj, (list, tuple)):
        if not obj:
            raise ValueError(f"{path} is an empty {type(obj).__name__}: it has no samples to split")
        fields = _agreed({f"{path}[{i}]": v for i, v in enumerate(obj)}, path, strict=False)
        return fields | ({len(obj)} if _alike(obj) else set()) if fields else _as_samples(obj, path)
    if isinstance(obj, _PLAIN):
        raise TypeError(f"{path} is a single {type(obj).__name__}, not one value per sample; pass split_fn=")
    if hasattr(obj, "__len__"):  # a user type that split_fn knows how to split
        return {len(obj)}
    raise TypeError(f"cannot split {path} of type {type(obj).__name__} into micro-batches; pass split_fn=")


def _as_samples(obj: list | tuple, path: str) -> set[int]:
    if not _alike(obj):
        counts = {}
        for i, v in enumerate(obj):
            try:
                counts[f"{path}[{i}]"] = sorted(_counts(v, f"{path}[{i}]"))
            except (TypeError, ValueError) as exc:
                counts[f"{path}[{i}]"] = str(exc)
        raise ValueError(f"batch parts disagree on the number of samples: {counts}; mark per-sample "
                         "sequences with autotune.PerSample or pass split_fn=")
    return {len(obj)}


def _agreed(parts: dict[str, Any], path: str, strict: bool) -> set[int]:
    """The counts every part can be read as. `strict`: an empty answer is an error."""
    common: set[int] | None = None
    seen: dict[str, list[int]] = {}
    for name, value in parts.items():
        try:
            counts = _counts(value, name)
        except (TypeError, ValueError):
            if strict:
                raise
            return set()
        seen[name] = sorted(counts)
        common = counts if common is None else common & counts
    if not common and strict:
        raise ValueError(f"batch parts disagree on the number of samples: {seen}")
    return common or set()


def batch_len(batch: Any) -> int:
    """Number of samples in `batch`. Raises TypeError naming what it could not measure,
    ValueError when parts of the batch disagree."""
    n = _plain_len(batch)
    if n is not None:
        return n
    counts = _counts(batch, "batch")
    if len(counts) == 1:
        return next(iter(counts))
    # A sequence that reads both ways, at the top: fields, as `(inputs, targets)` is.
    fields = _agreed({f"batch[{i}]": v for i, v in enumerate(batch)}, "batch", strict=False)
    if len(fields) == 1:
        return next(iter(fields))
    raise ValueError(f"cannot tell the number of samples in this batch (it reads as any of {sorted(counts)}); "
                     "mark its parts with autotune.PerSample / autotune.Fields or pass split_fn=")


def _plain_len(batch: Any) -> int | None:
    """The count of the common batches, `(inputs, targets)` and `{name: tensor}`, at once (this runs
    every step); None for anything that needs the full reading."""
    parts = batch.values() if type(batch) is dict else batch if type(batch) in (tuple, list) else None
    if not parts:
        return None
    n = None
    for part in parts:
        if type(part) is not torch.Tensor or not part.ndim:
            return None
        m = part.shape[0]  # its first dimension (len() goes through Tensor.__len__'s Python checks)
        if n is not None and m != n:
            return None
        n = m
    # A tuple as long as its tensors' first dimension could also be read as samples: the full reading decides.
    return n if type(batch) is dict or n != len(batch) else None


def _rebuild_mapping(original: Mapping, items: dict) -> Any:
    """A mapping of `original`'s type holding `items` (HF BatchEncoding, UserDict, defaultdict...)."""
    kind = type(original)
    if kind is dict:
        return items
    if isinstance(original, collections.defaultdict):
        return kind(original.default_factory, items)
    try:
        return kind(items)
    except TypeError as exc:
        raise TypeError(f"cannot rebuild a {kind.__name__} from its split parts ({exc}); pass split_fn=") from None


def map_tensors(fn: Callable[[torch.Tensor], Any], obj: Any) -> Any:
    """`obj` with `fn` applied to every tensor in it (tuples, namedtuples, lists, mappings
    nested any way, each keeping its type); everything else as it is."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, Mapping):
        return _rebuild_mapping(obj, {k: map_tensors(fn, v) for k, v in obj.items()})
    if is_namedtuple(obj):
        return type(obj)(*(map_tensors(fn, v) for v in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(map_tensors(fn, v) for v in obj)
    return obj


def slice_batch(batch: Any, start: int, stop: int, n: int | None = None) -> Any:
    """Samples `start:stop` of `batch` (of `n` samples: counted if not given), keeping its structure."""
    n = batch_len(batch) if n is None else n
    return _slice(batch, start, stop, n)


def _slice(part: Any, start: int, stop: int, n: int) -> Any:
    if _sliceable(part) or _is_value_list(part) or isinstance(part, PerSample):
        return part[start:stop] if not isinstance(part, PerSample) else PerSample(part[start:stop])
    if isinstance(part, Mapping):
        return _rebuild_mapping(part, {k: _slice(v, start, stop, n) for k, v in part.items()})
    if is_namedtuple(part):
        return type(part)(*(_slice(v, start, stop, n) for v in part))
    if isinstance(part, Fields):
        return Fields(_slice(v, start, stop, n) for v in part)
    if isinstance(part, (list, tuple)):
        if _reads_as_fields(part, n):
            return type(part)(_slice(v, start, stop, n) for v in part)
        return part[start:stop]  # one item per sample
    raise TypeError(f"cannot split a batch part of type {type(part).__name__} into micro-batches; pass split_fn=")


def _reads_as_fields(part: list | tuple, n: int) -> bool:
    for item in part:
        try:
            if n not in _counts(item, "item"):
                return False
        except (TypeError, ValueError):
            return False
    return True


def micro_batches(batch: Any, size: int, start: int = 0, split_fn: SplitFn | None = None,
                  total: int | None = None) -> Iterator[tuple[Any, int]]:
    """Yield `(micro_batch, n_samples)` covering samples `start:` of `batch` (`total` samples:
    counted if not given), `size` at a time, except that no micro-batch is left with one sample
    where three or more were asked for: the last `size + 1` are split in two (65 at 32: 32, 17, 16).
    BatchNorm in training refuses a batch of one sample ("Expected more than 1 value per channel"),
    where the plain loop's batch of 65 ran. With `split_fn`, the user's function splits the
    remaining samples instead.
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
    total = batch_len(batch) if total is None else total
    if start == 0 and size >= total:
        yield batch, total  # the whole batch: as it came, nothing rebuilt
        return
    lo = start
    while lo < total:
        hi = min(lo + size, total)
        if size > 2 and total - hi == 1:  # the next one would be a single sample (at 2, an odd batch must have one)
            hi = lo + (total - lo + 1) // 2
        yield _slice(batch, lo, hi, total), hi - lo
        lo = hi


def check_splittable(batch: Any, split_fn: SplitFn | None = None) -> int:
    """Validate that `batch` can be split (before training starts) and return its length."""
    n = batch_len(batch)
    if split_fn is None and n > 1:
        slice_batch(batch, 0, 1, n)
    return n


def tensor_bytes(tensors: Any) -> int:
    """Bytes of the tensors in a (nested) structure: parameters, an optimizer's state, a checkpoint."""
    if isinstance(tensors, torch.Tensor):
        return tensors.numel() * tensors.element_size()
    if isinstance(tensors, dict):
        return sum(tensor_bytes(v) for v in tensors.values())
    if isinstance(tensors, (list, tuple)):
        return sum(tensor_bytes(v) for v in tensors)
    return 0
