"""The journal's registry (records.py) is what the docs list and what the writers write."""

import re
from pathlib import Path

import pytest

from autotune import records
from autotune.journal import Journal

OBSERVABILITY = Path(__file__).resolve().parents[1] / "docs" / "observability.md"


def test_the_docs_list_of_record_kinds_is_the_registrys():
    text = OBSERVABILITY.read_text()
    block = re.search(r"<!-- journal-kinds -->\n(.*?)\n<!-- /journal-kinds -->", text, re.S)
    assert block, "docs/observability.md has no <!-- journal-kinds --> block"
    assert block.group(1) == records.markdown(), "docs/observability.md's list differs: paste `python -m autotune.records`"


def test_an_unknown_kind_or_field_is_refused(tmp_path):
    journal = Journal(tmp_path / "events.jsonl")
    with pytest.raises(ValueError, match="'om' is not in autotune/records.py"):
        journal.write("om", 0, 0)
    with pytest.raises(ValueError, match=r"'oom' has fields \['size'\]"):
        records.check("oom", {"size": 3}, strict=True)
    records.check("oom", {"size": 3}, strict=False)  # outside the suite only the kind is checked


def test_every_kind_named_in_the_code_is_in_the_registry():
    # Kinds are strings at their writers and readers: a misspelt one would write a record the journal
    # refuses on a path no test takes, or read no records without a word (issue 46). Written: every
    # `<...journal>.write("kind", ...)` (or `"a" if ... else "b"`). Read: `by_kind["kind"]`,
    # `since_start("kind")`, `record["kind"] == "kind"` (or `.get("kind")`, or `in (...)`), and in the
    # journal's readers a bare `kind == "kind"`.
    import ast

    readers = ("report.py", "tensorboard_log.py", "journal.py")  # where a bare `kind` is a record's

    def is_kind(node, path):
        if isinstance(node, ast.Name):
            return node.id == "kind" and path.name in readers
        if isinstance(node, ast.Subscript):
            return isinstance(node.slice, ast.Constant) and node.slice.value == "kind"
        return (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get"
                and node.args and isinstance(node.args[0], ast.Constant) and node.args[0].value == "kind")

    def strings(node):  # "a", or "a" if ... else "b", or ("a", "b")
        if isinstance(node, ast.IfExp):
            return strings(node.body) + strings(node.orelse)
        if isinstance(node, (ast.Tuple, ast.Set, ast.List)):
            return [v for e in node.elts for v in strings(e)]
        return [node.value] if isinstance(node, ast.Constant) and isinstance(node.value, str) else []

    written, read = {}, {}
    for path in Path(records.__file__).parent.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            where = f"{path.name}:{getattr(node, 'lineno', 0)}"
            if isinstance(node, ast.Call) and node.args:
                func = node.func
                if isinstance(func, ast.Attribute) and func.attr == "write" and "journal" in ast.unparse(func.value):
                    written.update(dict.fromkeys(strings(node.args[0]), where))
                if isinstance(func, ast.Name) and func.id == "since_start":
                    read.update(dict.fromkeys(strings(node.args[0]), where))
            if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name) and node.value.id == "by_kind":
                read.update(dict.fromkeys(strings(node.slice), where))
            if isinstance(node, ast.Compare) and is_kind(node.left, path):
                read.update({kind: where for right in node.comparators for kind in strings(right)})
    assert len(written) >= 25 and len(read) >= 15  # the walk sees the writers and the readers at all
    unknown = {kind: where for kind, where in {**written, **read}.items() if kind not in records.KINDS}
    assert unknown == {}, unknown


def test_a_reader_asking_for_an_unknown_kind_is_told():
    import pytest

    by_kind = records.RecordsByKind()
    by_kind.add({"kind": "oom", "step": 1})
    assert len(by_kind["oom"]) == 1 and by_kind["relief"] == []
    with pytest.raises(KeyError, match="'ooms' is not in"):
        by_kind["ooms"]
