"""checksums.py: a checkpoint whose bytes changed on disk since they were written (one flipped bit in a
weight, which torch.load reads without a word) is skipped, naming the file, for the one before; a run
whose checkpoints all fail to load is an error, never a silent start afresh; a sharded checkpoint's
files are summed too, and any error from a load (DCP's CheckpointException is a BaseException) goes
down the same fallback."""

import os

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from autotune import AutoTrainer
from autotune.run_folder.checkpoint_files import Checkpoints
from autotune.run_folder.checksums import MANIFEST, ChecksumMismatch, verify
from autotune.ranks.distributed import Solo
from tests.conftest import journal


def _trainer(run_dir):
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(64, 8, generator=g), torch.randint(0, 2, (64,), generator=g))
    return AutoTrainer(nn.Sequential(nn.Linear(8, 32), nn.Linear(32, 2)), data, loss_fn=nn.functional.cross_entropy,
                       batch_size=16, device="cpu", progress=False, monitor=False, checkpoint_interval=None,
                       checkpoint_every=2, run_dir=run_dir)


def _flip_a_bit_of(path, tensor):
    # In the bytes of `tensor` as stored (torch.save keeps them uncompressed): an exponent bit of its first float.
    data = bytearray(path.read_bytes())
    at = bytes(data).find(tensor.detach().numpy().tobytes()[:16])
    assert at > 0, "the tensor's bytes are not in the file"
    data[at + 3] ^= 0x20
    path.write_bytes(bytes(data))


def test_a_flipped_bit_is_named_and_the_previous_checkpoint_resumed(tmp_path, capfd):
    trainer = _trainer(tmp_path / "run")
    trainer.fit(epochs=1)  # 4 steps: checkpoints at 2 and 4
    trainer.close()
    newest = tmp_path / "run" / "checkpoints" / "step-000000004.pt"
    weight = torch.load(newest, weights_only=True)["core"]["model"]["0.weight"]
    _flip_a_bit_of(newest, weight)
    flipped = torch.load(newest, weights_only=True)["core"]["model"]["0.weight"]
    assert not torch.equal(flipped, weight)  # torch.load alone reads it without a word
    capfd.readouterr()
    again = _trainer(tmp_path / "run")
    again.fit(epochs=1, resume=True)
    err = capfd.readouterr().err
    assert f"{newest} is not the file written there" in err, err
    again.close()
    (resumed,) = [r for r in journal(tmp_path / "run") if r["kind"] == "resume"]
    assert resumed["path"].endswith("step-000000002.pt")  # not step 4's changed weights
    assert again.tuner.step_count == 4  # step 2's run went on through the epoch


@pytest.mark.parametrize("sum_file", ["missing", "empty"])
def test_a_checkpoint_whose_sum_is_gone_is_not_trusted(tmp_path, capfd, sum_file):
    # `cp checkpoints/*.pt` leaves the .sha256 behind; a sum emptied holds no digest. Either way the old code read
    # the file unchecked: with one exponent bit flipped it resumed from a weight of ~5e34 with no word.
    trainer = _trainer(tmp_path / "run")
    trainer.fit(epochs=1)
    trainer.close()
    newest = tmp_path / "run" / "checkpoints" / "step-000000004.pt"
    _flip_a_bit_of(newest, torch.load(newest, weights_only=True)["core"]["model"]["0.weight"])
    if sum_file == "missing":
        newest.with_name(newest.name + ".sha256").unlink()
    else:
        newest.with_name(newest.name + ".sha256").write_text("\n")
    capfd.readouterr()
    again = _trainer(tmp_path / "run")
    again.fit(epochs=1, resume=True)
    err = capfd.readouterr().err
    again.close()
    said = "has no step-000000004.pt.sha256 beside it" if sum_file == "missing" else "holds no sha256 digest"
    assert said in err and "not trusted" in err, err
    (resumed,) = [r for r in journal(tmp_path / "run") if r["kind"] == "resume"]
    assert resumed["path"].endswith("step-000000002.pt")


def test_an_older_autotunes_checkpoint_without_a_sum_is_read_with_a_word(tmp_path, capfd):
    # No run id, no sum: written before either existed. Read as it is, and said.
    checkpoints = Checkpoints(tmp_path)
    path, _ = checkpoints.save({"step": 3}, 3)
    path.with_name(path.name + ".sha256").unlink()
    state, found = checkpoints.load_latest()
    assert state["step"] == 3 and found == path
    assert f"checkpoint {path} has no checksum (an older autotune's): read without a check" in capfd.readouterr().err


def test_another_runs_checkpoint_copied_into_the_folder_is_named_and_passed_over(tmp_path, capfd):
    # Run B's newest checkpoint (with its sum) copied into run A's folder: the old code resumed it, saying only
    # "resuming run <B's id>". The folder's journal says whose run it is.
    for name in ("a", "b"):
        trainer = _trainer(tmp_path / name)
        trainer.fit(epochs=2 if name == "b" else 1)  # b's newest is step 8, a's step 4
        trainer.close()
    a, b = tmp_path / "a" / "checkpoints", tmp_path / "b" / "checkpoints"
    for file in ("step-000000008.pt", "step-000000008.pt.sha256"):
        (a / file).write_bytes((b / file).read_bytes())
    b_id = torch.load(b / "step-000000008.pt", weights_only=True)["run"]["id"]
    capfd.readouterr()
    again = _trainer(tmp_path / "a")
    again.fit(epochs=1, resume=True)
    err = capfd.readouterr().err
    again.close()
    assert f"checkpoint {a / 'step-000000008.pt'} is another run's: run {b_id}" in err, err
    (resumed,) = [r for r in journal(tmp_path / "a") if r["kind"] == "resume"]
    assert resumed["path"].endswith("step-000000004.pt") and resumed["run_id"] != b_id


def test_the_folders_run_is_read_from_the_end_of_its_journal(tmp_path, monkeypatch):
    # Blocks of 64 bytes, so a record spans two; an overlong line, a torn one and another kind's on the way.
    import json

    from autotune.observe import journal as journal_module

    monkeypatch.setattr(journal_module, "MAX_LINE_BYTES", 64)
    path = tmp_path / "events.jsonl"
    lines = [json.dumps({"kind": "fit_start", "run_id": "aaaaaaaaaaaa", "time": 1, "step": 0, "epoch": 0}),
             json.dumps({"kind": "resume", "run_id": "bbbbbbbbbbbb", "step": 0}),
             "x" * 300, '{"kind": "resume", "run_id": "cccc', json.dumps({"kind": "oom", "run_id": "dddddddddddd"})]
    path.write_text("\n".join(lines) + "\n")
    assert journal_module.last_run_id(path) == "bbbbbbbbbbbb"
    assert journal_module.last_run_id(tmp_path / "none.jsonl") is None


def test_no_checkpoint_that_loads_is_an_error_not_a_fresh_start(tmp_path):
    trainer = _trainer(tmp_path / "run")
    trainer.fit(epochs=1)
    trainer.close()
    for path in (tmp_path / "run" / "checkpoints").glob("step-*.pt"):
        path.write_bytes(path.read_bytes()[:100])  # truncated
    again = _trainer(tmp_path / "run")
    with pytest.raises(ValueError, match="none of the 2 checkpoints in .* loads"):
        again.fit(epochs=1, resume=True)
    again.close()


def test_a_sharded_checkpoints_files_are_summed_and_checked(tmp_path):
    checkpoints = Checkpoints(tmp_path)
    path, _ = checkpoints.save_sharded({"model": {"w": torch.arange(64.0)}, "step": 1}, 1, is_main=True)
    verify(path)
    shard = next(p for p in path.iterdir() if p.suffix == ".distcp")
    _flip_a_bit_of(shard, torch.arange(64.0)[1:])
    with pytest.raises(ChecksumMismatch, match=f"{shard.name} is not the file written there"):
        verify(path)
    path, _ = checkpoints.save_sharded({"model": {"w": torch.arange(64.0)}, "step": 2}, 2, is_main=True)
    (path / MANIFEST).write_text((path / MANIFEST).read_text() + f"{'0' * 64}  gone.distcp\n")
    with pytest.raises(ChecksumMismatch, match="gone.distcp is missing"):
        verify(path)


def test_a_sharded_checkpoint_whose_metadata_does_not_read_falls_back(tmp_path, capfd):
    # Random bytes for DCP's .metadata and no sums (as a folder copied in by hand): DCP's error is a
    # CheckpointException, a BaseException, which must not escape the fallback.
    checkpoints = Checkpoints(tmp_path)
    checkpoints.save({"step": 1}, 1)
    path, _ = checkpoints.save_sharded({"model": {"w": torch.zeros(4)}, "step": 2}, 2, is_main=True)
    (path / MANIFEST).unlink()
    (path / ".metadata").write_bytes(os.urandom(256))
    state, found = checkpoints.load_latest(template=lambda: {"model": {"w": torch.zeros(4)}, "step": 0},
                                           ranks=Solo())
    assert state["step"] == 1 and found.name == "step-000000001.pt"
    assert f"checkpoint {path} cannot be loaded" in capfd.readouterr().err


class _Payload:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):  # what unpickling it would run: here, a folder made as the proof
        return (os.mkdir, (self.marker,))


def _dotted_payload(marker: str) -> bytes:
    # Pickle protocol 4 by hand: STACK_GLOBAL("torch.distributed.checkpoint.metadata", "os.mkdir") finds os.mkdir
    # through that module's own `import os`; a rule allowing the whole module let it run (issue 56).
    import pickle

    def text(value: str) -> bytes:
        data = value.encode()
        return pickle.SHORT_BINUNICODE + bytes([len(data)]) + data

    return (pickle.PROTO + bytes([4]) + text("torch.distributed.checkpoint.metadata") + text("os.mkdir")
            + pickle.STACK_GLOBAL + text(marker) + pickle.TUPLE1 + pickle.REDUCE + pickle.STOP)


@pytest.mark.parametrize("payload, named", [
    (lambda marker: __import__("pickle").dumps(_Payload(marker)), "posix.mkdir"),
    (_dotted_payload, "torch.distributed.checkpoint.metadata.os.mkdir"),
], ids=["plain-global", "dotted-name"])
def test_a_sharded_checkpoints_metadata_never_runs_code(tmp_path, capfd, payload, named):
    # A folder with a valid rest.pt and a pickled payload for DCP's .metadata, no sums (made by hand, or by
    # someone else): DCP's reader would unpickle it whole. Refused, naming what it names, and the one before loads.
    checkpoints = Checkpoints(tmp_path / "ckpt")
    checkpoints.save({"step": 1}, 1)
    path, _ = checkpoints.save_sharded({"model": {"w": torch.zeros(4)}, "step": 2}, 2, is_main=True)
    (path / MANIFEST).unlink()
    marker = tmp_path / "the-payload-ran"
    (path / ".metadata").write_bytes(payload(str(marker)))
    state, found = checkpoints.load_latest(template=lambda: {"model": {"w": torch.zeros(4)}, "step": 0},
                                           ranks=Solo())
    assert not marker.exists()
    assert state["step"] == 1 and found.name == "step-000000001.pt"
    assert f"names {named}, which is not checkpoint metadata: refused" in capfd.readouterr().err


@pytest.mark.parametrize("planted", ["fifo-checkpoint", "device-checkpoint", "fifo-sum", "device-sum", "renamed"])
def test_a_planted_special_file_or_a_renamed_checkpoint_is_passed_over(tmp_path, capfd, planted):
    # The old code hung on a FIFO (torch.load, or hashing it), read /dev/zero for ever (8.9 GB in 15 s), and took
    # step-6's file renamed step-20 (with its sum) for step 20, rolling every later resume back to step 6.
    trainer = _trainer(tmp_path / "run")
    trainer.fit(epochs=1)  # checkpoints 2 and 4
    trainer.close()
    folder = tmp_path / "run" / "checkpoints"
    newest = folder / "step-000000004.pt"
    if planted == "fifo-checkpoint":
        os.mkfifo(folder / "step-000000099.pt")
    elif planted == "device-checkpoint":
        (folder / "step-000000099.pt").symlink_to("/dev/zero")
    elif planted == "renamed":
        newest.rename(folder / "step-000000020.pt")
        newest.with_name(newest.name + ".sha256").rename(folder / "step-000000020.pt.sha256")
    else:
        sums = newest.with_name(newest.name + ".sha256")
        sums.unlink()
        os.mkfifo(sums) if planted == "fifo-sum" else sums.symlink_to("/dev/zero")
    capfd.readouterr()
    again = _trainer(tmp_path / "run")
    again.fit(epochs=1, resume=True)
    again.close()
    err = capfd.readouterr().err
    (resumed,) = [r for r in journal(tmp_path / "run") if r["kind"] == "resume"]
    expected = "step-000000004.pt" if planted.endswith("checkpoint") else "step-000000002.pt"
    assert resumed["path"].endswith(expected), err
    said = {"fifo-checkpoint": "is not a regular file: not a checkpoint", "device-checkpoint": "is not a regular file",
            "fifo-sum": "is a FIFO, not a regular file", "device-sum": "is a device, not a regular file",
            "renamed": "is not the file its sum was written for"}[planted]
    assert said in err, err
