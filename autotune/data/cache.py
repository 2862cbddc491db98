"""A cache of decoded samples in shared memory, and the split of a dataset around it.

Caching is only right for the part of a sample that is the same every epoch: the file
read and the decode. Random augmentation must run after the lookup, or every epoch would
see the first epoch's crops. `split_for_caching` finds that boundary:

- a torchvision `VisionDataset`: a shallow copy without `transform`, `target_transform`
  and `transforms` is the cached part; those transforms run after each lookup;
- a dataset that defines `load(index)` and `augment(sample)`: `load` is cached;
- a dataset with `cacheable = True`: its whole output is deterministic and cached;
- anything else is not cached (a random output is never cached silently).

`SampleCache` is one region in /dev/shm shared by the main process and every DataLoader
worker: created before the workers start, inherited (fork) or reopened by name (spawn),
so its memory does not grow with the worker count. Samples are pickled: PIL images keep
their raw pixels (uint8 for RGB), numpy arrays and tensors their raw buffers, out of band. Filling
stops at the byte budget; the rest of the dataset is read as before (partial caching).

Its space is reserved before it is written (shared_memory.reserve), `GROW_BYTES` at a time as it
fills: a page of a sparse tmpfs file that /dev/shm cannot back would be SIGBUS at the write. A
full /dev/shm at creation is an OSError (`NoRoom`: the pipeline then caches nothing, with a word);
one that fills up later stops the filling there, said once on stderr (`stats()["no_room"]`), and
what is cached stays served.

Owns: the shared-memory region in /dev/shm (made, mapped, removed) and its counters. Touches the
dataset only to read samples through it.
"""

from __future__ import annotations

import copy
import dataclasses
import io
import mmap
import multiprocessing
import os
import pickle
import secrets
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch
from torch.utils.data import Dataset, Subset

from autotune.common.notices import warn
from autotune.common.shared_memory import NoRoom, no_room, reserve
from autotune.common.snapshot import InputProfile
from autotune.common.stale import create_claimed, remove_stale_shared_memory, shared_memory_dir
from autotune.common.units import format_bytes

_HEADER = 8  # int64 slots: [bytes used, full, hits, misses, entries, bytes reserved, no room, spare]
_USED, _FULL, _HITS, _MISSES, _ENTRIES, _RESERVED, _NO_ROOM = range(7)
# The data's space is reserved this much at a time: few reservations (each one under the lock, ~0.1 ms
# a MiB on tmpfs), and at most this much of /dev/shm held beyond what the samples fill.
GROW_BYTES = 1 << 20


class NotCacheable(Exception):
    """The dataset does not say which part of a sample is safe to cache; the message says how to."""


@dataclasses.dataclass
class CacheSplit:
    """`raw[i]` is the deterministic part of sample i; `after(raw[i])` is the sample."""

    raw: Dataset
    after: Callable[[Any], Any] | None
    how: str  # for the journal: which rule split it


class VisionTransforms:
    """The transforms of a torchvision dataset, applied after the cache as its `__getitem__` would."""

    def __init__(self, transform: Callable | None, target_transform: Callable | None, joint: Callable | None):
        self.transform, self.target_transform, self.joint = transform, target_transform, joint

    def __call__(self, sample: Any) -> Any:
        image, target = sample
        if self.joint is not None:
            return self.joint(image, target)
        if self.transform is not None:
            image = self.transform(image)
        if self.target_transform is not None:
            target = self.target_transform(target)
        return image, target


class _Loaded(Dataset):
    """The `load(index)` half of a dataset that splits load and augment."""

    def __init__(self, dataset: Any):
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> Any:
        return self.dataset.load(index)


def split_for_caching(dataset: Any) -> CacheSplit:
    """Split `dataset` into a cacheable part and what runs after it; raises NotCacheable."""
    if isinstance(dataset, Subset):
        inner = split_for_caching(dataset.dataset)
        return CacheSplit(Subset(inner.raw, dataset.indices), inner.after, f"subset of {inner.how}")
    if callable(getattr(dataset, "load", None)) and callable(getattr(dataset, "augment", None)):
        return CacheSplit(_Loaded(dataset), dataset.augment, "load(index) cached, augment(sample) after")
    if getattr(dataset, "cacheable", False) is True:
        return CacheSplit(dataset, None, "cacheable = True: whole samples cached")
    # A torchvision dataset was made by a process that imported torchvision: looked up, never imported
    # here (importing it maps ~38 MiB of libraries, counted by an address-space cap: issue 34).
    vision = sys.modules.get("torchvision.datasets.vision")
    VisionDataset = getattr(vision, "VisionDataset", ())
    StandardTransform = getattr(vision, "StandardTransform", ())
    if VisionDataset and isinstance(dataset, VisionDataset):
        transform = getattr(dataset, "transform", None)
        target_transform = getattr(dataset, "target_transform", None)
        joint = getattr(dataset, "transforms", None)
        if isinstance(joint, StandardTransform):
            joint = None  # built from transform/target_transform: apply those, as ImageFolder does
        raw = copy.copy(dataset)
        for name in ("transform", "target_transform", "transforms"):
            if hasattr(raw, name):
                setattr(raw, name, None)
        after = None if transform is None and target_transform is None and joint is None \
            else VisionTransforms(transform, target_transform, joint)
        return CacheSplit(raw, after, f"torchvision {type(dataset).__name__}: decoded samples cached, "
                                      "transforms after")
    raise NotCacheable(
        f"{type(dataset).__name__} does not say what is safe to cache: set `cacheable = True` on it if "
        "__getitem__ is deterministic, or define load(index) (cached) and augment(sample) (run after)")


def cache_budget(max_bytes: int | None = None, available_fraction: float = 0.5,
                 room_bytes: int | None = None, shm_dir: str | None = None) -> tuple[int, str]:
    """The bytes the cache may fill, and which limit set it.

    The tightest of: `max_bytes` (the user's), `available_fraction` of MemAvailable,
    90% of what is free in the shared-memory directory, and half of `room_bytes` (what is
    left under the host memory cap), so the cache never makes the host swap or the run
    hit its own cap.
    """
    import psutil

    limits: dict[str, int] = {"MemAvailable x %.2f" % available_fraction:
                              int(psutil.virtual_memory().available * available_fraction)}
    if max_bytes is not None:
        limits["max_bytes"] = int(max_bytes)
    directory = shm_dir or _shm_dir()
    limits[f"free in {directory} x 0.9"] = int(shutil.disk_usage(directory).free * 0.9)
    if room_bytes is not None:
        limits["room under the memory cap x 0.5"] = max(0, int(room_bytes) // 2)
    which = min(limits, key=limits.__getitem__)
    return limits[which], which


def _shm_dir() -> str:
    return str(shared_memory_dir())


# Big buffers (pixels, array and tensor data) go out of band (pickle protocol 5): an entry is
# [header: pickle length, buffer count, buffer lengths][pickle][buffers]. A lookup rebuilds
# each one with a single copy out of the shared region, with no intermediate bytes object
# (which would cost a copy and leave the worker's heap fragmented).
def _array_from_buffer(buffer: Any, dtype: str, shape: tuple[int, ...]) -> np.ndarray:
    return np.frombuffer(buffer, dtype=dtype).reshape(shape).copy()


def _tensor_from_buffer(buffer: Any, dtype: str, shape: tuple[int, ...]) -> torch.Tensor:
    return torch.from_numpy(_array_from_buffer(buffer, dtype, shape))


def _image_from_buffer(buffer: Any, mode: str, size: tuple[int, int]) -> Any:
    from PIL import Image

    return Image.frombytes(mode, size, buffer)


class _Pickler(pickle.Pickler):
    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            # Plain CPU tensors numpy can hold; torch's own pickling (through torch.save) is ~15x slower.
            if (type(obj) is torch.Tensor and obj.device.type == "cpu" and not obj.requires_grad
                    and obj.layout is torch.strided and obj.dtype is not torch.bfloat16 and not obj.is_complex()):
                array = obj.detach().contiguous().numpy()
                return _tensor_from_buffer, (pickle.PickleBuffer(array), array.dtype.str, array.shape)
            return NotImplemented
        if isinstance(obj, np.ndarray) and obj.dtype.kind in "biufc":
            array = np.ascontiguousarray(obj)
            return _array_from_buffer, (pickle.PickleBuffer(array), array.dtype.str, array.shape)
        if type(obj).__module__.startswith("PIL.") and hasattr(obj, "tobytes") and hasattr(obj, "mode"):
            if getattr(obj, "palette", None) is None and obj.mode in ("1", "L", "RGB", "RGBA", "CMYK", "YCbCr",
                                                                       "LAB", "HSV", "I", "F", "LA", "I;16"):
                return _image_from_buffer, (pickle.PickleBuffer(obj.tobytes()), obj.mode, obj.size)
        return NotImplemented


def _encode(sample: Any) -> list[Any]:
    """The parts of an entry, header first: [header, pickle, buffer, buffer, ...]."""
    out = io.BytesIO()
    buffers: list[pickle.PickleBuffer] = []
    _Pickler(out, protocol=5, buffer_callback=buffers.append).dump(sample)
    raws = [b.raw() for b in buffers]
    header = np.array([out.tell(), len(raws), *(r.nbytes for r in raws)], dtype=np.int64).tobytes()
    return [header, out.getbuffer(), *raws]


def _decode(view: memoryview) -> Any:
    size, count = (int(v) for v in np.frombuffer(view[:16], dtype=np.int64))
    lengths = np.frombuffer(view[16:16 + 8 * count], dtype=np.int64).tolist()
    start = 16 + 8 * count
    data = view[start:start + size]
    start += size
    buffers = []
    for length in lengths:
        buffers.append(view[start:start + length])
        start += length
    return pickle.loads(data, buffers=buffers)


class SampleCache:
    """Decoded samples by index, in one shared-memory region every process of the run maps.

    Layout: a header of counters, an (n, 2) int64 table of (offset, length) per index
    (length 0 = not cached), then the data, filled front to back. A lock shared with the
    workers guards the table and the fill pointer; the bytes are copied outside it.
    """

    def __init__(self, n: int, budget_bytes: int, directory: str | None = None, context: str | None = None):
        if n < 1:
            raise ValueError(f"a sample cache needs at least one index, got {n}")
        self.n = n
        self.budget = max(0, int(budget_bytes))
        self._data_start = (_HEADER + 2 * n) * 8
        folder = Path(directory or _shm_dir())
        remove_stale_shared_memory(folder)  # what killed runs left
        self.path = folder / f"autotune-cache-{os.getpid()}-{secrets.token_hex(4)}"
        # The lock must come from the start method the workers use (a fork lock cannot be
        # reopened by a spawned worker); the DataLoader's default is multiprocessing's default.
        # It is a POSIX semaphore, a page of /dev/shm itself: taken before the region's pages.
        try:
            self._lock = multiprocessing.get_context(context).Lock()
        except OSError as exc:
            kind = NoRoom if no_room(exc) else OSError
            raise kind(exc.errno, f"the cache's lock (a POSIX semaphore, in /dev/shm) could not be made: "
                                  f"{exc.strerror}") from exc
        self._owner = os.getpid()
        self._claim, fd = create_claimed(self.path)  # held while it lives: no sweep, in any PID namespace, removes it
        reserved = min(self.budget, GROW_BYTES)
        try:
            try:
                # Sparse beyond what is reserved: the data's pages are taken as it fills (`_grow`).
                os.ftruncate(fd, self._data_start + self.budget)
                reserve(fd, 0, self._data_start + reserved, self.path)  # no room: an error here, not SIGBUS later
            finally:
                os.close(fd)
            self._map()
        except BaseException:
            self.path.unlink(missing_ok=True)  # a cache that could not be made leaves no file
            self._claim.release()
            raise
        self._counts[_RESERVED] = reserved

    def _map(self) -> None:
        with open(self.path, "r+b") as f:
            self._mm = mmap.mmap(f.fileno(), self._data_start + self.budget)
        self._counts = np.frombuffer(self._mm, dtype=np.int64, count=_HEADER)
        self._table = np.frombuffer(self._mm, dtype=np.int64, count=2 * self.n, offset=_HEADER * 8).reshape(self.n, 2)
        self._view = memoryview(self._mm)

    # A spawned worker reopens the region by path; a forked one inherits the mapping.
    def __getstate__(self) -> dict[str, Any]:
        return {"n": self.n, "budget": self.budget, "data_start": self._data_start, "path": self.path,
                "lock": self._lock, "owner": self._owner}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.n, self.budget, self._data_start = state["n"], state["budget"], state["data_start"]
        self.path, self._lock, self._owner = state["path"], state["lock"], state["owner"]
        self._map()

    def get(self, index: int) -> Any | None:
        """The cached sample at `index`, or None (counted as a hit or a miss)."""
        with self._lock:
            offset, length = self._table[index]
            self._counts[_HITS if length else _MISSES] += 1
        if not length:
            return None
        start = self._data_start + int(offset)
        return _decode(self._view[start:start + int(length)])

    def put(self, index: int, sample: Any) -> bool:
        """Store `sample` at `index`; False when the budget is full (the sample is not stored)."""
        if self._counts[_FULL]:
            return False
        parts = _encode(sample)
        length = sum(memoryview(part).nbytes for part in parts)
        with self._lock:
            if self._table[index, 1] or self._counts[_FULL]:
                return bool(self._table[index, 1])
            offset = int(self._counts[_USED])
            if offset + length > self.budget or (offset + length > self._counts[_RESERVED]
                                                 and not self._grow(offset + length)):
                self._counts[_FULL] = 1
                return False
            self._counts[_USED] = offset + length
        start = self._data_start + offset
        for part in parts:
            part = memoryview(part).cast("B")
            self._view[start:start + part.nbytes] = part
            start += part.nbytes
        with self._lock:  # published only once the bytes are in place
            self._table[index] = (offset, length)
            self._counts[_ENTRIES] += 1
        return True

    def _grow(self, needed: int) -> bool:
        """Under the lock: reserve the data's space up to at least `needed` bytes (False, said once
        in whichever process met it, when /dev/shm has no room: the filling stops there)."""
        reserved = int(self._counts[_RESERVED])
        target = min(self.budget, max(needed, reserved + GROW_BYTES))
        try:
            fd = os.open(self.path, os.O_RDWR)
            try:
                reserve(fd, self._data_start + reserved, target - reserved, self.path)
            finally:
                os.close(fd)
        except OSError as exc:
            self._counts[_NO_ROOM] = 1
            warn(f"the sample cache stops filling at {format_bytes(reserved)} of its {format_bytes(self.budget)} "
                 f"budget: no more of {self.path.parent} could be reserved ({exc.strerror or exc}); what is cached "
                 "is still served, the rest is read as before", key=f"sample cache no room {self.path}")
            return False
        self._counts[_RESERVED] = target
        return True

    def stats(self) -> dict[str, Any]:
        """Counters since the last `reset_counters`: hits, misses, entries, bytes, full, and
        no_room (the filling stopped short of the budget: /dev/shm had no room)."""
        with self._lock:
            used, full, hits, misses, entries, _reserved, no_room = (int(v) for v in self._counts[:7])
        return {"hits": hits, "misses": misses, "hit_rate": hits / (hits + misses) if hits + misses else None,
                "entries": entries, "samples": self.n, "bytes": used, "budget_bytes": self.budget, "full": bool(full),
                "no_room": bool(no_room)}

    def reset_counters(self) -> None:
        with self._lock:
            self._counts[_HITS] = self._counts[_MISSES] = 0

    def close(self) -> None:
        """Unmap, and remove the region if this process created it."""
        for name in ("_counts", "_table"):
            setattr(self, name, None)
        view, self._view = self._view, None
        if view is not None:
            view.release()
            self._mm.close()
        if os.getpid() == self._owner:
            self.path.unlink(missing_ok=True)
            self._claim.release()


class CachedDataset(Dataset):
    """`split.raw` through `cache`, then `split.after`: what the model sees does not change."""

    def __init__(self, split: CacheSplit, cache: SampleCache):
        self.raw, self.after, self.cache = split.raw, split.after, cache

    def __len__(self) -> int:
        return len(self.raw)

    def __getitem__(self, index: int) -> Any:
        sample = self.cache.get(index)
        if sample is None:
            sample = self.raw[index]
            self.cache.put(index, sample)
        return self.after(sample) if self.after is not None else sample


def profile_input(dataset: Any, samples: int = 16, seed: int = 0) -> InputProfile:
    """Time load/decode and the transforms separately on a few random samples (medians per
    sample: the first call of a decoder or a transform pays one-time set-up)."""
    try:
        split = split_for_caching(dataset)
    except NotCacheable as exc:
        return InputProfile(0.0, 0.0, 0, False, str(exc))
    generator = torch.Generator().manual_seed(seed)
    indices = torch.randperm(len(split.raw), generator=generator)[:samples].tolist()
    load, transform = [], []
    for index in indices:
        start = time.perf_counter()
        sample = split.raw[index]
        loaded = time.perf_counter()
        if split.after is not None:
            split.after(sample)
        load.append(loaded - start)
        transform.append(time.perf_counter() - loaded)
    return InputProfile(statistics.median(load), statistics.median(transform), len(indices), True, split.how)
