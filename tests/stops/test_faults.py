"""Faults that are not out-of-memory errors lose nothing and are never silent: a NaN sample, weights
that turn non-finite, a corrupt image file, bad inputs. Real faults: a real NaN in the data, a real
truncated JPEG read by torchvision's ImageFolder."""

import psutil
import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from autotune import AutoTrainer, NonFiniteStep
from autotune.run_folder.checkpoint import nonfinite_weights
from tests.conftest import journal

N, BATCH = 256, 32  # 8 steps an epoch; batch 6 holds samples 160..191


def nan_data(at=170):
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(N, 8, generator=g), torch.randn(N, 1, generator=g)
    x[at] = float("nan")  # a real NaN: its batch's loss and gradients are NaN
    return TensorDataset(x, y)


def model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))


def trainer(tmp_path, net, data, **kwargs):
    options = dict(loss_fn=nn.functional.mse_loss, batch_size=BATCH, device="cpu", shuffle=False, progress=False,
                   monitor=False, run_dir=tmp_path / "run", optimizer=lambda p: torch.optim.SGD(p, lr=0.05))
    return AutoTrainer(net, data, **{**options, **kwargs})


def without_the_nan_batch(data, make_optimizer, make_scheduler=None):
    """The model a plain loop trains when it leaves the NaN batch (samples 160..191) out: no step, no
    scheduler step for it."""
    reference = model()
    optimizer = make_optimizer(reference.parameters())
    scheduler = make_scheduler(optimizer) if make_scheduler is not None else None
    x, y = data.tensors
    for start in range(0, N, BATCH):
        if start == 160:
            continue
        nn.functional.mse_loss(reference(x[start:start + BATCH]), y[start:start + BATCH]).backward()
        optimizer.step()
        optimizer.zero_grad()
        if scheduler is not None:
            scheduler.step()
    return reference


def kept_checkpoints(tmp_path):
    return sorted((tmp_path / "run" / "checkpoints").glob("step-*.pt"))


def test_a_nan_batch_is_skipped_not_trained_and_no_checkpoint_is_nonfinite(tmp_path, capfd):
    data = nan_data()
    net = model()
    with trainer(tmp_path, net, data, checkpoint_every=2, keep_checkpoints=3) as t:
        result = t.fit(epochs=1)
    reference = without_the_nan_batch(data, lambda p: torch.optim.SGD(p, lr=0.05))
    for mine, theirs in zip(net.parameters(), reference.parameters()):
        torch.testing.assert_close(mine, theirs, rtol=1e-6, atol=1e-7)
    assert result.samples_seen == N - BATCH and result.steps == 7 and result.loss == result.loss  # not NaN
    records = journal(tmp_path / "run")
    skipped = [r for r in records if r["kind"] == "nonfinite"]
    assert len(skipped) == 1 and skipped[0]["at_step"] == 6 and "skipped" in skipped[0]["action"]
    for path in kept_checkpoints(tmp_path):
        assert not nonfinite_weights(torch.load(path, weights_only=True)["core"]["model"]), path
    err = capfd.readouterr().err
    assert err.count("non-finite gradients (NaN or inf) at step 6: the optimizer step was skipped") == 1, err


@pytest.mark.parametrize("read_late", [False, True], ids=["read-at-once", "read-a-step-late"])
def test_a_fused_optimizers_nan_step_is_skipped_on_the_device_and_counted_as_read_at_once(tmp_path, capfd,
                                                                                          monkeypatch, read_late):
    # On CUDA a fused optimizer's check is read a step late (no host sync: finite.py's LateRead); CPU
    # reads at once. Both here, on CPU: the weights, the momentum, the LR schedule (no scheduler step
    # for the skipped step), the counts, the journal and the checkpoint after the NaN step are the
    # same as a hand loop's that leaves the NaN batch out.
    from autotune.step import finite as finite_module
    from autotune.run_folder.checkpoint import nonfinite_weights

    if read_late:
        monkeypatch.setattr(finite_module, "READ_LATE_ON", frozenset({"cpu", "cuda"}))
    data = nan_data()

    def sgd(params):
        return torch.optim.SGD(params, lr=0.05, momentum=0.9, fused=True)

    def halving(optimizer):
        return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5 ** step)

    net = model()
    with trainer(tmp_path, net, data, optimizer=sgd, scheduler=halving, checkpoint_every=3, keep_checkpoints=5) as t:
        result = t.fit(epochs=1)
        assert (t.tuner.stepper._late is not None) == read_late  # the path this case is about was taken
    reference = without_the_nan_batch(data, sgd, halving)
    for mine, theirs in zip(net.parameters(), reference.parameters()):
        torch.testing.assert_close(mine, theirs, rtol=1e-6, atol=1e-7)
    assert result.samples_seen == N - BATCH and result.steps == 7
    records = journal(tmp_path / "run")
    skipped = [r for r in records if r["kind"] == "nonfinite"]
    assert len(skipped) == 1 and skipped[0]["at_step"] == 6, skipped
    # Due at steps 3 and 6: the one due at the NaN batch holds the last finite step, 5 (its step read
    # before the checkpoint on the late path too), with as many samples and scheduler steps.
    saved = [torch.load(path, weights_only=True) for path in kept_checkpoints(tmp_path)]
    assert [(s["progress"]["step"], s["progress"]["samples_seen"], s["core"]["scheduler"]["last_epoch"])
            for s in saved] == [(3, 3 * BATCH, 3), (5, 5 * BATCH, 5), (7, 7 * BATCH, 7)]
    assert not any(nonfinite_weights(s["core"]["model"]) for s in saved)
    err = capfd.readouterr().err
    assert err.count("non-finite gradients (NaN or inf) at step 6: the optimizer step was skipped") == 1, err


def test_stop_on_nonfinite_checkpoints_the_last_finite_step_and_names_the_samples(tmp_path):
    net = model()
    t = trainer(tmp_path, net, nan_data(), on_nonfinite="stop", checkpoint_interval=None)
    with pytest.raises(NonFiniteStep, match="at step 6") as caught:
        t.fit(epochs=1)
    notes = "\n".join(caught.value.__notes__)
    assert "batch 6 of epoch 1" in notes and "samples [160, 161," in notes and "170" in notes
    assert "step 5" in notes and "resume=True" in notes
    (path,) = kept_checkpoints(tmp_path)
    state = torch.load(path, weights_only=True)
    assert state["progress"]["step"] == 5 and not nonfinite_weights(state["core"]["model"])
    t.close()


def test_weights_that_turn_nonfinite_never_replace_the_finite_checkpoints(tmp_path, capfd):
    class Spoil:
        def on_step_end(self, trainer):
            if trainer.step == 6:
                with torch.no_grad():
                    trainer.model[0].weight[0, 0] = float("inf")

    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(N, 8, generator=g), torch.randn(N, 1, generator=g))
    with trainer(tmp_path, model(), data, checkpoint_every=2, keep_checkpoints=3, callbacks=[Spoil()]) as t:
        t.fit(epochs=2)
    steps = [int(path.stem.split("-")[1]) for path in kept_checkpoints(tmp_path)]
    assert steps == [2, 4], steps  # 6, 8, ... and the end were refused; the last good ones kept
    refused = [r for r in journal(tmp_path / "run") if r["kind"] == "checkpoint_refused"]
    assert refused and refused[0]["step"] == 6 and refused[0]["nonfinite"] == ["0.weight"]
    assert "the model's weights are not finite (0.weight)" in capfd.readouterr().err


def test_a_corrupt_image_at_step_6_checkpoints_step_5_names_the_sample_and_resumes(tmp_path):
    PIL = pytest.importorskip("PIL.Image")
    from torchvision import transforms
    from torchvision.datasets import ImageFolder

    def images(folder, corrupt):
        (folder / "a").mkdir(parents=True, exist_ok=True)
        g = torch.Generator().manual_seed(1)
        for i in range(N):
            pixels = (torch.rand(6, 6, 3, generator=g) * 255).to(torch.uint8).numpy()
            PIL.fromarray(pixels).save(folder / "a" / f"{i:04d}.jpg")
        if corrupt:  # a truncated download: the header and then garbage
            path = folder / "a" / "0170.jpg"
            path.write_bytes(path.read_bytes()[:20] + b"\x00garbage")
        return ImageFolder(folder, transform=transforms.ToTensor())

    def loss(out, target):
        return out.pow(2).mean()

    def net():
        torch.manual_seed(0)
        return nn.Sequential(nn.Flatten(), nn.Linear(108, 1))

    kw = dict(loss_fn=loss, batch_size=BATCH, device="cpu", shuffle=False, progress=False, monitor=False,
              optimizer=lambda p: torch.optim.SGD(p, lr=0.05))
    broken = images(tmp_path / "images", corrupt=True)
    t = AutoTrainer(net(), broken, run_dir=tmp_path / "run", **kw)  # the default: a checkpoint every 900 s
    with pytest.raises(Exception, match="cannot identify image file") as caught:
        t.fit(epochs=1)
    notes = "\n".join(caught.value.__notes__)
    assert "samples [160, " in notes and ", 170," in notes and "step 5" in notes
    t.close()
    (path,) = kept_checkpoints(tmp_path)
    assert torch.load(path, weights_only=True)["progress"]["step"] == 5
    failed = [r for r in journal(tmp_path / "run") if r["kind"] == "fit_failed"]
    assert failed[-1]["checkpoint"] == str(path)

    fixed = images(tmp_path / "images", corrupt=False)  # the file downloaded again
    resumed = net()
    with AutoTrainer(resumed, fixed, run_dir=tmp_path / "run", **kw) as t:
        assert t.fit(epochs=1, resume=True).samples_seen == N
    reference = net()
    with AutoTrainer(reference, fixed, run_dir=tmp_path / "reference", **kw) as t:
        t.fit(epochs=1)
    for mine, theirs in zip(resumed.parameters(), reference.parameters()):
        torch.testing.assert_close(mine, theirs, rtol=1e-6, atol=1e-7)


def test_a_loss_that_is_not_a_0d_tensor_fails_on_the_first_micro_batch_naming_the_function(tmp_path):
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(64, 8, generator=g), torch.randn(64, 1, generator=g))
    net = model()
    before = [p.detach().clone() for p in net.parameters()]
    vector = trainer(tmp_path / "vector", net, data, loss_fn=lambda out, y: (out - y).pow(2))
    with pytest.raises(ValueError, match=r"loss_fn returned a loss of shape \(32, 1\): it must be a 0-d tensor"):
        vector.fit()
    as_float = trainer(tmp_path / "float", net, data, loss_fn=lambda out, y: nn.functional.mse_loss(out, y).item())
    with pytest.raises(TypeError, match="loss_fn must return a loss tensor, got float: return the tensor"):
        as_float.fit()
    by_step = trainer(tmp_path / "by_step", net, data, loss_fn=None, step_fn=lambda m, b: m(b[0]).sum(dim=1))
    with pytest.raises(ValueError, match="step_fn returned a loss of shape"):
        by_step.fit()
    for p, q in zip(net.parameters(), before):
        assert torch.equal(p, q)  # no optimizer step was taken
    for t in (vector, as_float, by_step):
        t.close()


def test_policies_none_means_no_policies_and_a_frozen_model_is_refused_at_once(tmp_path):
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(64, 8, generator=g), torch.randn(64, 1, generator=g))
    with trainer(tmp_path, model(), data, policies=None) as t:
        assert t.tuner.dispatcher.policies == [] and t.fit().steps == 2
    frozen = model().requires_grad_(False)
    with pytest.raises(ValueError, match="has no trainable parameter .*none with requires_grad=True"):
        trainer(tmp_path / "frozen", frozen, data)


def test_on_nonfinite_is_checked(tmp_path):
    with pytest.raises(ValueError, match="on_nonfinite='ignore': pass one of 'skip', 'stop'"):
        trainer(tmp_path, model(), nan_data(), on_nonfinite="ignore")


def test_fp16_skips_by_the_gradient_scaler_are_journaled_and_not_counted(tmp_path, capfd):
    with trainer(tmp_path, model(), nan_data(), precision="fp16", checkpoint_interval=None) as t:
        result = t.fit(epochs=1)
    assert result.samples_seen == N - BATCH and result.steps == 7
    (skipped,) = [r for r in journal(tmp_path / "run") if r["kind"] == "nonfinite"]
    assert skipped["at_step"] == 6 and skipped["action"] == "optimizer step skipped by the gradient scaler"
    assert "(fp16) at step 6: the optimizer step was skipped by the gradient scaler" in capfd.readouterr().err


def test_a_dataloader_workers_error_checkpoints_first_too(tmp_path):
    class Broken(torch.utils.data.Dataset):
        def __len__(self):
            return N

        def __getitem__(self, i):
            if i == 170:
                raise ValueError(f"sample {i}: unreadable")
            return torch.full((8,), i / N), torch.ones(1)

    t = trainer(tmp_path, model(), Broken(), num_workers=2)
    before = {child.pid for child in psutil.Process().children()}
    with pytest.raises(ValueError, match="sample 170: unreadable") as caught:
        t.fit(epochs=1)
    # The error holds the loader's iterator in its traceback; its workers are stopped all the same
    # (they lived as long as `caught`, and its collection in a garbage cycle cost 10 s).
    left = [c for c in psutil.Process().children() if c.pid not in before and c.status() != psutil.STATUS_ZOMBIE]
    assert not left, [c.cmdline() for c in left]
    t.close()
    assert "samples [160, " in "\n".join(caught.value.__notes__)
    (path,) = kept_checkpoints(tmp_path)
    assert torch.load(path, weights_only=True)["progress"]["step"] == 5


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_sample_that_fails_to_load_is_named_with_its_own_error(tmp_path, num_workers):
    # The sample's error does not say which it is (a truncated image file, say): autotune fetches
    # the failing batch's samples again, one at a time, and names the first that fails.
    class Corrupt(torch.utils.data.Dataset):
        def __len__(self):
            return N

        def __getitem__(self, i):
            if i == 183:
                raise OSError("image file is truncated (3 bytes not processed)")
            return torch.full((8,), i / N), torch.ones(1)

    t = trainer(tmp_path, model(), Corrupt(), num_workers=num_workers)
    with pytest.raises(OSError, match="truncated") as caught:
        t.fit(epochs=1)
    t.close()
    notes = "\n".join(caught.value.__notes__)
    assert "sample 183 of the dataset fails to load (fetched alone): OSError: image file is truncated" in notes, notes
    (failed,) = [r for r in journal(tmp_path / "run") if r["kind"] == "fit_failed"]
    assert failed["bad_sample"] == {"index": 183, "error": "OSError: image file is truncated (3 bytes not processed)"}
    assert "checkpoint" in failed  # the five steps before it are saved, as for any error


def test_a_batch_whose_samples_load_alone_but_not_together_says_so(tmp_path):
    def collate(samples):
        if any(float(x[0]) == 183 / N for x, _ in samples):
            raise RuntimeError("stack expects each tensor to be equal size")
        return torch.utils.data.default_collate(samples)

    data = TensorDataset(torch.arange(N, dtype=torch.float32).div(N).unsqueeze(1).expand(N, 8).clone(), torch.ones(N, 1))
    t = trainer(tmp_path, model(), data, collate_fn=collate)
    with pytest.raises(RuntimeError, match="equal size") as caught:
        t.fit(epochs=1)
    t.close()
    assert "each of the batch's samples loads on its own" in "\n".join(caught.value.__notes__)
    (failed,) = [r for r in journal(tmp_path / "run") if r["kind"] == "fit_failed"]
    assert "bad_sample" not in failed


def test_a_later_error_is_not_journaled_with_an_earlier_bad_sample(tmp_path):
    class Corrupt(torch.utils.data.Dataset):
        broken = True

        def __len__(self):
            return N

        def __getitem__(self, i):
            if i == 183 and self.broken:
                raise OSError("image file is truncated")
            return torch.full((8,), i / N), torch.ones(1)

    data = Corrupt()
    calls = []

    def step_fn(model, micro):
        calls.append(1)
        if not data.broken and len(calls) > 3:
            raise RuntimeError("a bug in step_fn")
        x, y = micro
        return nn.functional.mse_loss(model(x), y)

    t = trainer(tmp_path, model(), data, step_fn=step_fn, loss_fn=None)
    with pytest.raises(OSError):
        t.fit(epochs=1)
    data.broken = False
    with pytest.raises(RuntimeError, match="a bug"):
        t.fit(epochs=1, resume=True)
    t.close()
    first, second = [r for r in journal(tmp_path / "run") if r["kind"] == "fit_failed"]
    assert first["bad_sample"]["index"] == 183 and "bad_sample" not in second


@pytest.mark.parametrize("odd, said", [
    (None, "it is None where the batch's other samples are (Tensor[8], Tensor[1])"),
    ((torch.zeros(7), torch.ones(1)), "it is (Tensor[7], Tensor[1]) where the batch's other samples are "
                                      "(Tensor[8], Tensor[1])"),
], ids=["None", "another-shape"])
def test_a_sample_unlike_the_others_is_named(tmp_path, odd, said):
    # Each sample loads alone, so the collate's error ("stack expects each tensor to be equal size", "found
    # <class 'NoneType'>") was all the user got, with the batch's 32 indices: now the odd one is named.
    class OneOdd(torch.utils.data.Dataset):
        def __len__(self):
            return N

        def __getitem__(self, i):
            return odd if i == 183 else (torch.full((8,), i / N), torch.ones(1))

    t = trainer(tmp_path, model(), OneOdd())
    with pytest.raises((RuntimeError, TypeError)) as caught:
        t.fit(epochs=1)
    t.close()
    notes = "\n".join(caught.value.__notes__)
    assert f"sample 183 of the dataset loads, but unlike the others: {said}" in notes, notes
    (failed,) = [r for r in journal(tmp_path / "run") if r["kind"] == "fit_failed"]
    assert failed["bad_sample"] == {"index": 183, "error": said}


def test_a_run_whose_checkpoints_are_all_refused_stops_saying_why(tmp_path):
    # One finite outlier (1e20) overflows BatchNorm's running variance; the gradients stay finite, so every step is
    # taken and every checkpoint refused: the old run ended "successfully" with checkpoints/ empty and one line at
    # its first refusal.
    from autotune.run_folder.checkpoint import CheckpointFailed

    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(256, 8, generator=g), torch.randint(0, 2, (256,), generator=g)
    x[5, 3] = 1e20
    m = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 2))
    t = AutoTrainer(m, TensorDataset(x, y), loss_fn=nn.functional.cross_entropy, batch_size=32, device="cpu",
                    progress=False, monitor=False, policies=None, checkpoint_every=4, checkpoint_interval=None,
                    run_dir=tmp_path / "run")
    with pytest.raises(CheckpointFailed, match=r"3 checkpoints in a row were refused: the model's weights are not "
                                               r"finite \(1.running_var"):
        t.fit(epochs=3)
    t.close()
    refused = [r for r in journal(tmp_path / "run") if r["kind"] == "checkpoint_refused"]
    assert [r["step"] for r in refused] == [4, 8, 12]
