import random

import numpy as np
import pytest
import torch

from autotune.checkpoint import Checkpoints, rng_state, set_rng_state


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
