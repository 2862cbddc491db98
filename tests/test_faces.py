"""The seams between the core and its hosts hold: AutoTrainer and the integrations use only the
Tuner's documented host face (`Tuner.HOST_FACE`) and write nothing into it; only the job's own
modules ask whether the job is sharded."""

import ast
import subprocess
from pathlib import Path

from autotune.tuner import Tuner

PACKAGE = Path(__file__).resolve().parents[1] / "autotune"
HOSTS = [PACKAGE / "trainer.py", *sorted((PACKAGE / "integrations").glob("[!_]*.py"))]


def _is_tuner(node: ast.AST) -> bool:
    # `tuner`, `self.tuner`, `trainer.tuner`: a Tuner a host holds
    return (isinstance(node, ast.Name) and node.id == "tuner") or (
        isinstance(node, ast.Attribute) and node.attr == "tuner")


def uses_of_the_tuner(path: Path) -> tuple[set[str], list[str]]:
    """(the Tuner attributes `path` reads or calls, what it assigns into a Tuner)"""
    used, written = set(), []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute) and _is_tuner(node.value):
            used.add(node.attr)
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                chain = target
                while isinstance(chain, ast.Attribute):
                    if _is_tuner(chain.value):
                        written.append(f"{path.name}:{node.lineno}: {ast.unparse(target)}")
                    chain = chain.value
    return used, written


def test_hosts_use_only_the_tuners_host_face_and_write_nothing_into_it():
    for path in HOSTS:
        used, written = uses_of_the_tuner(path)
        assert used, path  # the scan sees the host's uses at all
        assert used <= set(Tuner.HOST_FACE), (path.name, sorted(used - set(Tuner.HOST_FACE)))
        assert not written, written


def test_every_name_of_the_host_face_is_a_tuner_attribute(tmp_path):
    from torch import nn

    with Tuner(nn.Linear(2, 2), device="cpu", monitor=False, run_dir=tmp_path) as tuner:
        missing = [name for name in Tuner.HOST_FACE if not hasattr(tuner, name)]
    assert not missing, missing


def _writes_into_knobs(path: Path) -> list[str]:
    # Assignments whose target goes through something called `knobs` (`self.knobs.x = `,
    # `knobs.x += `), and setattr on one.
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        targets = (node.targets if isinstance(node, ast.Assign) else [node.target]
                   if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else [])
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr":
            targets = [node.args[0]]
        for target in targets:
            if isinstance(node, ast.Call):
                chain = target  # setattr(chain, ...)
            elif isinstance(target, (ast.Attribute, ast.Subscript)):
                chain = target.value  # `chain.x = `: a write into chain
            else:
                continue  # `knobs = ...` binds a name, writes nothing
            while isinstance(chain, ast.Attribute) and chain.attr != "knobs":
                chain = chain.value
            if (isinstance(chain, ast.Attribute) and chain.attr == "knobs") or (
                    isinstance(chain, ast.Name) and chain.id == "knobs"):
                found.append(f"{path.name}:{node.lineno}: {ast.unparse(node)[:80]}")
    return found


def test_only_knobs_py_changes_the_knobs(tmp_path):
    # knobs.py's docstring: the one place what policies control is changed (through its methods).
    written = [line for path in sorted(PACKAGE.rglob("*.py")) if path.name != "knobs.py"
               for line in _writes_into_knobs(path)]
    assert not written, written
    # The scan sees a write where there is one.
    probe = tmp_path / "probe.py"
    probe.write_text("def f(self):\n    self.knobs.micro_batch_size = 2\n    knobs.batch_size += 1\n"
                     "    setattr(self.knobs, 'relief', None)\n    self.knobs = None\n")
    assert len(_writes_into_knobs(probe)) == 3, _writes_into_knobs(probe)


def test_only_the_jobs_own_modules_ask_whether_the_job_is_sharded():
    found = subprocess.run(["grep", "-rn", "sharded is not None", str(PACKAGE)], capture_output=True, text=True).stdout
    outside = [line for line in found.splitlines()
               if not line.startswith((str(PACKAGE / "distributed.py"), str(PACKAGE / "sharded.py")))]
    assert not outside, outside


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
