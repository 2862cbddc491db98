"""autotune: keep PyTorch training alive and fast under memory limits.

    from autotune import AutoTrainer
    result = AutoTrainer(model, dataset, loss_fn=nn.functional.cross_entropy).fit(epochs=1)

The library logs through loguru but stays quiet unless asked: `logger.enable("autotune")`
(the `autotune` command line does this).
"""

from loguru import logger

from autotune.actions import Action, EmptyCache, SetMicroBatch
from autotune.events import Event
from autotune.oom import OutOfMemory, is_oom
from autotune.policy import Policy
from autotune.snapshot import AllocatorStats, DeviceSample, Snapshot, StepTiming
from autotune.trainer import AutoTrainer, FitResult

logger.disable("autotune")

__version__ = "0.1.0"

__all__ = [
    "Action", "AllocatorStats", "AutoTrainer", "DeviceSample", "EmptyCache", "Event", "FitResult",
    "OutOfMemory", "Policy", "SetMicroBatch", "Snapshot", "StepTiming", "is_oom",
]
