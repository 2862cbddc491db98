"""Built-in policies, one file each; each file's docstring is its method card."""

from __future__ import annotations

from autotune.policies.halve_on_oom import HalveOnOOM

BUILTIN_POLICIES: dict[str, type] = {cls.name: cls for cls in (HalveOnOOM,)}

__all__ = ["BUILTIN_POLICIES", "HalveOnOOM"]
