"""What a policy can ask for. Actions are plain frozen records; `knobs.py` carries them out.

Every action has a `reason`, written to the journal whether the action is applied or
suppressed, so a user can always tell why the run changed.

Owns the actions' shapes and their journal names. Touches nothing.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Union


@dataclasses.dataclass(frozen=True)
class SetMicroBatch:
    """Run forward/backward on `size` samples at a time (the same batch is retried on OOM)."""

    size: int
    reason: str = ""


@dataclasses.dataclass(frozen=True)
class EmptyCache:
    """Return cached, unused memory: `gc.collect()` and `torch.cuda.empty_cache()` on CUDA."""

    reason: str = ""


@dataclasses.dataclass(frozen=True)
class CacheSamples:
    """Cache decoded samples (before random transforms) in shared memory, from the next batch on.

    The budget is the tightest of `max_bytes`, `available_fraction` of MemAvailable, free
    /dev/shm, and half the room under the host memory cap.
    """

    max_bytes: int | None = None
    available_fraction: float = 0.5
    reason: str = ""


@dataclasses.dataclass(frozen=True)
class SetLoaderWorkers:
    """Load data in `num_workers` worker processes, from the next batch on (same sample order)."""

    num_workers: int
    reason: str = ""


@dataclasses.dataclass(frozen=True)
class UseAutocast:
    """Run forward passes under autocast (bf16, or fp16 with a gradient scaler), from the next attempt on."""

    reason: str = ""


@dataclasses.dataclass(frozen=True)
class CheckpointActivations:
    """Checkpoint the model's repeated blocks: recompute their activations in backward."""

    reason: str = ""


@dataclasses.dataclass(frozen=True)
class PruneChannels:
    """Remove `ratio` of the channels of every prunable layer but the output layers (Torch-Pruning);
    the same optimizer keeps its state for the kept channels. A checkpoint is written first."""

    ratio: float
    reason: str = ""


Relief = Union[UseAutocast, CheckpointActivations, PruneChannels]
"""A memory relief, one rung of the ladder: bf16 autocast, activation checkpointing, pruning."""
Action = Union[SetMicroBatch, EmptyCache, CacheSamples, SetLoaderWorkers, Relief]
"""What a policy's `decide` may return: a frozen dataclass saying what to change and why
(`reason`); knobs.py carries it out at the next safe point and journals it."""
RELIEF_NAMES = {UseAutocast: "autocast", CheckpointActivations: "checkpointing", PruneChannels: "pruning"}
_LADDER = tuple(RELIEF_NAMES)  # cheapest in accuracy first


def relief_to_ints(action: Relief | None) -> list[int]:
    """A relief as [code, ratio in millionths] ([0, 0] for none): what travels between ranks
    in an integer all-reduce under torchrun."""
    if action is None:
        return [0, 0]
    ratio = round(action.ratio * 1e6) if isinstance(action, PruneChannels) else 0
    return [_LADDER.index(type(action)) + 1, ratio]


def relief_from_ints(code: int, ratio: int, reason: str) -> Relief | None:
    """The relief `relief_to_ints` encoded (None for code 0), with `reason`."""
    if not code:
        return None
    kind = _LADDER[code - 1]
    return kind(ratio=ratio / 1e6, reason=reason) if kind is PruneChannels else kind(reason=reason)


def action_kind(action: Action) -> str:
    """The journal name of an action: its class name in snake_case (`SetMicroBatch` -> `set_micro_batch`)."""
    return re.sub(r"(?<!^)(?=[A-Z])", "_", type(action).__name__).lower()


def action_params(action: Action) -> dict[str, Any]:
    """The action's fields except `reason`, for the journal."""
    return {f.name: getattr(action, f.name) for f in dataclasses.fields(action) if f.name != "reason"}
