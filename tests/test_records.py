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


def test_every_kind_written_in_the_package_is_registered():
    package = Path(records.__file__).parent
    written = set()
    for path in package.rglob("*.py"):
        written |= set(re.findall(r'\.write\(\s*"([a-z_]+)"', path.read_text()))
        written |= set(re.findall(r'"(monitor_[a-z_]+)" if', path.read_text()))  # a kind chosen by a condition
    assert written - set(records.KINDS) == set(), written - set(records.KINDS)
    assert len(written) >= 25  # the scan sees the writers at all


def test_an_unknown_kind_or_field_is_refused(tmp_path):
    journal = Journal(tmp_path / "events.jsonl")
    with pytest.raises(ValueError, match="'om' is not in autotune/records.py"):
        journal.write("om", 0, 0)
    with pytest.raises(ValueError, match=r"'oom' has fields \['size'\]"):
        records.check("oom", {"size": 3}, strict=True)
    records.check("oom", {"size": 3}, strict=False)  # outside the suite only the kind is checked


def test_the_kinds_the_report_reads_are_registered():
    source = (Path(records.__file__).parent / "report.py").read_text()
    read = set(re.findall(r'by_kind\["([a-z_]+)"\]', source)) | set(re.findall(r'\["kind"\] == "([a-z_]+)"', source))
    assert len(read) >= 10 and read <= set(records.KINDS), read - set(records.KINDS)
