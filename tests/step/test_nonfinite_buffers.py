"""A step skipped on non-finite gradients leaves no trace in the model's buffers (optimizer_step.py's
skip, rewind.py's `restore_buffers`): BatchNorm's running statistics are those of a loop that never
saw the batch, whole, in micro-batches (norm_stats.py's fold undone) or chunk by chunk, and the run's
checkpoints are written. Real NaNs in the data, real checkpoints."""

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from autotune import AutoTrainer, NonFiniteStep
from autotune.step import finite as finite_module
from autotune.run_folder.checkpoint import nonfinite_weights
from tests.conftest import journal

N, BATCH, NAN_BATCH, NAN_ROW = 256, 32, 3, 3  # 8 batches in order; batch 3's fourth sample is all NaN


def data():
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(N, 8, generator=g) * 3 + 5, torch.randn(N, 1, generator=g)
    x[BATCH * NAN_BATCH + NAN_ROW] = float("nan")
    return TensorDataset(x, y)


def model():
    # BatchNorm first: its input is the data's, so its running statistics do not depend on how the
    # weights trained (a split normalises each micro-batch over itself; the weights then differ).
    torch.manual_seed(0)
    return nn.Sequential(nn.BatchNorm1d(8), nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))


def sgd(params):
    return torch.optim.SGD(params, lr=0.05, momentum=0.9, fused=True)


def fit(tmp_path, **kwargs):
    net = model()
    with AutoTrainer(net, data(), loss_fn=nn.functional.mse_loss, batch_size=BATCH, device="cpu", shuffle=False,
                     progress=False, monitor=False, run_dir=tmp_path / "run", optimizer=sgd, checkpoint_interval=None,
                     policies=None, **kwargs) as t:
        result = t.fit(epochs=1)
    return net, result


def skipping_loop(chunk):
    """A plain loop over the same batches in `chunk`s, each stepped on, that never sees the NaN one."""
    reference = model()
    optimizer = sgd(reference.parameters())
    x, y = data().tensors
    for start in range(0, N, chunk):
        if start <= BATCH * NAN_BATCH + NAN_ROW < start + chunk:
            continue
        nn.functional.mse_loss(reference(x[start:start + chunk]), y[start:start + chunk]).backward()
        optimizer.step()
        optimizer.zero_grad()
    return reference


def assert_same(mine, theirs, names):
    for name in names:
        torch.testing.assert_close(mine[name], theirs[name], rtol=1e-5, atol=1e-6, msg=name)


BUFFERS = ("0.running_mean", "0.running_var", "0.num_batches_tracked")


@pytest.mark.parametrize("micro, keep, precision", [(None, True, "fp32"), (8, True, "fp32"), (8, False, "fp32"),
                                                     (None, True, "fp16")],
                         ids=["whole-batch", "micro-8-of-32", "chunks-of-8-stepped", "fp16-gradient-scaler"])
def test_a_skipped_nan_step_leaves_the_running_statistics_of_a_loop_that_skipped_it(tmp_path, micro, keep,
                                                                                      precision):
    net, result = fit(tmp_path, micro_batch_size=micro, keep_effective_batch=keep, precision=precision)
    stepped = N // (micro or BATCH) if not keep else N // BATCH
    assert (result.steps, result.nonfinite_steps) == (stepped - 1, 1)
    mine = net.state_dict()
    assert not nonfinite_weights(mine)
    theirs = skipping_loop(BATCH if keep else micro).state_dict()
    # Whole batches and stepped chunks train as the plain loop does: the weights too. A split
    # normalises each micro-batch over itself, fp16 computes in half: there only the statistics are the loop's.
    assert_same(mine, theirs, theirs if precision == "fp32" and (micro is None or not keep) else BUFFERS)
    records = journal(tmp_path / "run")
    assert not [r for r in records if r["kind"] == "checkpoint_refused"]
    (end,) = [r for r in records if r["kind"] == "checkpoint"]
    assert end["reason"] == "end"
    saved = torch.load(end["path"], weights_only=True)["core"]["model"]
    assert_same(saved, theirs, BUFFERS)
    (skipped,) = [r for r in records if r["kind"] == "nonfinite"]
    assert skipped["action"].endswith("the model's buffers put back as before the batch"), skipped


def test_on_nonfinite_stop_checkpoints_the_statistics_of_the_last_finite_step(tmp_path):
    net = model()
    t = AutoTrainer(net, data(), loss_fn=nn.functional.mse_loss, batch_size=BATCH, device="cpu", shuffle=False,
                    progress=False, monitor=False, run_dir=tmp_path / "run", optimizer=sgd, checkpoint_interval=None,
                    micro_batch_size=8, policies=None, on_nonfinite="stop")
    with pytest.raises(NonFiniteStep, match=f"at step {NAN_BATCH + 1}: stopped .*buffers put back"):
        t.fit(epochs=1)
    t.close()
    (path,) = (tmp_path / "run" / "checkpoints").glob("step-*.pt")
    state = torch.load(path, weights_only=True)
    assert state["progress"]["step"] == NAN_BATCH
    reference = model()
    x, _ = data().tensors
    for k in range(NAN_BATCH):  # the batches before the NaN one, whole: their statistics
        reference[0](x[BATCH * k:BATCH * (k + 1)])
    assert_same(state["core"]["model"], reference.state_dict(), BUFFERS)


def test_read_a_step_late_the_skipped_batchs_statistics_stay_and_that_is_said(tmp_path, monkeypatch):
    # A fused optimizer on CUDA: the check is read at the next step, after that batch's forward has
    # written the buffers again; the copies from before the skipped batch are gone by then.
    monkeypatch.setattr(finite_module, "READ_LATE_ON", frozenset({"cpu", "cuda"}))
    net, result = fit(tmp_path)
    assert result.nonfinite_steps == 1
    assert nonfinite_weights(net.state_dict()) == ["0.running_mean", "0.running_var"]
    records = journal(tmp_path / "run")
    (skipped,) = [r for r in records if r["kind"] == "nonfinite"]
    assert "buffers keep what its forward wrote (the check was read a step late)" in skipped["action"], skipped
    assert [r["reason"] for r in records if r["kind"] == "checkpoint_refused"] == ["end"]


def tuner_over_the_first_batches(tmp_path, device, fused):
    """Batches 0-4 through a Tuner in your own loop on `device` (the NaN one is batch 3)."""
    from autotune import Tuner

    net = model().to(device)
    x, y = (t.to(device) for t in data().tensors)
    with Tuner(net, lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, fused=fused),
               loss_fn=nn.functional.mse_loss, device=device, run_dir=tmp_path / "run", monitor=False) as tuner:
        for k in range(NAN_BATCH + 2):
            tuner.step((x[BATCH * k:BATCH * (k + 1)], y[BATCH * k:BATCH * (k + 1)]))
    (skipped,) = [r for r in journal(tmp_path / "run") if r["kind"] == "nonfinite"]
    return {k: v.cpu() for k, v in net.state_dict().items()}, skipped


@pytest.mark.gpu
@pytest.mark.parametrize("fused", [False, True], ids=["foreach-read-at-once", "fused-read-a-step-late"])
def test_on_cuda_a_checked_at_once_skip_puts_the_statistics_back_and_a_late_one_says_they_stay(tmp_path, fused):
    mine, skipped = tuner_over_the_first_batches(tmp_path, torch.device("cuda", 0), fused)
    assert skipped["at_step"] == NAN_BATCH + 1
    if fused:
        assert skipped["action"].endswith("buffers keep what its forward wrote (the check was read a step late)")
        assert nonfinite_weights(mine) == ["0.running_mean", "0.running_var"]
        return
    assert skipped["action"].endswith("the model's buffers put back as before the batch"), skipped
    reference = model()
    x, _ = data().tensors
    for k in (0, 1, 2, 4):
        reference[0](x[BATCH * k:BATCH * (k + 1)])
    assert_same(mine, reference.state_dict(), BUFFERS)
