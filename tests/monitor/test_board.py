import struct

import pytest
import time

from autotune.monitor.board import Board, default_path
from autotune.snapshot import DeviceSample


def boards():
    path = default_path()
    return Board(path, create=True), Board(path)


def test_nothing_written_reads_none():
    writer, reader = boards()
    assert reader.read() is None and reader.read_new() is None
    writer.close(unlink=True)


def test_a_written_sample_reads_back_once_as_new():
    writer, reader = boards()
    sample = DeviceSample(time=12.5, used_bytes=3 * 2**30, cap_bytes=None, total_bytes=8 * 2**30, source="nvml")
    writer.write(sample, process_bytes=2**30, samples_taken=1)
    assert reader.read_new() == (sample, 2**30)
    assert reader.read_new() is None  # not new any more
    writer.write(sample, process_bytes=None, samples_taken=2)
    assert reader.read_new() == (sample, None)
    writer.close(unlink=True)
    assert not writer.path.exists()


def test_a_torn_read_returns_none_instead_of_waiting():
    writer, reader = boards()
    writer.write(DeviceSample(time=1.0, used_bytes=1), None, 1)
    struct.pack_into("<Q", writer._map, 8, 3)  # freeze the writer mid-write: an odd sequence
    start = time.perf_counter()
    assert reader.read() is None
    assert time.perf_counter() - start < 0.01
    writer.close(unlink=True)


def test_a_file_that_is_not_a_board_is_refused(tmp_path):
    path = tmp_path / "x.board"
    path.write_bytes(b"\0" * 16)
    with pytest.raises(ValueError, match="not an autotune sample board"):
        Board(path)
    path.write_bytes(b"\0" * 4096)
    with pytest.raises(ValueError, match="not an autotune sample board"):
        Board(path)
