"""Built-in policies, one file each; each file's docstring is its method card."""

from __future__ import annotations

from autotune.policies.empty_cache_on_pressure import EmptyCacheOnPressure
from autotune.policies.grow_back import GrowBack
from autotune.policies.halve_on_oom import HalveOnOOM
from autotune.policies.shrink_on_thrash import ShrinkOnThrash

BUILTIN_POLICIES: dict[str, type] = {
    cls.name: cls for cls in (HalveOnOOM, EmptyCacheOnPressure, ShrinkOnThrash, GrowBack)
}

__all__ = ["BUILTIN_POLICIES", "EmptyCacheOnPressure", "GrowBack", "HalveOnOOM", "ShrinkOnThrash"]
