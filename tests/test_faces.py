"""The seams between the core and its hosts hold: AutoTrainer and the integrations use only the
Tuner's host face (host_face.HostFace) and write nothing into it, nor into its parts; only the job's own
modules ask whether the job is sharded."""

import ast
import inspect
import subprocess
from pathlib import Path

from autotune.tuning.host_face import HostFace
from autotune.tuner import Tuner

PACKAGE = Path(__file__).resolve().parents[1] / "autotune"
HOSTS = [PACKAGE / "trainer.py", *sorted((PACKAGE / "integrations").glob("[!_]*.py"))]


def _is_tuner(node: ast.AST) -> bool:
    # `tuner`, `self.tuner`, `trainer.tuner`: a Tuner a host holds
    return (isinstance(node, ast.Name) and node.id == "tuner") or (
        isinstance(node, ast.Attribute) and node.attr == "tuner")


def _face() -> set[str]:
    # HostFace's names: the parts (annotated) and the lifecycle (its methods)
    return set(HostFace.__annotations__) | {name for name, value in vars(HostFace).items()
                                            if callable(value) and not name.startswith("_")}


def uses_of_the_tuner(path: Path) -> tuple[set[str], list[str]]:
    """(the Tuner attributes `path` reads or calls, what it writes into a Tuner or into a part of
    one, directly or through a name it bound to the part: `self.core = self.tuner.core`, then
    `self.core.on_failure = None`)"""
    tree = ast.parse(path.read_text())
    used, written = set(), []
    aliases: set[str] = set()  # what the host bound to a tuner's part ("self.core", "core")
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _is_tuner(node.value):
            used.add(node.attr)
        if isinstance(node, ast.Assign):
            for target in node.targets:
                pairs = (zip(target.elts, node.value.elts) if isinstance(target, ast.Tuple)
                         and isinstance(node.value, ast.Tuple) else [(target, node.value)])
                for name, value in pairs:
                    if isinstance(value, ast.Attribute) and _is_tuner(value.value):
                        aliases.add(ast.unparse(name))
    for node, into in _writes(tree):
        chain = into
        while True:
            if _is_tuner(chain) or ast.unparse(chain) in aliases:
                written.append(f"{path.name}:{node.lineno}: {ast.unparse(node)[:80]}")
                break
            if not isinstance(chain, (ast.Attribute, ast.Subscript)):
                break
            chain = chain.value
    return used, written


def test_hosts_use_only_the_tuners_host_face_and_write_nothing_into_it(tmp_path):
    for path in HOSTS:
        used, written = uses_of_the_tuner(path)
        assert used, path  # the scan sees the host's uses at all
        assert used <= _face(), (path.name, sorted(used - _face()))
        assert not written, written
    # The scan sees a write into a part through the name a host bound it to, and a name outside the face.
    probe = tmp_path / "host.py"
    probe.write_text("class H:\n    def __init__(self, t):\n        self.core, self.knobs = self.tuner.core, self.tuner.knobs\n"
                     "        self.core.on_failure = None\n        setattr(self.knobs, 'relief', None)\n"
                     "        self.tuner.dispatcher.policies = []\n")
    used, written = uses_of_the_tuner(probe)
    assert len(written) == 3 and "dispatcher" in used - _face(), (used, written)


def test_the_tuner_satisfies_the_host_face(tmp_path):
    from torch import nn

    with Tuner(nn.Linear(2, 2), device="cpu", monitor=False, run_dir=tmp_path) as tuner:
        missing = [name for name in _face() if not hasattr(tuner, name)]
    assert not missing, missing
    for name in _face() - set(HostFace.__annotations__):  # the methods, with the face's parameters
        face, actual = inspect.signature(getattr(HostFace, name)), inspect.signature(getattr(Tuner, name))
        assert list(face.parameters) == list(actual.parameters), (name, face, actual)


def _writes(tree: ast.AST):
    """(statement, what it writes into) for every assignment into an attribute or an item (a
    tuple's elements each) and every setattr: `a.b.c = 1` writes into `a.b`."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr":
            yield node, node.args[0]
            continue
        targets = (node.targets if isinstance(node, ast.Assign) else [node.target]
                   if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else [])
        for target in targets:
            for one in target.elts if isinstance(target, ast.Tuple) else [target]:
                if isinstance(one, (ast.Attribute, ast.Subscript)):
                    yield node, one.value  # `knobs = ...` binds a name and writes nothing


def _writes_into(path: Path, names: tuple[str, ...] = ("knobs",)) -> list[str]:
    # Writes into something called one of `names` (`self.knobs.x = `, `knobs.x += `, setattr on one).
    found = []
    for node, chain in _writes(ast.parse(path.read_text())):
        while isinstance(chain, ast.Attribute) and chain.attr not in names:
            chain = chain.value
        if (isinstance(chain, ast.Attribute) and chain.attr in names) or (
                isinstance(chain, ast.Name) and chain.id in names):
            found.append(f"{path.name}:{node.lineno}: {ast.unparse(node)[:80]}")
    return found


def test_only_knobs_py_changes_the_knobs(tmp_path):
    # knobs.py's docstring: the one place what policies control is changed (through its methods).
    written = [line for path in sorted(PACKAGE.rglob("*.py")) if path.name != "knobs.py"
               for line in _writes_into(path)]
    assert not written, written
    # The scan sees a write where there is one.
    probe = tmp_path / "probe.py"
    probe.write_text("def f(self):\n    self.knobs.micro_batch_size = 2\n    knobs.batch_size += 1\n"
                     "    setattr(self.knobs, 'relief', None)\n    self.knobs = None\n")
    assert len(_writes_into(probe)) == 3, _writes_into(probe)


def test_only_progress_py_changes_the_counters(tmp_path):
    # progress.py's docstring: every change to the run's counters is one of Progress's methods.
    counters = ("counters", "_counters", "progress")
    written = [line for path in sorted(PACKAGE.rglob("*.py")) if path.name != "progress.py"
               for line in _writes_into(path, counters)]
    assert not written, written
    probe = tmp_path / "probe.py"
    probe.write_text("def f(self, progress):\n    self.counters.step += 1\n    self._counters.epoch = 2\n"
                     "    progress.position = 0\n")
    assert len(_writes_into(probe, counters)) == 3


def test_only_the_jobs_own_modules_ask_whether_the_job_is_sharded():
    found = subprocess.run(["grep", "-rn", "sharded is not None", str(PACKAGE)], capture_output=True, text=True).stdout
    outside = [line for line in found.splitlines()
               if not line.startswith((str(PACKAGE / "ranks" / "distributed.py"), str(PACKAGE / "ranks" / "sharded.py")))]
    assert not outside, outside


# What the job's kind once was read from (job.py's strategies now answer with behaviour), and the
# modules that are the strategies.
KIND_FLAGS = {"forwards_are_collective", "writes_shards", "sums_in_backward", "why_not_prunable", "bucket",
              "news_rides_gradients"}
STRATEGIES = {PACKAGE / "ranks" / name for name in ("job.py", "whole_model.py", "sharded.py")}


def asks_the_job_its_kind(path: Path) -> list[str]:
    """Where `path` reads one of the job's kind flags, compares a process's `world` with 1 or 2
    (`ranks.world == 1`: "am I alone?"), or spells the process's type as `Solo | Ranks`."""
    text = path.read_text()
    found = [f"{path.name}: Solo | Ranks" for spelt in ("Solo | Ranks", "Ranks | Solo") if spelt in text]
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Attribute) and node.attr in KIND_FLAGS:
            found.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            if any(isinstance(side, ast.Attribute) and side.attr in ("world", "_world") for side in sides) and \
                    any(isinstance(side, ast.Constant) and side.value in (1, 2) for side in sides):
                found.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_nothing_outside_the_strategies_asks_the_job_what_kind_it_is(tmp_path):
    # job.py: every question about how the model is spread is a method of the job's strategy that
    # does the thing; process.py: every question about being alone, a method of the process.
    # distributed.py, where the processes pick their strategy, included.
    asked = [line for path in sorted(PACKAGE.rglob("*.py")) if path not in STRATEGIES
             for line in asks_the_job_its_kind(path)]
    assert not asked, asked
    # The scan sees each way of asking.
    probe = tmp_path / "probe.py"
    probe.write_text("def f(self, ranks: Solo | Ranks):\n    if self.ranks.job.writes_shards: pass\n"
                     "    x = ranks.job.bucket\n    if self.ranks.world == 1: pass\n    if 1 < self._world: pass\n"
                     "    y = self.ranks.world * 2\n")
    assert len(asks_the_job_its_kind(probe)) == 5, asks_the_job_its_kind(probe)


def test_every_module_says_what_it_owns_and_what_it_may_touch():
    import re

    silent = []
    for path in sorted(PACKAGE.rglob("*.py")):
        doc = ast.get_docstring(ast.parse(path.read_text())) or ""
        if path.stat().st_size and not re.search(r"\b[Oo]wn(s|ed)\b", doc):
            silent.append(str(path.relative_to(PACKAGE)))
        elif path.stat().st_size and not re.search(r"\b[Tt]ouch(es)?\b", doc):
            silent.append(str(path.relative_to(PACKAGE)) + " (touches?)")
    assert not silent, silent
