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

Owns the public names (`__all__`), imported on first use. Touches `sys.meta_path` (`_moved.py`: the
module paths from before the folders keep working).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from loguru import logger

from autotune import _moved

logger.disable("autotune")
_moved.install()  # `autotune.checkpoint`, `autotune.oom`, ...: the paths from before the folders

__version__ = "0.1.0"

_EXPORTS = {
    "Action": "autotune.common.actions", "EmptyCache": "autotune.common.actions", "SetMicroBatch": "autotune.common.actions",
    "CacheSamples": "autotune.common.actions", "SetLoaderWorkers": "autotune.common.actions",
    "Event": "autotune.common.events",
    "OutOfMemory": "autotune.common.oom", "ExchangeFailed": "autotune.common.oom", "is_oom": "autotune.common.oom",
    "NonFiniteStep": "autotune.common.oom", "TooManyNonFiniteSteps": "autotune.common.oom",
    "CheckpointFailed": "autotune.run_folder.checkpoint", "RunDirInUse": "autotune.run_folder.run_lock", "RunDirLost": "autotune.run_folder.run_lock",
    "AnotherRunsCheckpoints": "autotune.run_folder.same_run", "CheckpointMismatch": "autotune.run_folder.same_run",
    "Policy": "autotune.decisions.policy", "PolicyBase": "autotune.decisions.policy",
    "AllocatorStats": "autotune.common.snapshot", "DeviceSample": "autotune.common.snapshot", "Snapshot": "autotune.common.snapshot",
    "StepTiming": "autotune.common.snapshot", "InputState": "autotune.common.snapshot", "InputProfile": "autotune.common.snapshot",
    "AutoTrainer": "autotune.trainer", "Tuner": "autotune.tuner", "FitResult": "autotune.common.progress",
    "PerSample": "autotune.common.batching", "Fields": "autotune.common.batching", "StepResult": "autotune.step.losses",
    "set_verbosity": "autotune.common.notices",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    if name in _moved.MOVED:  # `autotune.oom` after `import autotune`, as before the folders
        return importlib.import_module(f"autotune.{name}")
    raise AttributeError(f"module 'autotune' has no attribute {name!r}")


if TYPE_CHECKING:
    from autotune.common.actions import Action, CacheSamples, EmptyCache, SetLoaderWorkers, SetMicroBatch
    from autotune.common.batching import Fields, PerSample
    from autotune.common.events import Event
    from autotune.common.notices import set_verbosity
    from autotune.common.oom import ExchangeFailed, NonFiniteStep, OutOfMemory, TooManyNonFiniteSteps, is_oom
    from autotune.common.progress import FitResult
    from autotune.common.snapshot import AllocatorStats, DeviceSample, InputProfile, InputState, Snapshot, StepTiming
    from autotune.decisions.policy import Policy, PolicyBase
    from autotune.run_folder.checkpoint import CheckpointFailed
    from autotune.run_folder.run_lock import RunDirInUse, RunDirLost
    from autotune.run_folder.same_run import AnotherRunsCheckpoints, CheckpointMismatch
    from autotune.step.losses import StepResult
    from autotune.trainer import AutoTrainer
    from autotune.tuner import Tuner
