"""A real tmpfs of 1 MiB, mounted for a test, standing in for a container's full /dev/shm.

`small_shm` mounts it and points AUTOTUNE_SHM_DIR at it, so the boards and caches this process and
its children make go there; `full_shm` also fills it (a file written until ENOSPC). Needs root (mount); skipped,
saying why, where mounting is not allowed.
"""

from __future__ import annotations

import errno
import os
import subprocess
import sys
from pathlib import Path

import pytest

SIZE = 1 << 20


def fill(folder: Path, leave: int = 0) -> Path:
    """Write a file in `folder` until the filesystem has no room, then give back `leave` bytes."""
    path = folder / "fill"
    block = b"\xff" * 4096
    with open(path, "wb", buffering=0) as f:
        while True:
            try:
                f.write(block)
            except OSError as exc:
                if exc.errno != errno.ENOSPC:
                    raise
                break
    if leave:
        os.truncate(path, max(0, path.stat().st_size - leave))
    return path


def mount_small_tmpfs(folder: Path, size: int = SIZE) -> None:
    """Mount a tmpfs of `size` bytes at `folder`, or skip the test saying why it cannot be."""
    if not sys.platform.startswith("linux"):
        pytest.skip("a tmpfs mount needs Linux")
    folder.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here (needs root): {done.stderr.strip() or done.returncode}")


@pytest.fixture
def small_shm(tmp_path, monkeypatch):
    """An empty 1 MiB tmpfs as AUTOTUNE_SHM_DIR (here and in the processes a test starts)."""
    folder = tmp_path / "shm"
    mount_small_tmpfs(folder)
    try:
        monkeypatch.setenv("AUTOTUNE_SHM_DIR", str(folder))
        yield folder
    finally:
        subprocess.run(["umount", "--lazy", str(folder)], check=True)


@pytest.fixture
def full_shm(small_shm):
    """The same, with no room left in it."""
    fill(small_shm)
    return small_shm
