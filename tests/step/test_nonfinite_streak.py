"""The circuit breaker on non-finite steps (optimizer_step.py's streak, recovery.py's stop): a run
whose every step is NaN stops with a checkpoint of the last finite step and an error naming the
count; scattered NaN steps are skipped, counted in the result and the journal, and the run goes on.
Real NaNs in the data, real checkpoints, a real process for the exit status."""

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

import autotune
from autotune import AutoTrainer, NonFiniteStep, TooManyNonFiniteSteps
from autotune.run_folder.checkpoint import nonfinite_weights
from tests.conftest import journal, run_python

N, BATCH = 256, 32  # 8 batches an epoch, in order (shuffle=False): batch k holds samples 32k..32k+31


def data(nan_batches=()):
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(N, 8, generator=g), torch.randn(N, 1, generator=g)
    for k in nan_batches:
        x[BATCH * k + 3] = float("nan")  # one real NaN sample: its batch's loss and gradients are NaN
    return TensorDataset(x, y)


def model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))


def sgd(params):
    return torch.optim.SGD(params, lr=0.05, momentum=0.9, fused=True)


def trainer(tmp_path, net, dataset, **kwargs):
    options = dict(loss_fn=nn.functional.mse_loss, batch_size=BATCH, device="cpu", shuffle=False, progress=False,
                   monitor=False, run_dir=tmp_path / "run", optimizer=sgd, checkpoint_interval=None)
    return AutoTrainer(net, dataset, **{**options, **kwargs})


def first_batches(dataset, steps):
    """What a plain loop trains on the first `steps` batches."""
    reference = model()
    optimizer = sgd(reference.parameters())
    x, y = dataset.tensors
    for k in range(steps):
        nn.functional.mse_loss(reference(x[BATCH * k:BATCH * (k + 1)]), y[BATCH * k:BATCH * (k + 1)]).backward()
        optimizer.step()
        optimizer.zero_grad()
    return reference


@pytest.mark.parametrize("read_late", [False, True], ids=["read-at-once", "read-a-step-late"])
def test_a_nan_on_every_step_stops_after_n_with_the_last_finite_weights_checkpointed(tmp_path, monkeypatch,
                                                                                     read_late):
    # Batches 0-2 train; from batch 3 on every batch holds a NaN (a broken transform from there on).
    # Read a step late (a fused optimizer on CUDA: finite.LateRead) the streak's last check is read
    # at the batch's end, so both paths stop at the same batch with the same count.
    from autotune.step import finite as finite_module

    if read_late:
        monkeypatch.setattr(finite_module, "READ_LATE_ON", frozenset({"cpu", "cuda"}))
    broken = data(nan_batches=range(3, 8))
    net = model()
    t = trainer(tmp_path, net, broken, max_nonfinite_steps=3)
    with pytest.raises(TooManyNonFiniteSteps, match="3 optimizer steps in a row were skipped") as caught:
        t.fit(epochs=2)
    assert (t.tuner.stepper._late is not None) == read_late
    t.close()
    assert isinstance(caught.value, NonFiniteStep) and autotune.TooManyNonFiniteSteps is TooManyNonFiniteSteps
    (path,) = (tmp_path / "run" / "checkpoints").glob("step-*.pt")  # the stop's: none other was due
    assert str(path) in str(caught.value) and "max_nonfinite_steps=3" in str(caught.value)
    state = torch.load(path, weights_only=True)
    # Batches 3 and 4 were skipped and passed; batch 5, whose skip tripped the breaker, is the resume's first.
    assert (state["progress"]["step"], state["progress"]["position"], state["progress"]["nonfinite_steps"]) == \
        (3, 5 * BATCH, 3)
    assert not nonfinite_weights(state["core"]["model"])
    reference = first_batches(broken, 3)
    for (name, mine), theirs in zip(state["core"]["model"].items(), reference.state_dict().values()):
        torch.testing.assert_close(mine, theirs, rtol=1e-6, atol=1e-7, msg=name)
    records = journal(tmp_path / "run")
    assert [r["at_step"] for r in records if r["kind"] == "nonfinite"] == [4, 4, 4]
    assert [r["reason"] for r in records if r["kind"] == "checkpoint"] == ["nonfinite"]
    (failed,) = [r for r in records if r["kind"] == "fit_failed"]
    assert failed["error"].startswith("TooManyNonFiniteSteps: 3 optimizer steps in a row")

    # The cause fixed, the run goes on from the checkpoint; the steps it skipped stay counted.
    with trainer(tmp_path, net, data(), max_nonfinite_steps=3) as again:
        result = again.fit(epochs=1, resume=True)
    assert (result.steps, result.nonfinite_steps) == (3 + 3, 3)  # batches 5-7 of the first epoch


def test_scattered_nan_steps_fewer_than_n_in_a_row_are_skipped_counted_and_the_run_finishes(tmp_path, capfd):
    # Eight NaN batches over two epochs, at most two in a row, against a limit of three: a streak
    # that a finite step ends starts again from zero.
    net = model()
    with trainer(tmp_path, net, data(nan_batches=(1, 2, 4, 6)), max_nonfinite_steps=3) as t:
        result = t.fit(epochs=2)
    assert (result.steps, result.nonfinite_steps, result.samples_seen, result.epochs) == (8, 8, 8 * BATCH, 2)
    (end,) = [r for r in journal(tmp_path / "run") if r["kind"] == "fit_end"]
    assert end["nonfinite_steps"] == 8
    err = capfd.readouterr().err
    assert err.count("8 optimizer steps of this run skipped on non-finite gradients (NaN or inf)") == 1, err
    assert "TooManyNonFiniteSteps" not in err


def test_without_keep_effective_batch_a_partly_stepped_batch_is_not_where_it_stops(tmp_path):
    # Each micro-batch of 8 is its own step. Batch 3's last two micro-batches are NaN (two in a row,
    # the limit) but its first two were stepped on: a checkpoint at its start would train them
    # again on resume. Batch 4 is NaN throughout: six in a row, the whole batch among them.
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(N, 8, generator=g), torch.randn(N, 1, generator=g)
    for row in (3 * BATCH + 19, 3 * BATCH + 27, 4 * BATCH + 3, 4 * BATCH + 11, 4 * BATCH + 19, 4 * BATCH + 27):
        x[row] = float("nan")
    t = trainer(tmp_path, model(), TensorDataset(x, y), keep_effective_batch=False, micro_batch_size=8,
                policies=None, max_nonfinite_steps=2)
    with pytest.raises(TooManyNonFiniteSteps, match="^6 optimizer steps in a row"):
        t.fit(epochs=1)
    t.close()
    (path,) = (tmp_path / "run" / "checkpoints").glob("step-*.pt")
    progress = torch.load(path, weights_only=True)["progress"]
    assert (progress["step"], progress["position"], progress["nonfinite_steps"]) == (3 * 4 + 2, 4 * BATCH, 6)


@pytest.mark.parametrize("limit", [None, 0, "default"])
def test_the_default_limit_is_50_and_none_or_0_turn_the_breaker_off(tmp_path, limit):
    # 64 steps an epoch (batch 1), every one NaN: the default stops at the 50th; off, the epoch ends.
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 8, generator=g)
    x[:, 0] = float("nan")
    every_step = TensorDataset(x, torch.randn(64, 1, generator=g))
    options = {} if limit == "default" else {"max_nonfinite_steps": limit}
    with trainer(tmp_path, model(), every_step, batch_size=1, **options) as t:
        if limit == "default":
            with pytest.raises(TooManyNonFiniteSteps, match="^50 optimizer steps in a row"):
                t.fit(epochs=1)
            assert t.counters.position == 49  # the 50th sample's batch is the one a resume trains first
        else:
            result = t.fit(epochs=1)
            assert (result.steps, result.nonfinite_steps, result.samples_seen) == (0, 64, 0)


@pytest.mark.parametrize("bad", [-1, True, 2.5, "10"])
def test_max_nonfinite_steps_is_checked(tmp_path, bad):
    with pytest.raises(ValueError, match=f"max_nonfinite_steps must be an integer >= 0 or None, got {bad!r}"):
        trainer(tmp_path, model(), data(), max_nonfinite_steps=bad)
    assert not (tmp_path / "run").exists()  # refused before anything is written


def test_a_tuner_in_your_own_loop_stops_too_with_its_own_checkpoint(tmp_path):
    net = model()
    x, y = torch.randn(8, 8), torch.randn(8, 1)
    with autotune.Tuner(net, sgd(net.parameters()), loss_fn=nn.functional.mse_loss, device="cpu",
                        run_dir=tmp_path / "run", monitor=False, max_nonfinite_steps=2) as tuner:
        tuner.step((x, y))
        trained = {k: v.clone() for k, v in net.state_dict().items()}
        tuner.step((x * float("nan"), y))
        with pytest.raises(TooManyNonFiniteSteps, match="2 optimizer steps in a row"):
            tuner.step((x * float("nan"), y))
    (path,) = (tmp_path / "run" / "checkpoints").glob("step-*.pt")
    state = torch.load(path, weights_only=True)
    assert state["progress"]["step"] == 1
    for name, value in trained.items():
        assert torch.equal(state["core"]["model"][name], value), name


@pytest.mark.slow
def test_a_script_whose_loss_is_always_nan_exits_non_zero_naming_the_count(tmp_path):
    # What a launcher sees: an exit status of 1 (a permanent failure: a restart meets the same NaN,
    # unlike a preemption's 128+n) and the error on stderr; before the breaker: 0, after 2 epochs.
    proc, _ = run_python(f"""
        import torch
        from torch import nn
        from torch.utils.data import TensorDataset
        from autotune import AutoTrainer
        data = TensorDataset(torch.randn(64, 4), torch.randn(64, 1))
        def nan_loss(out, y):
            return nn.functional.mse_loss(out, y) * float("nan")
        with AutoTrainer(nn.Linear(4, 1), data, loss_fn=nan_loss, batch_size=8, device="cpu", monitor=False,
                         progress=False, run_dir={str(tmp_path / "run")!r}, max_nonfinite_steps=4) as t:
            t.fit(epochs=2)
    """, tmp_path)
    assert proc.returncode == 1, proc.stderr
    assert "autotune.common.oom.TooManyNonFiniteSteps: 4 optimizer steps in a row were skipped" in proc.stderr
    assert len(list((tmp_path / "run" / "checkpoints").glob("step-*.pt"))) == 1
