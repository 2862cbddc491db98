"""A full disk and a journal that cannot be written: no raw error, no temporary file left, a clear
error or a finished run with the failures shown, and a report that names only files that exist.

The disk is a real one: a small tmpfs mounted for the test where it runs as root, else the
per-process file-size limit (RLIMIT_FSIZE), under which a checkpoint larger than the limit fails
as a write to a full disk does."""

import contextlib
import os
import resource
import signal
import subprocess

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from autotune import AutoTrainer, CheckpointFailed
from autotune.observe.report import render, summarize

MiB = 2**20


def _mount(folder, size_mib):
    folder.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        return False
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_mib}m", "tmpfs", str(folder)],
                          capture_output=True, text=True)
    return done.returncode == 0


@contextlib.contextmanager
def small_disk(folder, size_mib):
    """`folder` on a disk of `size_mib` MiB; yields "tmpfs", or "fsize" where no tmpfs could be
    mounted and files larger than `size_mib` // 2 fail to be written instead."""
    if _mount(folder, size_mib):
        try:
            yield "tmpfs"
        finally:
            subprocess.run(["umount", "-l", str(folder)], check=True)
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead
    resource.setrlimit(resource.RLIMIT_FSIZE, (size_mib // 2 * MiB, hard))
    try:
        yield "fsize"
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, previous)


def trainer(run_dir, **kwargs):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 1024 * 6), nn.Linear(1024 * 6, 1))  # 6.3 MB of weights: one checkpoint
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(512, 256, generator=g), torch.randn(512, 1, generator=g))
    options = dict(loss_fn=nn.functional.mse_loss, batch_size=16, device="cpu", progress=False, monitor=False,
                   run_dir=run_dir, optimizer=lambda p: torch.optim.SGD(p, lr=1e-3), checkpoint_interval=None)
    return AutoTrainer(model, data, **{**options, **kwargs})


def test_a_full_disk_stops_the_run_with_a_clear_error_and_leaves_nothing_half_written(tmp_path, capfd):
    disk = tmp_path / "disk"
    with small_disk(disk, 16) as kind:  # tmpfs: room for two checkpoints, not three
        t = trainer(disk / "run", checkpoint_every=2, keep_checkpoints=3)
        with pytest.raises(CheckpointFailed) as caught:
            t.fit(epochs=1)
        t.close()
        message = str(caught.value)
        folder = disk / "run" / "checkpoints"
        assert f"3 checkpoints in a row could not be written into {folder}" in message
        assert "one needs about 6." in message and "MiB" in message
        on_disk = sorted(p.name for p in folder.iterdir() if not p.name.endswith(".sha256"))  # each with its sum
        assert on_disk == (["step-000000002.pt", "step-000000004.pt"] if kind == "tmpfs" else []), on_disk
        assert all((folder / f"{name}.sha256").exists() for name in on_disk)
        assert not [p for p in folder.iterdir() if p.name.endswith(".tmp")]  # no temporary left behind
        assert f"The newest checkpoint on disk is {folder / on_disk[-1]}" in message if on_disk else "none" in message
        summary = summarize(disk / "run")
        failed = summary["checkpoints_failed"]
        expected_failures = [6, 8, 10] if kind == "tmpfs" else [2, 4, 6]
        assert [c["step"] for c in failed] == expected_failures  # retried when next due, not at every step
        text = render(summary)
        for c in summary["checkpoints"]:
            assert c["on_disk"] == (c["path"].split("/")[-1] in on_disk)
        if on_disk:
            assert f"newest on disk: step 4 (every): {folder / 'step-000000004.pt'}" in text
        assert "checkpoints that failed: 3" in text
        err = capfd.readouterr().err
        assert err.count("could not write the checkpoint of step") == 1  # said once, journaled every time


def test_a_journal_on_a_full_disk_never_stops_the_training(tmp_path, capfd):
    disk = tmp_path / "disk"
    with small_disk(disk, 8) as kind:
        if kind != "tmpfs":
            pytest.skip("needs a tmpfs to fill (root): the file-size limit cannot fill a disk")

        class FillTheDisk:
            def on_step_end(self, trainer):
                if trainer.step == 3:
                    with open(disk / "filler", "wb") as f, contextlib.suppress(OSError):
                        while True:
                            f.write(b"\0" * MiB)
                            f.flush()

        t = trainer(disk / "run", callbacks=[FillTheDisk()])
        result = t.fit(epochs=1)
        t.close()
        assert result.samples_seen == 512  # trained to the end
        assert not [p for p in (disk / "run").rglob("*.tmp")]
        err = capfd.readouterr().err
        assert err.count("could not write the run's journal") == 1, err
        assert "line(s) of the run's journal" in err and "could not write the checkpoint of step 32" in err
        (disk / "filler").unlink()


def test_what_a_killed_write_left_is_removed_at_the_next_start(tmp_path):
    folder = tmp_path / "run" / "checkpoints"
    folder.mkdir(parents=True)
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = folder / f".step-000000004.pt.{dead.pid}.tmp"
    stale.write_bytes(b"\0" * 1000)
    mine = folder / f".step-000000004.pt.{os.getppid()}.tmp"  # a live process's write in progress: kept
    mine.write_bytes(b"\0")
    trainer(tmp_path / "run").close()
    assert not stale.exists() and mine.exists()
