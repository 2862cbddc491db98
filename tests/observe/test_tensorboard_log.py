"""`AutoTrainer(..., tensorboard=True)`: the scalars and text TensorBoard reads back from run_dir/tb."""

import json
import sys

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from autotune import AutoTrainer
from autotune.observe.tensorboard_log import TensorBoardLog, describe

event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator",
                                        reason="the optional tensorboard package is not installed")


def _trainer(run_dir, **kwargs):
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(256, 8), torch.randint(0, 2, (256,)))
    return AutoTrainer(nn.Linear(8, 2), data, loss_fn=nn.functional.cross_entropy, batch_size=32, device="cpu",
                       progress=False, monitor=False, run_dir=run_dir, seed=1, **kwargs)


def _read(folder):
    accumulator = event_accumulator.EventAccumulator(str(folder), size_guidance={"scalars": 0, "tensors": 0})
    accumulator.Reload()
    return accumulator


def test_a_run_with_ooms_writes_loss_throughput_memory_micro_batch_and_actions(tmp_path):
    trainer = _trainer(tmp_path / "run", inject_oom=0.3, tensorboard=True)
    result = trainer.fit(epochs=2)
    trainer.close()  # the end checkpoint's line comes once it is on disk
    board = _read(tmp_path / "run" / "tb")
    tags = board.Tags()["scalars"]
    for tag in ("train/loss", "train/samples_per_second", "train/micro_batch_size", "train/data_wait_fraction",
                "memory/used_gib", "memory/cap_gib", "autotune/ooms", "train/epoch_loss"):
        assert tag in tags, tag
    steps = [json.loads(line) for line in (tmp_path / "run" / "steps.jsonl").read_text().splitlines()]
    micro = board.Scalars("train/micro_batch_size")
    # One point per line of steps.jsonl, the same step and the same size.
    assert [(p.step, p.value) for p in micro] == [(s["step"], s["micro_batch_size"]) for s in steps]
    assert min(p.value for p in micro) < 32  # the OOMs halved it
    assert board.Scalars("autotune/ooms")[-1].value == result.ooms > 0
    assert all(p.value > 0 for p in board.Scalars("train/samples_per_second"))
    losses = [p.value for p in board.Scalars("train/loss")]
    assert all(0 < loss < 5 for loss in losses)
    epoch_losses = [p.value for p in board.Scalars("train/epoch_loss")]
    assert len(epoch_losses) == 2 and epoch_losses[-1] == pytest.approx(result.loss)
    texts = "\n".join(event.tensor_proto.string_val[0].decode()
                      for event in board.Tensors("autotune/events/text_summary"))
    assert "OOM at micro-batch" in texts and "halve" in texts and "checkpoint (end)" in texts
    assert "fit on cpu: batch 32" in texts


def test_off_by_default_and_a_folder_may_be_given(tmp_path):
    _trainer(tmp_path / "plain").fit(max_steps=2)
    assert not (tmp_path / "plain" / "tb").exists()
    _trainer(tmp_path / "run", tensorboard=tmp_path / "boards" / "mine").fit(max_steps=2)
    assert [p.step for p in _read(tmp_path / "boards" / "mine").Scalars("train/loss")] == [1, 2]


def test_bad_values_and_a_missing_package_say_what_to_do(tmp_path, monkeypatch):
    with pytest.raises(TypeError, match=r"tensorboard must be True/False or a folder \(a str or a Path\), got 3"):
        _trainer(tmp_path / "run", tensorboard=3)
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # as if tensorboard were not installed
    with pytest.raises(ImportError, match=r"pip install 'autotune\[tensorboard\]'"):
        TensorBoardLog(tmp_path / "tb")


def test_describe_keeps_applied_actions_and_events_worth_a_line():
    applied = {"kind": "action", "step": 3, "policy": "halve_on_oom", "action": "set_micro_batch",
               "params": {"size": 16}, "reason": "out of memory at micro-batch 32", "applied": True}
    assert describe(applied) == "halve_on_oom: set_micro_batch {'size': 16} - out of memory at micro-batch 32"
    assert describe({**applied, "applied": False}) is None
    assert describe({"kind": "step", "step": 3}) is None
    assert describe({"kind": "relief", "step": 9, "time": 1.0, "epoch": 0, "relief": "autocast"}) == \
        "relief: relief=autocast"


def test_the_oom_count_goes_on_from_the_checkpoint_after_a_resume(tmp_path):
    first = _trainer(tmp_path / "run", inject_oom=0.3, tensorboard=True)
    first.fit(epochs=1)
    assert first.ooms > 0
    resumed = _trainer(tmp_path / "run", inject_oom=0.3, tensorboard=True)
    resumed.fit(epochs=2, resume=True)
    assert resumed.ooms > first.ooms
    counts = sorted((p.step, p.value) for p in _read(tmp_path / "run" / "tb").Scalars("autotune/ooms"))
    assert counts[-1][1] == resumed.ooms  # the whole run's, not only those since the resume
