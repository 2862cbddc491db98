"""The documentation cannot rot: the site builds with --strict, every code block of README.md and
docs/ is run here (Python), or is a file's text line for line, or is marked with the reason it is not
run (shell, TOML); `text` blocks are output. Every public name has a docstring the API reference shows."""

import inspect
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import python

import autotune

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
BLOCK = re.compile(r"(?:^(<!--[^\n]*-->)\n)?^```(\w*)\n(.*?)^```$", re.M | re.S)


def code_blocks(page: Path) -> list[tuple[str | None, str, str]]:
    """Each fenced block of `page`: the HTML comment on the line before it (or None), its language, its text."""
    return [(m.group(1), m.group(2), m.group(3)) for m in BLOCK.finditer(page.read_text())]


def test_the_pages_have_code_blocks_to_check():
    languages = [language for page in PAGES for _, language, _ in code_blocks(page)]
    assert languages.count("python") >= 8 and languages.count("bash") >= 8  # the pattern sees the blocks at all
    assert "" not in languages, "a block without a language: python, bash, toml, or text for output"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_python_block_is_run_or_marked(page, tmp_path):
    runnable = []
    for marker, language, code in code_blocks(page):
        if language == "text":  # output, shown
            continue
        if marker is None:
            assert language == "python", f"{page.name}: a {language} block with no 'not run: REASON' or 'from PATH'"
            runnable.append(code)
            continue
        not_run = re.fullmatch(r"<!-- not run: (.+\S) -->", marker)
        source = re.fullmatch(r"<!-- from (\S+) -->", marker)
        assert not_run or source, f"{page.name}: a block's marker is neither 'not run: REASON' nor 'from PATH': {marker}"
        if source:  # the block is that file's text, line for line in its order (the file is run by the suite)
            lines = iter((ROOT / source.group(1)).read_text().splitlines())
            for line in filter(str.strip, code.splitlines()):
                assert any(line == other for other in lines), f"{page.name}: {line!r} is not in {source.group(1)}"
    if not runnable:
        return
    # One interpreter a page, its blocks in order, in a folder of its own (runs/ lands there).
    script = tmp_path / "page.py"
    script.write_text("\n".join(runnable))
    done = python([str(script)], tmp_path, {"PYTHONPATH": str(ROOT)}, timeout=300)
    assert done.returncode == 0, f"{page.name}'s Python blocks failed:\n{done.stderr[-3000:]}"


def test_every_public_name_has_a_docstring_the_reference_shows():
    # Read as the reference reads it (griffe, without importing): a type alias's docstring is the
    # string after it, which Python's __doc__ does not keep.
    griffe = pytest.importorskip("griffe", reason="needs the docs extra (make test installs it)")
    shown = set()
    for page in (ROOT / "docs" / "reference").glob("*.md"):
        shown |= set(re.findall(r"^::: (\S+)$", page.read_text(), re.M))
    package = griffe.load("autotune", search_paths=[str(ROOT)])
    for name in autotune.__all__:
        where = f"{autotune._EXPORTS[name]}.{name}"
        assert where in shown, f"autotune.{name} is not in docs/reference/ (add '::: {where}')"
        docstring = package[where.removeprefix("autotune.")].docstring
        assert docstring is not None and docstring.value.strip(), f"{where} has no docstring"


def test_the_policy_table_is_made_from_the_method_cards():
    from autotune.tuning.presets import policy_table

    text = (ROOT / "docs" / "policies.md").read_text()
    block = re.search(r"<!-- policy-table -->\n(.*?)\n<!-- /policy-table -->", text, re.S)
    assert block and block.group(1) == policy_table(), "docs/policies.md's table differs: paste `python -m autotune.tuning.presets`"


@pytest.mark.slow
def test_the_site_builds_strict(tmp_path):
    pytest.importorskip("mkdocs", reason="needs the docs extra (make test installs it)")
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-5000:]
    assert (tmp_path / "site" / "reference" / "trainer" / "index.html").exists()
    # Every parameter of the two front doors is in its page's table, with its type and default (the
    # docstrings are completed at import: docs/hooks/runtime_docstrings.py).
    from autotune import AutoTrainer, Tuner

    for cls, page in ((AutoTrainer, "trainer"), (Tuner, "tuner")):
        html = (tmp_path / "site" / "reference" / page / "index.html").read_text()
        shown = set(re.findall(r'<tr class="doc-section-item">\s*<td>\s*<code>(\w+)</code>', html))
        public = [name for name in inspect.signature(cls).parameters if not name.startswith("_")]
        missing = [name for name in public if name not in shown]
        assert not missing, f"{cls.__name__}'s reference page lacks {missing}"
        # and no internal wiring among them: a host's is the one private `_wiring` (host_face.Wiring)
        internal = {"host", "ranks", "counters", "backward_fn", "owns_optimizer"} & (set(public) | shown)
        assert not internal, f"{cls.__name__} shows internal wiring as public arguments: {sorted(internal)}"
