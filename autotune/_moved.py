"""Module paths from before the package had folders, still importable.

`import autotune.checkpoint` or `from autotune.oom import OutOfMemory` in a user's code (or a
preset's `use = "autotune.policy:..."`) finds the module at its new place: the same module object,
so classes, exceptions and `isinstance` checks are the ones the package itself uses. Two old
paths are packages now and cannot be aliases: `autotune.step` (the step's code is
`autotune.step.core`) and `autotune.memory` (`autotune.memory.figures`).

Owns the table of old paths. Touches `sys.meta_path` once, when `autotune` is imported.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
from types import ModuleType
from typing import Any

MOVED = {
    "events": "common.events", "actions": "common.actions", "snapshot": "common.snapshot", "oom": "common.oom",
    "notices": "common.notices", "units": "common.units", "files": "common.files", "validate": "common.validate",
    "progress": "common.progress", "batching": "common.batching", "stale": "common.stale",
    "shared_memory": "common.shared_memory",
    "records": "observe.records", "journal": "observe.journal", "tensorboard_log": "observe.tensorboard_log",
    "report": "observe.report", "report_plot": "observe.report_plot",
    "checkpoint": "run_folder.checkpoint", "checkpoint_files": "run_folder.checkpoint_files",
    "checkpoint_format": "run_folder.checkpoint_format", "checksums": "run_folder.checksums",
    "sharded_checkpoint": "run_folder.sharded_checkpoint", "run_lock": "run_folder.run_lock",
    "same_run": "run_folder.same_run", "rng": "run_folder.rng",
    "demand": "memory.demand", "breakdown": "memory.breakdown", "cadence": "memory.cadence",
    "memory_history": "memory.history", "limits": "memory.limits", "onednn": "memory.onednn",
    "kernel_room": "memory.kernel_room",
    "distributed": "ranks.distributed", "job": "ranks.job", "agreement": "ranks.agreement",
    "gradient_bucket": "ranks.gradient_bucket", "sharded": "ranks.sharded", "world_change": "ranks.world_change",
    "optimizer_step": "step.optimizer_step", "losses": "step.losses", "finite": "step.finite",
    "rewind": "step.rewind", "norm_stats": "step.norm_stats", "relief.autocast": "step.precision",
    "policy": "decisions.policy", "dispatch": "decisions.dispatch", "knobs": "decisions.knobs",
    "detectors": "decisions.detectors", "relief.trigger": "decisions.relief_trigger",
    "batch": "tuning.batch", "recovery": "tuning.recovery", "reactions": "tuning.reactions", "run": "tuning.run",
    "host_face": "tuning.host_face", "arguments": "tuning.arguments", "config": "tuning.config",
    "monitor.link": "tuning.monitor_link", "presets": "tuning.presets", "relief.ladder": "tuning.relief_ladder",
    "batch_in_hand": "training.batch_in_hand", "callbacks": "training.callbacks",
    "evaluation": "training.evaluation", "preemption": "stops.preemption", "stall": "stops.stall",
}


class _Alias(importlib.abc.Loader):
    """Loads an old path as the module at its new one (imported there, once)."""

    def __init__(self, target: str):
        self.target = target
        self._spec: importlib.machinery.ModuleSpec | None = None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        module = importlib.import_module(self.target)
        self._spec = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        # The import system set the module's __spec__ to the old name's: the module keeps its own.
        module.__spec__ = self._spec

    def get_code(self, fullname: str) -> Any:
        """The new module's code, for `python -m autotune.<old path>` (runpy runs it as __main__)."""
        spec = importlib.util.find_spec(self.target)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "get_code"):
            raise ImportError(f"{fullname} moved to {self.target}, which has no code to run", name=fullname)
        return spec.loader.get_code(self.target)


class OldPaths(importlib.abc.MetaPathFinder):
    """Finds `autotune.<old path>` for the modules that moved into folders."""

    def find_spec(self, fullname: str, path: object = None, target: object = None) -> importlib.machinery.ModuleSpec | None:
        if not fullname.startswith("autotune."):
            return None
        new = MOVED.get(fullname[len("autotune."):])
        if new is None:
            return None
        target = importlib.util.find_spec("autotune." + new)
        spec = importlib.machinery.ModuleSpec(fullname, _Alias("autotune." + new),
                                              origin=target.origin if target is not None else None)
        # Its file, for `python -m autotune.<old path>` (runpy's __file__); an import keeps the module's own.
        spec.has_location = target is not None and target.has_location
        return spec


def install() -> None:
    """Put the finder on `sys.meta_path` (once)."""
    if not any(isinstance(finder, OldPaths) for finder in sys.meta_path):
        sys.meta_path.insert(0, OldPaths())
