import random

import numpy as np
import pytest
import torch

from autotune.run_folder.checkpoint_files import Checkpoints
from autotune.run_folder.rng import rng_state, set_rng_state


def test_save_keeps_the_last_k_and_leaves_no_temporary_files(tmp_path):
    checkpoints = Checkpoints(tmp_path / "ckpt", keep=2)
    for step in (1, 2, 3):
        checkpoints.save({"step": step, "w": torch.full((3,), float(step))}, step)
    assert [p.name for p in checkpoints.paths()] == ["step-000000003.pt", "step-000000002.pt"]
    assert not list((tmp_path / "ckpt").glob(".*tmp"))
    state, path = checkpoints.load_latest()
    assert state["step"] == 3 and torch.equal(state["w"], torch.full((3,), 3.0))


def test_a_corrupt_newest_checkpoint_falls_back_to_the_previous(tmp_path, capsys):
    checkpoints = Checkpoints(tmp_path, keep=3)
    checkpoints.save({"step": 1}, 1)
    newest, _ = checkpoints.save({"step": 2, "w": torch.zeros(1000)}, 2)
    newest.write_bytes(newest.read_bytes()[:100])  # truncated, as by a crash mid-copy
    state, path = checkpoints.load_latest()
    assert state["step"] == 1 and path.name == "step-000000001.pt"


def test_loading_never_runs_code(tmp_path):
    class Evil:
        def __reduce__(self):
            return (print, ("pwned",))

    path = tmp_path / "step-000000001.pt"
    torch.save({"x": Evil()}, path)
    assert Checkpoints(tmp_path).load_latest() is None  # refused by weights_only, nothing else to load


def test_no_checkpoint_is_none(tmp_path):
    assert Checkpoints(tmp_path / "missing").load_latest() is None


def test_rng_states_round_trip_through_a_checkpoint(tmp_path):
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    checkpoints = Checkpoints(tmp_path)
    checkpoints.save({"rng": rng_state()}, 1)
    expected = (random.random(), np.random.rand(), torch.rand(1).item())
    random.seed(9), np.random.seed(9), torch.manual_seed(9)
    set_rng_state(checkpoints.load_latest()[0]["rng"])
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == expected


def test_keep_must_be_positive(tmp_path):
    with pytest.raises(ValueError):
        Checkpoints(tmp_path, keep=0)


class HeldWrites:
    """Background checkpoint writes wait at the door until `release()` (or fail, with `fail=`): a
    scripted slow disk. Writes from the caller's own thread (synchronous ones) go through."""

    def __init__(self, monkeypatch, fail: Exception | None = None):
        import threading

        import autotune.run_folder.checkpoint_files as module

        self.door, self.fail, self.main = threading.Event(), fail, threading.current_thread()
        real = module._write_atomically

        def held(data, final):
            if threading.current_thread() is not self.main:
                assert self.door.wait(30), "never released"
                if self.fail is not None:
                    raise self.fail
            real(data, final)

        monkeypatch.setattr(module, "_write_atomically", held)

    def release(self):
        self.door.set()


def small_trainer(run_dir, **kwargs):
    from torch import nn
    from torch.utils.data import TensorDataset

    from autotune import AutoTrainer

    torch.manual_seed(0)
    data = TensorDataset(torch.randn(64, 4), torch.randint(0, 2, (64,)))
    return AutoTrainer(nn.Linear(4, 2), data, loss_fn=nn.functional.cross_entropy, batch_size=16, device="cpu",
                       progress=False, monitor=False, policies=[], run_dir=run_dir, **kwargs)


def test_the_end_checkpoint_is_written_behind_fit_with_the_state_fit_ended_with(tmp_path, monkeypatch):
    import threading

    from tests.conftest import journal

    held = HeldWrites(monkeypatch)
    trainer = small_trainer(tmp_path / "run")
    trainer.fit(epochs=1)
    folder = tmp_path / "run" / "checkpoints"
    assert not list(folder.glob("step-*.pt"))  # fit returned; the write is still at the door
    at_the_end = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    with torch.no_grad():
        for p in trainer.model.parameters():
            p.add_(1.0)  # training (or anything) goes on: the checkpoint is already taken
    loaded = []
    reader = threading.Thread(target=lambda: loaded.append(Checkpoints(folder).load_latest()))  # another object
    reader.start()
    reader.join(0.3)
    assert reader.is_alive()  # a load waits for the write in progress
    held.release()
    reader.join(10)
    state, path = loaded[0]
    assert path.name == "step-000000004.pt"
    for key, value in at_the_end.items():
        assert torch.equal(state["core"]["model"][key], value)
    trainer.close()
    (record,) = [r for r in journal(tmp_path / "run") if r["kind"] == "checkpoint"]
    assert record["reason"] == "end" and record["background"] is True
    # Journaled once on disk, so after the fit's end: a line names only a file that was written.
    assert [r["kind"] for r in journal(tmp_path / "run")][-2:] == ["fit_end", "checkpoint"]


def test_close_waits_for_the_write_and_a_failed_one_is_journaled(tmp_path, monkeypatch):
    import threading

    from tests.conftest import journal

    held = HeldWrites(monkeypatch, fail=OSError(28, "No space left on device"))
    trainer = small_trainer(tmp_path / "run")
    trainer.fit(epochs=1)
    closing = threading.Thread(target=trainer.close)
    closing.start()
    closing.join(0.3)
    assert closing.is_alive()  # close() waits for the checkpoint
    held.release()
    closing.join(10)
    assert not closing.is_alive()
    failed = [r for r in journal(tmp_path / "run") if r["kind"] == "checkpoint_failed"]
    assert failed and "No space left" in failed[0]["error"] and failed[0]["path"].endswith("step-000000004.pt")
    assert not list((tmp_path / "run" / "checkpoints").glob("*"))  # nothing half-written under any name


def test_a_state_that_would_not_fit_beside_itself_is_written_at_once(tmp_path):
    from autotune.common.batching import tensor_bytes
    from autotune.run_folder.checkpoint import Checkpointer
    from autotune.ranks.distributed import Solo
    from autotune.observe.journal import Journal

    journal_file = tmp_path / "events.jsonl"
    state = {"w": torch.zeros(1000), "rng": rng_state()}
    size = tensor_bytes(state)
    assert size >= 4000  # the weights' 4000 bytes and the random states'
    checkpointer = Checkpointer(tmp_path / "ckpt", keep=2, every=None, interval=None, ranks=Solo(),
                                journal=Journal(journal_file), room_bytes=lambda: 4 * size - 1)  # a copy: a quarter at most
    path = checkpointer.save("every", lambda: state, 1, 0, background=True)
    assert path.exists()  # on disk when save returns
    assert "background" not in journal_file.read_text()
    checkpointer.room_bytes = lambda: 4 * size
    path = checkpointer.save("every", lambda: state, 2, 0, background=True)
    checkpointer.wait()
    assert path.exists() and '"background": true' in journal_file.read_text()
