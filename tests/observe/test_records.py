"""The journal's registry (records.py) is what the docs list and what the writers write."""

import re
from pathlib import Path

import pytest

from autotune.observe import records
from autotune.observe.journal import Journal

OBSERVABILITY = Path(__file__).resolve().parents[2] / "docs" / "observability.md"


def test_the_docs_list_of_record_kinds_is_the_registrys():
    text = OBSERVABILITY.read_text()
    block = re.search(r"<!-- journal-kinds -->\n(.*?)\n<!-- /journal-kinds -->", text, re.S)
    assert block, "docs/observability.md has no <!-- journal-kinds --> block"
    assert block.group(1) == records.markdown(), "docs/observability.md's list differs: paste `python -m autotune.observe.records`"


def test_an_unknown_kind_or_field_is_refused(tmp_path):
    journal = Journal(tmp_path / "events.jsonl")
    with pytest.raises(ValueError, match="'om' is not in autotune/observe/records.py"):
        journal.write("om", 0, 0)
    with pytest.raises(ValueError, match=r"'oom' has fields \['size'\]"):
        records.check("oom", {"size": 3}, strict=True)
    records.check("oom", {"size": 3}, strict=False)  # outside the suite only the kind is checked


TALLIES = ("count", "first", "last")  # the report's records of each kind, by kind


def _kinds_named(package):
    """Every kind the package writes or reads, as (where, node): the first argument of
    `<...journal>.write(...)` (each side of an `a if ... else b`), `by_kind[...]`,
    `since_start(...)`, the report's tally (`newest(...)`, `count[...]`, `last.get(...)`, `... in since_start`),
    and what a record's kind is compared with: `record["kind"] == ...`,
    `.get("kind") == ...`, `in (...)`, and in the journal's readers a bare `kind == ...`."""
    import ast

    readers = ("report.py", "tensorboard_log.py", "journal.py")  # where a bare `kind` is a record's

    def is_kind(node, path):
        if isinstance(node, ast.Name):
            return node.id == "kind" and path.name in readers
        if isinstance(node, ast.Subscript):
            return isinstance(node.slice, ast.Constant) and node.slice.value == "kind"
        return (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get"
                and node.args and isinstance(node.args[0], ast.Constant) and node.args[0].value == "kind")

    def parts(node):  # a, or a if ... else b, or (a, b)
        if isinstance(node, ast.IfExp):
            return parts(node.body) + parts(node.orelse)
        if isinstance(node, (ast.Tuple, ast.Set, ast.List)):
            return [v for e in node.elts for v in parts(e)]
        return [node]

    written, read = [], []
    for path in sorted(package.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            where = f"{path.name}:{getattr(node, 'lineno', 0)}"
            if isinstance(node, ast.Call) and node.args:
                func = node.func
                if isinstance(func, ast.Attribute) and func.attr == "write" and "journal" in ast.unparse(func.value):
                    written += [(where, part) for part in parts(node.args[0])]
                if isinstance(func, ast.Name) and func.id == "since_start":
                    read += [(where, part) for part in parts(node.args[0])]
                if isinstance(func, ast.Attribute) and (func.attr == "newest" or (  # the report's tally
                        func.attr == "get" and ast.unparse(func.value).split(".")[-1] in TALLIES)):
                    read += [(where, part) for part in parts(node.args[0])]
            named = ast.unparse(node.value).split(".")[-1] if isinstance(node, ast.Subscript) else None
            if named == "by_kind" or (named in TALLIES and path.name == "report.py"):
                read += [(where, part) for part in parts(node.slice)]
            if isinstance(node, ast.Compare) and any(isinstance(c, ast.Name) and c.id == "since_start"
                                                     for c in node.comparators):
                read += [(where, part) for part in parts(node.left)]
            if isinstance(node, ast.Compare) and is_kind(node.left, path):
                read += [(where, part) for right in node.comparators for part in parts(right)]
    return written, read


def test_every_kind_is_named_through_kind_and_is_in_the_registry(tmp_path):
    # Issue 46: a misspelt kind wrote a record the journal refuses on a path no test takes, or read
    # no records without a word. Writers and readers name kinds as `Kind.X`, never as a string,
    # and every X is a kind the registry has.
    import ast

    names = {name for name in vars(records.Kind) if name.isupper()}
    assert {getattr(records.Kind, name) for name in names} == set(records.KINDS)  # a name for each record, and back

    def refused(package):
        written, read = _kinds_named(package)
        bad = [f"{where}: {ast.unparse(node)}" for where, node in written + read
               if not (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                       and node.value.id == "Kind" and node.attr in names)
               and not isinstance(node, ast.Name)]  # a variable: a reader's parameter, a set made from KINDS
        return written, read, bad

    written, read, bad = refused(Path(records.__file__).parents[1])  # the whole package
    assert len(written) >= 30 and len(read) >= 40  # the walk sees the writers and the readers at all
    assert bad == []
    # And it sees a bare string, or a name the registry lacks, where there is one.
    (tmp_path / "report.py").write_text('journal.write("oom", 1, 0)\nby_kind[Kind.OOMS]\nif kind == "fit_end": pass\n')
    assert len(refused(tmp_path)[2]) == 3


def test_a_reader_asking_for_an_unknown_kind_is_told():
    import pytest

    by_kind = records.RecordsByKind()
    by_kind.add({"kind": "oom", "step": 1})
    assert len(by_kind["oom"]) == 1 and by_kind["relief"] == []
    with pytest.raises(KeyError, match="'ooms' is not in"):
        by_kind["ooms"]
