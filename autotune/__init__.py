"""autotune: keep PyTorch training alive and fast under memory limits.

    from autotune import AutoTrainer
    result = AutoTrainer(model, dataset, loss_fn=nn.functional.cross_entropy).fit(epochs=1)

    from autotune import Tuner            # or keep your own loop
    with Tuner(model, optimizer) as tuner:
        for batch in loader:
            loss = tuner.step(batch, step_fn)

What a user must know (a preemption, an unsafe resume, a failed checkpoint, a non-finite
step, an OOM survived) reaches stderr by default, once per cause, rank 0 only;
`autotune.set_verbosity("error")` or AUTOTUNE_VERBOSITY=error keeps only errors (see
notices.py). Everything else goes through loguru and stays quiet unless asked:
`logger.enable("autotune")` (the `autotune` command line does this).

Names are imported on first use, so that `autotune.monitor` (run in the monitor process
and by `autotune monitor`) never imports torch.

Owns the public names (`__all__`), imported on first use. Touches nothing.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from loguru import logger

logger.disable("autotune")

__version__ = "0.1.0"

_EXPORTS = {
    "Action": "autotune.actions", "EmptyCache": "autotune.actions", "SetMicroBatch": "autotune.actions",
    "CacheSamples": "autotune.actions", "SetLoaderWorkers": "autotune.actions",
    "Event": "autotune.events",
    "OutOfMemory": "autotune.oom", "ExchangeFailed": "autotune.oom", "is_oom": "autotune.oom",
    "NonFiniteStep": "autotune.oom", "TooManyNonFiniteSteps": "autotune.oom",
    "CheckpointFailed": "autotune.checkpoint", "RunDirInUse": "autotune.run_lock", "RunDirLost": "autotune.run_lock",
    "AnotherRunsCheckpoints": "autotune.same_run", "CheckpointMismatch": "autotune.same_run",
    "Policy": "autotune.policy", "PolicyBase": "autotune.policy",
    "AllocatorStats": "autotune.snapshot", "DeviceSample": "autotune.snapshot", "Snapshot": "autotune.snapshot",
    "StepTiming": "autotune.snapshot", "InputState": "autotune.snapshot", "InputProfile": "autotune.snapshot",
    "AutoTrainer": "autotune.trainer", "Tuner": "autotune.tuner", "FitResult": "autotune.progress",
    "PerSample": "autotune.batching", "Fields": "autotune.batching", "StepResult": "autotune.losses",
    "set_verbosity": "autotune.notices",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'autotune' has no attribute {name!r}")


if TYPE_CHECKING:
    from autotune.actions import Action, CacheSamples, EmptyCache, SetLoaderWorkers, SetMicroBatch
    from autotune.batching import Fields, PerSample
    from autotune.checkpoint import CheckpointFailed
    from autotune.events import Event
    from autotune.losses import StepResult
    from autotune.notices import set_verbosity
    from autotune.oom import ExchangeFailed, NonFiniteStep, OutOfMemory, TooManyNonFiniteSteps, is_oom
    from autotune.policy import Policy, PolicyBase
    from autotune.snapshot import AllocatorStats, DeviceSample, InputProfile, InputState, Snapshot, StepTiming
    from autotune.progress import FitResult
    from autotune.run_lock import RunDirInUse, RunDirLost
    from autotune.same_run import AnotherRunsCheckpoints, CheckpointMismatch
    from autotune.trainer import AutoTrainer
    from autotune.tuner import Tuner
