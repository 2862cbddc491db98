"""The only code that changes training state in response to an action.

Policies propose; `apply` carries an action out on the trainer's `Knobs` and says what
happened, so the journal can record it. Add a new action by adding its record to
actions.py and one `@apply.register` function here.
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from autotune.actions import (CacheSamples, CheckpointActivations, EmptyCache, PruneChannels, Relief, SetLoaderWorkers,
                              SetMicroBatch, UseAutocast)
from autotune.memory import device_sample, free_cpu_caches, free_memory
from autotune.units import format_bytes


@dataclasses.dataclass
class Knobs:
    """The settings of a run that actions may change."""

    batch_size: int  # samples per optimizer step (the loader's batch)
    micro_batch_size: int  # samples per forward/backward
    device: torch.device
    memory_cap_bytes: int | None = None
    num_workers: int = 0  # DataLoader worker processes
    sample_cache: CacheSamples | None = None  # the cache asked for, once asked
    # Bumped by every change to the two above; the trainer rebuilds its loader at the next
    # batch boundary when it differs from the version its loader was built for.
    loader_version: int = 0
    # A memory relief to carry out before the next attempt (the trainer does it: it changes the
    # model or the forward). One per trigger, so each rung's effect is seen before the next.
    relief: Relief | None = None


@dataclasses.dataclass(frozen=True)
class Outcome:
    """What applying an action did: `applied` False means it was suppressed, `note` says why."""

    applied: bool
    note: str = ""


@functools.singledispatch
def apply(action: object, knobs: Knobs) -> Outcome:
    """Carry out `action` on `knobs`."""
    raise TypeError(f"no knob applies actions of type {type(action).__name__}")


@apply.register
def _set_micro_batch(action: SetMicroBatch, knobs: Knobs) -> Outcome:
    size = min(max(1, int(action.size)), knobs.batch_size)
    if size == knobs.micro_batch_size:
        return Outcome(False, f"micro-batch is already {size}")
    old, knobs.micro_batch_size = knobs.micro_batch_size, size
    if knobs.device.type == "cpu":
        free_cpu_caches()  # MKL's buffers sized for the old micro-batch would stay mapped beside the new ones
    return Outcome(True, f"micro-batch {old} -> {size}")


@apply.register
def _empty_cache(action: EmptyCache, knobs: Knobs) -> Outcome:
    before = device_sample(knobs.device, knobs.memory_cap_bytes).used_bytes
    free_memory(knobs.device)
    after = device_sample(knobs.device, knobs.memory_cap_bytes).used_bytes
    if before is None or after is None:
        return Outcome(True, "freed cached memory (amount not measurable here)")
    return Outcome(True, f"returned {format_bytes(before - after)}")


@apply.register
def _cache_samples(action: CacheSamples, knobs: Knobs) -> Outcome:
    if knobs.sample_cache is not None:
        return Outcome(False, "samples are already cached")
    knobs.sample_cache = action
    knobs.loader_version += 1
    return Outcome(True, "sample cache on from the next batch")


@apply.register
def _set_loader_workers(action: SetLoaderWorkers, knobs: Knobs) -> Outcome:
    workers = max(0, int(action.num_workers))
    if workers == knobs.num_workers:
        return Outcome(False, f"already {workers} loader workers")
    old, knobs.num_workers = knobs.num_workers, workers
    knobs.loader_version += 1
    return Outcome(True, f"loader workers {old} -> {workers} from the next batch")


@apply.register(UseAutocast)
@apply.register(CheckpointActivations)
@apply.register(PruneChannels)
def _relief(action: Relief, knobs: Knobs) -> Outcome:
    if knobs.relief is not None:
        return Outcome(False, f"one relief at a time: {type(knobs.relief).__name__} goes first")
    knobs.relief = action
    return Outcome(True, "carried out before the next attempt")
