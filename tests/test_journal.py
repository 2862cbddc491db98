import pytest

from autotune.journal import Journal, read_journal


def test_lines_are_written_as_they_happen(tmp_path):
    journal = Journal(tmp_path / "run" / "events.jsonl")
    journal.write("fit_start", 0, 0, device="cpu")
    # flushed without close: a crash right now would keep it
    (record,) = read_journal(tmp_path / "run" / "events.jsonl")
    assert record["kind"] == "fit_start" and record["device"] == "cpu" and record["time"] > 0


def test_a_truncated_last_line_is_skipped(tmp_path):
    path = tmp_path / "events.jsonl"
    path.write_text('{"kind": "fit_start", "step": 0}\n{"kind": "oom", "st')
    assert [r["kind"] for r in read_journal(path)] == ["fit_start"]


def test_a_bad_line_in_the_middle_is_an_error(tmp_path):
    path = tmp_path / "events.jsonl"
    path.write_text('{"kind": "a"}\nnot json\n{"kind": "b"}\n')
    with pytest.raises(ValueError, match="events.jsonl:2"):
        list(read_journal(path))


def test_a_journal_that_ends_mid_line_gets_its_newline_before_the_next_record(tmp_path):
    # What a kill -9 mid-write (or a short write on a full disk) leaves: the resumed run's first record was
    # appended onto the fragment and lost with it.
    from autotune.journal import read_lines

    path = tmp_path / "events.jsonl"
    path.write_text('{"kind": "fit_start", "step": 0, "epoch": 0, "time": 1}\n{"kind": "oom", "st')
    journal = Journal(path)
    journal.write("resume", 3, 0, found=False)
    journal.close()
    records, unreadable = read_lines(path)
    assert [r["kind"] for r in records] == ["fit_start", "resume"] and unreadable == 1
