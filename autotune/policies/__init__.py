"""Built-in policies, one file each; each file's docstring is its method card.

Owns the built-in policies. A policy owns its own state (saved in checkpoints) and touches nothing: it
reads a `Snapshot` and returns actions, which `autotune.decisions.knobs` carries out. May import
`decisions` and `common`; the presets (`autotune.tuning.presets`) import it.
"""

from __future__ import annotations

from autotune.policies.autocast_near_cap import AutocastNearCap
from autotune.policies.cache_when_io_bound import CacheWhenIOBound
from autotune.policies.checkpoint_near_cap import CheckpointNearCap
from autotune.policies.empty_cache_on_pressure import EmptyCacheOnPressure
from autotune.policies.fit_micro_batch import FitMicroBatch
from autotune.policies.grow_back import GrowBack
from autotune.policies.halve_on_oom import HalveOnOOM
from autotune.policies.prune_near_cap import PruneNearCap
from autotune.policies.shrink_on_thrash import ShrinkOnThrash
from autotune.policies.tune_workers import TuneWorkers

BUILTIN_POLICIES: dict[str, type] = {
    cls.name: cls for cls in (HalveOnOOM, EmptyCacheOnPressure, ShrinkOnThrash, FitMicroBatch, GrowBack, CacheWhenIOBound, TuneWorkers,
                              AutocastNearCap, CheckpointNearCap, PruneNearCap)
}

__all__ = ["BUILTIN_POLICIES", "AutocastNearCap", "CacheWhenIOBound", "CheckpointNearCap", "EmptyCacheOnPressure",
           "FitMicroBatch", "GrowBack", "HalveOnOOM", "PruneNearCap", "ShrinkOnThrash", "TuneWorkers"]
