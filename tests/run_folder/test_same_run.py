"""The right run (issue 48, item 2): a run id in every checkpoint and in the journal; a fresh run
refused where another run's checkpoints are (never pruning them); a resume refused where the
model or the optimizer is not the checkpoint's, naming the difference; the checkpoint's
hyperparameters win, with a warning listing those the constructor changes."""

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from autotune import AnotherRunsCheckpoints, AutoTrainer, CheckpointMismatch
from autotune.run_folder.checkpoint_files import Checkpoints
from tests.conftest import journal


def _trainer(run_dir, optimizer=None, hidden=32, seed=0):
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(96, 8, generator=g), torch.randint(0, 2, (96,), generator=g))
    model = nn.Sequential(nn.Linear(8, hidden), nn.ReLU(), nn.Linear(hidden, 2))
    return AutoTrainer(model, data, loss_fn=nn.functional.cross_entropy,
                       optimizer=(optimizer or (lambda p: torch.optim.SGD(p, lr=0.1)))(model.parameters()),
                       batch_size=16, device="cpu", progress=False, monitor=False, checkpoint_interval=None,
                       checkpoint_every=2, run_dir=run_dir)


def _files(folder):
    return {path.name: path.read_bytes() for path in sorted(folder.iterdir())}


def test_a_fresh_run_into_another_runs_folder_is_refused_and_deletes_nothing(tmp_path):
    run = tmp_path / "run"
    first = _trainer(run)
    first.fit(epochs=1)  # 6 steps: checkpoints 2, 4, 6 (kept: 3)
    first.close()
    before = _files(run / "checkpoints")
    (started,) = [r for r in journal(run) if r["kind"] == "fit_start"]

    second = _trainer(run, optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3), seed=1)
    with pytest.raises(AnotherRunsCheckpoints, match=r"3 checkpoint\(s\) of another run .*step-000000006.pt"):
        second.fit(max_steps=2)  # on the old code: ran, and its steps 1 and 2 were pruned as written
    second.close()
    assert _files(run / "checkpoints") == before  # not one byte of the old run changed
    assert [r["kind"] for r in journal(run)].count("fit_start") == 1  # refused before it started

    # The folder's run goes on, and says which one it is.
    third = _trainer(run)
    third.fit(epochs=2, resume=True)
    third.close()
    records = journal(run)
    (resumed,) = [r for r in records if r["kind"] == "resume"]
    assert resumed["run_id"] == started["run_id"] and resumed["path"].endswith("step-000000006.pt")
    assert [r["run_id"] for r in records if r["kind"] == "fit_start"] == [started["run_id"]] * 2
    saved = torch.load(run / "checkpoints" / "step-000000012.pt", weights_only=True)
    assert saved["run"]["id"] == started["run_id"]


def test_the_same_trainer_fits_again_into_its_own_folder(tmp_path):
    trainer = _trainer(tmp_path / "run")
    trainer.fit(max_steps=2)
    trainer.fit(max_steps=4)  # its own checkpoints: no refusal
    trainer.close()
    assert trainer.step == 4


def test_a_checkpoint_from_elsewhere_into_another_runs_folder_is_refused(tmp_path):
    source = _trainer(tmp_path / "source")
    source.fit(max_steps=2)
    source.close()
    other = _trainer(tmp_path / "other")
    other.fit(max_steps=2)
    other.close()
    again = _trainer(tmp_path / "other")
    with pytest.raises(AnotherRunsCheckpoints):
        again.fit(max_steps=4, resume=tmp_path / "source" / "checkpoints" / "step-000000002.pt")
    again.close()
    fresh = _trainer(tmp_path / "fresh")  # an empty folder takes it, as a fine-tune would
    fresh.fit(max_steps=4, resume=tmp_path / "source" / "checkpoints" / "step-000000002.pt")
    fresh.close()
    assert fresh.step == 4


def test_pruning_never_counts_another_runs_checkpoints():
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as folder:
        old = Checkpoints(Path(folder), keep=2)
        for step in (2, 4, 6):
            old.save({"step": step}, step)
        new = Checkpoints(Path(folder), keep=2)
        for step in (1, 2, 3):  # step 2 replaces the old run's: written by this run, it is this run's
            new.save({"step": step}, step)
        names = sorted(path.name for path in new.paths())
        assert names == ["step-000000002.pt", "step-000000003.pt", "step-000000004.pt", "step-000000006.pt"]


@pytest.mark.parametrize("saved, now, words", [
    (lambda p: torch.optim.AdamW(p, lr=1e-3), lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
     "optimizer is AdamW, this run's is SGD"),  # was: KeyError 'momentum' at the first step
    (lambda p: torch.optim.SGD(p, lr=0.1), lambda p: torch.optim.AdamW(p, lr=1e-3),
     "optimizer is SGD, this run's is AdamW"),  # was: a bare KeyError 'step' from the load
    (lambda p: torch.optim.Adam(p, lr=1e-3), lambda p: torch.optim.AdamW(p, lr=1e-3, weight_decay=0.1),
     "optimizer is Adam, this run's is AdamW"),  # was: trained on with Adam's weight_decay 0, silently
])
def test_another_optimizer_is_refused_before_anything_is_loaded(tmp_path, saved, now, words):
    first = _trainer(tmp_path / "run", optimizer=saved)
    first.fit(max_steps=2)
    first.close()
    second = _trainer(tmp_path / "run", optimizer=now)
    weights = {name: value.clone() for name, value in second.model.state_dict().items()}
    with pytest.raises(CheckpointMismatch, match=words):
        second.fit(max_steps=4, resume=True)
    second.close()
    assert all(torch.equal(weights[name], value) for name, value in second.model.state_dict().items())
    assert second.step == 0


def test_an_older_checkpoint_without_the_class_is_told_by_its_hyperparameters(tmp_path):
    first = _trainer(tmp_path / "run", optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
    first.fit(max_steps=2)
    first.close()
    path = tmp_path / "run" / "checkpoints" / "step-000000002.pt"
    state = torch.load(path, weights_only=True)
    del state["core"]["optimizer_class"], state["run"]  # as an autotune before run ids wrote it
    torch.save(state, path)
    path.with_name(path.name + ".sha256").unlink()
    second = _trainer(tmp_path / "run", optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3))
    with pytest.raises(CheckpointMismatch, match=r"hyperparameters \[.*'momentum'.*\] that this run's AdamW lacks"):
        second.fit(max_steps=4, resume=True)
    second.close()


def test_another_model_is_refused_naming_the_difference(tmp_path):
    first = _trainer(tmp_path / "run", hidden=32)
    first.fit(max_steps=2)
    first.close()
    second = _trainer(tmp_path / "run", hidden=24)
    with pytest.raises(CheckpointMismatch, match=r"0.weight \(32, 8\) in the checkpoint, \(24, 8\) here"):
        second.fit(max_steps=4, resume=True)
    second.close()


def test_the_checkpoints_hyperparameters_win_and_the_changed_ones_are_listed(tmp_path, capfd):
    first = _trainer(tmp_path / "run", optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3, weight_decay=0.01))
    first.fit(max_steps=2)
    first.close()
    capfd.readouterr()
    second = _trainer(tmp_path / "run", optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3, weight_decay=0.1))
    second.fit(max_steps=4, resume=True)
    second.close()
    err = capfd.readouterr().err
    assert "group 0 weight_decay: 0.01 in the checkpoint, 0.1 in the constructor" in err, err
    assert "lr" not in err.split("differs (")[1].split(")")[0]  # the same lr is not listed
    assert "resuming run " in err and "step-000000002.pt: step 2" in err
    assert second.optimizer.param_groups[0]["weight_decay"] == 0.01  # the rule: the checkpoint's


def _input_trainer(run_dir, samples=256, seed=0, shuffle=True, loader=False):
    # A first layer's worth of model: what matters is which samples each batch holds.
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(samples, 8, generator=g), torch.randint(0, 2, (samples,), generator=g))
    if loader:
        data = torch.utils.data.DataLoader(data, batch_size=32, shuffle=shuffle,
                                           generator=torch.Generator().manual_seed(seed))
    return AutoTrainer(nn.Linear(8, 2), data, loss_fn=nn.functional.cross_entropy, batch_size=32, seed=seed,
                       shuffle=shuffle, device="cpu", progress=False, monitor=False, checkpoint_interval=None,
                       run_dir=run_dir)


@pytest.mark.parametrize("loader", [False, True], ids=["autotunes-loader", "your-dataloader"])
@pytest.mark.parametrize("change, said", [
    ({"samples": 200}, "the dataset's length 256 in the checkpoint, 200 now"),
    ({"samples": 320}, "the dataset's length 256 in the checkpoint, 320 now"),
    ({"seed": 1}, "seed 0 in the checkpoint, 1 now"),
    ({"shuffle": False}, "shuffle True in the checkpoint, False now"),
], ids=["fewer-samples", "more-samples", "another-seed", "no-shuffle"])
def test_a_resume_mid_epoch_on_another_input_is_refused_naming_both(tmp_path, loader, change, said):
    # The old code resumed each silently: 37 (63) samples of the epoch trained twice and as many never with 200
    # (320) samples, 57 with seed 1. Your own DataLoader's seed is its generator's state, which the checkpoint
    # carries: there the sampler's kind tells a shuffle that changed.
    if loader and "seed" in change:
        pytest.skip("your DataLoader's order comes from the random states the checkpoint holds, not a seed")
    if loader and "shuffle" in change:
        said = "the sampler 'RandomSampler' in the checkpoint, 'SequentialSampler' now"
    first = _input_trainer(tmp_path / "run", loader=loader)
    first.fit(max_steps=3)  # 96 of the epoch's 256 samples
    first.close()
    before = _files(tmp_path / "run" / "checkpoints")
    again = _input_trainer(tmp_path / "run", loader=loader, **change)
    with pytest.raises(ValueError, match="stopped 96 samples into an epoch of another input") as refused:
        again.fit(epochs=1, resume=True)
    again.close()
    assert said in str(refused.value)
    assert _files(tmp_path / "run" / "checkpoints") == before


def test_a_resume_at_an_epochs_end_takes_the_new_input_with_a_word(tmp_path, capfd):
    first = _input_trainer(tmp_path / "run")
    first.fit(epochs=1)  # 8 steps, the epoch done
    first.close()
    capfd.readouterr()
    again = _input_trainer(tmp_path / "run", samples=320)
    result = again.fit(epochs=2, resume=True)
    again.close()
    assert "resuming at an epoch's end with another input (the dataset's length 256 in the checkpoint, 320 now)" \
        in capfd.readouterr().err
    assert result.samples_seen == 256 + 320


def test_a_fresh_tuner_in_another_runs_folder_is_refused_at_its_first_step(tmp_path):
    # The Tuner in your own loop writes run_dir/checkpoints (before a relief, before an OOM error): a script run
    # again with the same run_dir trained beside the old run's checkpoints, which a later resume could pick.
    from autotune import Tuner

    def tuner():
        torch.manual_seed(0)
        model = nn.Linear(8, 2)
        return Tuner(model, torch.optim.SGD(model.parameters(), lr=0.1), loss_fn=nn.functional.cross_entropy,
                     device="cpu", monitor=False, run_dir=tmp_path / "run")

    batch = (torch.randn(16, 8), torch.randint(0, 2, (16,)))
    with tuner() as first:
        first.step(batch)
        first.checkpoint("test")
    (saved,) = (tmp_path / "run" / "checkpoints").glob("step-*.pt")
    with tuner() as second, pytest.raises(AnotherRunsCheckpoints, match=r"this Tuner starts a new one .* "
                                                                          r"tuner.load_state_dict"):
        second.step(batch)
    with tuner() as third:  # the same run, continued
        third.load_state_dict(torch.load(saved, weights_only=True))
        third.step(batch)
        assert third.step_count == 2
