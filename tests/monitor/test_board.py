import errno
import struct
import subprocess
import sys
import time

import pytest

from autotune.monitor.board import Board, create_board, default_path
from autotune.common.snapshot import DeviceSample
from tests.small_tmpfs import full_shm, small_shm  # noqa: F401  (fixtures)


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


# -- a full /dev/shm (a container's 64 MiB): a real 1 MiB tmpfs, filled (tests/small_tmpfs.py)

MAKE_BOARD = """
from autotune.monitor.board import Board, default_path
try:
    Board(default_path(), create=True)  # its header is written at once: a page tmpfs cannot back was SIGBUS
except OSError as exc:
    print(type(exc).__name__, exc.errno)
"""


def test_a_board_in_a_full_shared_memory_folder_is_an_error_when_made_not_sigbus(full_shm):
    proc = subprocess.run([sys.executable, "-c", MAKE_BOARD], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-2000:])  # before: -7, SIGBUS
    assert proc.stdout.split() == ["NoRoom", str(errno.ENOSPC)]
    assert [p.name for p in full_shm.iterdir()] == ["fill"]  # no half-made board left behind


def test_where_shared_memory_is_full_the_board_is_made_in_the_run_folder_with_a_word(full_shm, tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = run / f"autotune-{int(dead.stdout)}-00ff.board"  # a killed run's, an earlier fall-back
    stale.write_bytes(b"\0" * 4096)
    writer = create_board(fallback=run)
    assert writer.path.parent == run and not stale.exists()
    reader = Board(writer.path)  # the monitor process's side
    writer.write(DeviceSample(time=1.0, used_bytes=5, source="host"), process_bytes=7, samples_taken=1)
    assert reader.read_new() == (DeviceSample(time=1.0, used_bytes=5, source="host"), 7)
    err = capsys.readouterr().err
    assert f"could not be made in {full_shm} (no room" in err and f"in the run folder instead ({writer.path})" in err
    reader.close()
    writer.close(unlink=True)
    assert list(run.iterdir()) == []
    with pytest.raises(OSError) as raised:  # no folder to fall back to: the caller's to handle
        create_board()
    assert raised.value.errno == errno.ENOSPC


def test_an_shm_dir_that_is_not_a_writable_folder_is_said_and_the_default_is_used(tmp_path, monkeypatch, capsys):
    from autotune.common.stale import shared_memory_dir

    monkeypatch.setenv("AUTOTUNE_SHM_DIR", str(tmp_path / "missing"))
    assert shared_memory_dir() != tmp_path / "missing"
    assert f"AUTOTUNE_SHM_DIR='{tmp_path / 'missing'}' is not a folder" in capsys.readouterr().err
    monkeypatch.setenv("AUTOTUNE_SHM_DIR", str(tmp_path))
    assert default_path().parent == tmp_path
