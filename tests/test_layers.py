"""The layout holds: folders in one direction (the import-linter contracts in pyproject.toml), a short
top level, the public names where they were, and the module paths from before the folders still
importable."""

import ast
import importlib
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import autotune
from autotune import _moved

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "autotune"

# Every name `from autotune import X` gave before the folders (issue 57), and since.
PUBLIC = ["Action", "AllocatorStats", "AnotherRunsCheckpoints", "AutoTrainer", "CacheSamples", "CheckpointFailed",
          "CheckpointMismatch", "DeviceSample", "EmptyCache", "Event", "ExchangeFailed", "Fields", "FitResult",
          "InputProfile", "InputState", "NonFiniteStep", "OutOfMemory", "PerSample", "Policy", "PolicyBase",
          "RunDirInUse", "RunDirLost", "SetLoaderWorkers", "SetMicroBatch", "Snapshot", "StepResult", "StepTiming",
          "TooManyNonFiniteSteps", "Tuner", "is_oom", "set_verbosity"]


def lint_imports(cwd: Path, pythonpath: Path) -> subprocess.CompletedProcess:
    code = ("import sys\nfrom importlinter.cli import lint_imports\n"
            "sys.exit(lint_imports(config_filename='pyproject.toml', no_cache=True))\n")
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=120,
                          env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(pythonpath)})


def test_the_folders_import_only_downwards_and_the_monitor_never_imports_torch():
    done = lint_imports(ROOT, ROOT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert "Contracts: 2 kept, 0 broken" in done.stdout, done.stdout[-2000:]


def test_an_upward_import_or_torch_in_the_monitor_breaks_the_contracts(tmp_path):
    # The contracts can fail: a copy of the package where the bottom layer imports the Tuner, and the
    # monitor process's host figures import torch.
    shutil.copytree(PACKAGE, tmp_path / "autotune", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    with open(tmp_path / "autotune" / "common" / "units.py", "a") as units:
        units.write("\n\ndef _upward():\n    from autotune.tuner import Tuner  # noqa: F401\n")
    with open(tmp_path / "autotune" / "monitor" / "host.py", "a") as host:
        host.write("\nimport torch  # noqa: E402,F401\n")
    done = lint_imports(tmp_path, tmp_path)
    assert done.returncode != 0
    assert "Contracts: 0 kept, 2 broken" in done.stdout, done.stdout[-2000:]
    assert "autotune.common.units -> autotune.tuner" in done.stdout, done.stdout[-3000:]
    assert "autotune.monitor.host -> torch" in done.stdout, done.stdout[-3000:]


def test_the_top_level_is_short_and_each_folder_says_what_it_owns_and_who_imports_it():
    top = sorted(path.name for path in PACKAGE.glob("*.py"))
    assert len(top) <= 12, top
    folders = sorted(path.parent.name for path in PACKAGE.glob("*/__init__.py"))
    assert len(folders) >= 10, folders
    for name in folders:
        doc = ast.get_docstring(ast.parse((PACKAGE / name / "__init__.py").read_text())) or ""
        assert "Owns" in doc and "import" in doc, f"autotune/{name}/__init__.py does not say what it owns and who imports it"


def test_every_public_name_is_importable_from_autotune():
    assert sorted(autotune.__all__) == sorted(PUBLIC)
    for name in PUBLIC:
        assert getattr(autotune, name) is not None, name
    done = subprocess.run([sys.executable, "-c", f"from autotune import {', '.join(PUBLIC)}"],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]


def test_the_module_paths_from_before_the_folders_are_the_modules_they_became():
    for old, new in _moved.MOVED.items():
        assert importlib.import_module(f"autotune.{old}") is importlib.import_module(f"autotune.{new}"), old
        assert importlib.import_module(f"autotune.{new}").__spec__.name == f"autotune.{new}", new
    from autotune.checkpoint import CheckpointFailed
    from autotune.integrations.transformers import AutoTuneTrainer  # noqa: F401  (never moved)
    from autotune.oom import OutOfMemory

    assert OutOfMemory is autotune.OutOfMemory and CheckpointFailed is autotune.CheckpointFailed
    # In a fresh interpreter, where the old path is the first import of the module: a user's
    # `except autotune.oom.OutOfMemory` catches what the package raises.
    code = ("import autotune.oom, autotune.monitor.link, autotune.relief.ladder\n"
            "from autotune.common.oom import OutOfMemory\n"
            "assert autotune.oom.OutOfMemory is OutOfMemory\n"
            "from autotune.tuning import monitor_link, relief_ladder\n"
            "assert autotune.monitor.link is monitor_link and autotune.relief.ladder is relief_ladder\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    # A name that never existed is still an ImportError, not something the aliases make up.
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("autotune.no_such_module")
    assert autotune.oom is autotune.common.oom  # an attribute of the package, as before the folders
    with pytest.raises(AttributeError):
        autotune.no_such_module  # noqa: B018


def test_an_old_module_path_runs_with_python_m():
    # docs/policies.md said `python -m autotune.presets` before the folders: it prints the policy table still.
    done = subprocess.run([sys.executable, "-m", "autotune.presets"], capture_output=True, text=True, timeout=120,
                          cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "| `halve_on_oom` |" in done.stdout
