"""AutoTrainer without memory pressure: input checks, and equality with a plain PyTorch loop."""


import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

from autotune import AutoTrainer
from tests.conftest import journal


def make_data(n=64, features=8, classes=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, features, generator=g), torch.randint(0, classes, (n,), generator=g))


def make_model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))


def sgd(params):
    return torch.optim.SGD(params, lr=0.1)


def trainer(tmp_path, model=None, data=None, **kwargs):
    kwargs.setdefault("loss_fn", nn.functional.cross_entropy)
    kwargs.setdefault("optimizer", sgd)
    kwargs.setdefault("device", "cpu")
    kwargs.setdefault("progress", False)
    return AutoTrainer(make_model() if model is None else model, make_data() if data is None else data,
                       run_dir=tmp_path / "run", **kwargs)


def plain_loop(model, data, batch_size, epochs):
    optimizer = sgd(model.parameters())
    for _ in range(epochs):
        for x, y in DataLoader(data, batch_size=batch_size, shuffle=False):
            nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
            optimizer.zero_grad()
    return model


def test_matches_a_hand_written_loop(tmp_path):
    data = make_data()
    expected = plain_loop(make_model(), data, batch_size=16, epochs=2)
    t = trainer(tmp_path, data=data, batch_size=16, shuffle=False)
    result = t.fit(epochs=2)
    for a, b in zip(t.model.parameters(), expected.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert result.samples_seen == 128 and result.steps == 8 and result.epochs == 2


def test_accumulating_micro_batches_matches_the_whole_batch(tmp_path):
    data = make_data(n=60)
    whole = trainer(tmp_path / "a", data=data, batch_size=20, shuffle=False)
    whole.fit(epochs=2)
    # No policies: fit_micro_batch would (rightly) grow the micro-batch of 7 that this test keeps
    micro = trainer(tmp_path / "b", data=data, batch_size=20, micro_batch_size=7, shuffle=False, policies=[])
    result = micro.fit(epochs=2)
    for a, b in zip(whole.model.parameters(), micro.model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert result.batch_size == 20 and result.micro_batch_size == 7 and result.steps == 6


def test_without_keep_effective_batch_each_micro_batch_is_a_step(tmp_path):
    t = trainer(tmp_path, data=make_data(n=50), batch_size=20, micro_batch_size=8, keep_effective_batch=False,
                policies=[])  # the size stays 8 (fit_micro_batch would grow it)
    result = t.fit(epochs=1)
    # batches of 20, 20, 10 -> chunks of 8, 8, 4, 8, 8, 4, 8, 2
    assert result.steps == 8 and result.samples_seen == 50 and result.batch_size == 8
    # ... with the weights of a hand loop that steps every chunk on its own mean loss (issue 46: a
    # mutation zeroing the gradients of those steps passed every test before)
    data, hand = make_data(n=50), make_model()
    optimizer = sgd(hand.parameters())
    for x, y in DataLoader(data, batch_size=20, shuffle=False):
        for a in range(0, len(y), 8):
            nn.functional.cross_entropy(hand(x[a:a + 8]), y[a:a + 8]).backward()
            optimizer.step()
            optimizer.zero_grad()
    t = trainer(tmp_path / "unshuffled", data=data, batch_size=20, micro_batch_size=8, keep_effective_batch=False,
                policies=[], shuffle=False)
    t.fit(epochs=1)
    for a, b in zip(t.model.parameters(), hand.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_shuffled_order_depends_only_on_seed_and_epoch(tmp_path):
    a = trainer(tmp_path / "a", seed=3)
    b = trainer(tmp_path / "b", seed=3)
    a.fit(epochs=2)
    b.fit(epochs=2)
    for p, q in zip(a.model.parameters(), b.model.parameters()):
        assert torch.equal(p, q)
    c = trainer(tmp_path / "c", seed=4)
    c.fit(epochs=1)
    assert not torch.equal(next(iter(c.model.parameters())), next(iter(a.model.parameters())))


def test_step_fn_with_dict_batches(tmp_path):
    class Dicts(Dataset):
        def __len__(self):
            return 10

        def __getitem__(self, i):
            return {"x": torch.full((8,), float(i)), "y": torch.tensor(i % 3), "name": f"s{i}"}

    seen = []

    def step(model, micro):
        seen.extend(micro["name"])
        return nn.functional.cross_entropy(model(micro["x"]), micro["y"])

    result = trainer(tmp_path, data=Dicts(), loss_fn=None, step_fn=step, batch_size=4, micro_batch_size=3).fit()
    assert sorted(seen) == sorted(f"s{i}" for i in range(10)) and result.samples_seen == 10


def test_dataloader_batch_size_is_the_batch(tmp_path):
    loader = DataLoader(make_data(n=30), batch_size=10)
    result = trainer(tmp_path, data=loader, batch_size=999).fit()
    assert result.batch_size == 10 and result.steps == 3


def test_max_steps_stops_early(tmp_path):
    result = trainer(tmp_path, batch_size=8).fit(epochs=3, max_steps=5)
    assert result.steps == 5 and result.samples_seen == 40 and result.epochs == 0


def test_journal_records_the_run(tmp_path):
    trainer(tmp_path, batch_size=16).fit(epochs=2)
    kinds = [r["kind"] for r in journal(tmp_path / "run")]
    # The end checkpoint is written in the background and journaled once on disk: before or after
    # fit_end, whichever comes first.
    assert kinds[0] == "fit_start" and sorted(kinds[-2:]) == ["checkpoint", "fit_end"]
    assert kinds.count("epoch_end") == 2
    for record in journal(tmp_path / "run"):
        assert {"time", "kind", "step", "epoch"} <= set(record)


@pytest.mark.parametrize("kwargs, error, match", [
    ({"batch_size": 0}, ValueError, "batch_size"),
    ({"batch_size": 4, "micro_batch_size": 8}, ValueError, "cannot exceed"),
    ({"micro_batch_size": 0}, ValueError, "micro_batch_size"),
    ({"loss_fn": None}, ValueError, "loss_fn"),
    ({"step_fn": lambda m, b: m(b).sum()}, ValueError, "exactly one"),
    ({"device": "tpu:7"}, ValueError, "device"),
    ({"device": "banana"}, ValueError, "unknown device"),
    ({"policies": "no-such-preset"}, ValueError, "unknown preset 'no-such-preset'; choices: conservative, default, throughput"),
    ({"optimizer": 3}, TypeError, "optimizer"),
    ({"memory_cap": 1.5}, ValueError, r"memory_cap=1.5: a fraction must be in \(0, 1\]"),
    ({"memory_cap": "lots"}, ValueError, "memory_cap: 'lots' is not a size"),
    ({"memory_cap": "12 parsecs"}, ValueError, "unknown unit 'parsecs'"),
    ({"memory_cap": 10**18}, ValueError, "is more than the cpu has"),
    ({"micro_batch_size": "big"}, ValueError, "micro_batch_size must be an integer >= 1"),
])
def test_bad_input_is_a_clear_error(tmp_path, kwargs, error, match):
    with pytest.raises(error, match=match):
        trainer(tmp_path, **kwargs)


def test_cuda_without_a_gpu_is_a_clear_error(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(ValueError, match="CUDA is not available"):
        trainer(tmp_path, device="cuda")


def test_empty_dataset_is_an_error(tmp_path):
    with pytest.raises(ValueError, match="empty"):
        trainer(tmp_path, data=TensorDataset(torch.zeros(0, 8), torch.zeros(0)))


def test_optimizer_over_other_parameters_is_an_error(tmp_path):
    other = make_model(seed=1)
    with pytest.raises(ValueError, match="not the model's"):
        trainer(tmp_path, optimizer=torch.optim.SGD(other.parameters(), lr=0.1))


def test_wrong_sample_layout_for_loss_fn_is_an_error(tmp_path):
    class Triples(Dataset):
        def __len__(self):
            return 4

        def __getitem__(self, i):
            return torch.zeros(8), 0, "extra"

    with pytest.raises(TypeError, match=r"\(inputs, targets\)"):
        trainer(tmp_path, data=Triples())


def test_non_oom_errors_propagate_untouched(tmp_path):
    def broken(model, batch):
        raise RuntimeError("mat1 and mat2 shapes cannot be multiplied")

    t = trainer(tmp_path, loss_fn=None, step_fn=broken)
    with pytest.raises(RuntimeError, match="shapes cannot be multiplied"):
        t.fit()
    assert not [r for r in journal(tmp_path / "run") if r["kind"] == "oom"]


def test_a_failed_fit_is_journaled(tmp_path):
    def broken(model, batch):
        raise ValueError("user bug")

    with pytest.raises(ValueError):
        trainer(tmp_path, loss_fn=None, step_fn=broken).fit()
    last = journal(tmp_path / "run")[-1]
    assert last["kind"] == "fit_failed" and "ValueError: user bug" in last["error"]


def test_dataloader_with_another_layout_and_loss_fn_is_a_clear_error(tmp_path):
    loader = DataLoader([{"x": torch.zeros(8)} for _ in range(4)], batch_size=2)
    with pytest.raises(TypeError, match=r"must be \(inputs, targets\); got dict"):
        trainer(tmp_path, data=loader).fit()


def test_memory_cap_becomes_the_soft_cap_on_cpu(tmp_path):
    t = trainer(tmp_path, memory_cap="1GiB")
    assert t.knobs.memory_cap_bytes == 2**30
    assert trainer(tmp_path, memory_cap=0.5).knobs.memory_cap_bytes > 0


def test_auto_micro_batch_starts_at_the_batch(tmp_path):
    assert trainer(tmp_path, batch_size=16, micro_batch_size="auto").knobs.micro_batch_size == 16


@pytest.mark.parametrize("kwargs", [
    {"batch_size": True}, {"micro_batch_size": True}, {"num_workers": True}, {"checkpoint_every": True},
    {"checkpoint_interval": True}, {"keep_checkpoints": True}, {"monitor_interval": True}, {"seed": True},
    {"checkpoint_every": 2.5},
])
def test_a_bool_or_a_float_where_a_count_is_asked_for_is_refused(tmp_path, kwargs):
    (name, value), = kwargs.items()
    with pytest.raises(ValueError, match=f"{name} must be .*got {value!r}"):
        trainer(tmp_path, **kwargs)


@pytest.mark.parametrize("kwargs", [{"max_steps": True}, {"epochs": True}, {"max_steps": 0}, {"epochs": 1.0}])
def test_fit_refuses_a_bool_or_a_non_integer_count(tmp_path, kwargs):
    (name, value), = kwargs.items()
    with pytest.raises(ValueError, match=f"{name} must be an integer >= 1.*got {value!r}"):
        trainer(tmp_path, monitor=False).fit(**kwargs)


def test_checkpoint_every_n_steps_writes_at_n_2n_3n(tmp_path):
    t = trainer(tmp_path, batch_size=4, checkpoint_every=4, checkpoint_interval=None, monitor=False)
    t.fit(max_steps=12)
    every = [r["step"] for r in journal(tmp_path / "run") if r["kind"] == "checkpoint" and r["reason"] == "every"]
    assert every == [4, 8, 12]


def test_a_dropped_trainer_is_freed_at_once(tmp_path):
    # No reference cycles between the trainer and its parts: a trainer (with its optimizer state)
    # that a script drops must not wait for the garbage collector, which fit() freezes.
    import gc
    import weakref

    t = trainer(tmp_path, monitor=False)
    t.fit(max_steps=2)
    gone = weakref.ref(t.optimizer)
    gc.disable()
    try:
        del t
        assert gone() is None
    finally:
        gc.enable()


def test_a_negative_seed_is_still_a_seed(tmp_path):
    assert trainer(tmp_path, seed=-3, monitor=False).fit(max_steps=1).steps == 1


def test_a_detection_style_batch_is_split_by_sample(tmp_path):
    # torchvision's detection references collate with tuple(zip(*batch)): images of different
    # sizes and per-image target dicts. A tiny "detector" pools each image and regresses a box.
    class Images(Dataset):
        def __len__(self):
            return 24

        def __getitem__(self, i):
            g = torch.Generator().manual_seed(i)
            image = torch.rand(3, 8 + i % 5, 10 - i % 3, generator=g)
            boxes = torch.rand(1 + i % 3, 4, generator=g)
            return image, {"boxes": boxes, "labels": torch.ones(len(boxes), dtype=torch.int64)}

    def step(model, micro):
        images, targets = micro
        if len(images) > 2:
            torch.empty(1 << 55, dtype=torch.uint8)  # a real allocator refusal above 2 images
        losses = [nn.functional.mse_loss(model(img.mean((1, 2))).expand_as(t["boxes"]), t["boxes"])
                  for img, t in zip(images, targets)]
        return torch.stack(losses).mean()

    def run(name, micro=None):
        torch.manual_seed(0)
        net = nn.Linear(3, 4)
        trainer = AutoTrainer(net, Images(), step_fn=step, collate_fn=lambda batch: tuple(zip(*batch)),
                              batch_size=8, micro_batch_size=micro, device="cpu", progress=False, monitor=False,
                              optimizer=sgd, run_dir=tmp_path / name, shuffle=False)
        return trainer.fit(epochs=1), net

    result, net = run("ooms")
    _, reference = run("reference", micro=2)
    assert result.ooms >= 1 and result.samples_seen == 24
    for a, b in zip(net.parameters(), reference.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_resume_from_a_named_checkpoint_file(tmp_path):
    run = trainer(tmp_path, checkpoint_every=2, batch_size=8)
    run.fit(epochs=1, max_steps=6)
    path = run.run_dir / "checkpoints" / "step-000000004.pt"
    assert path.exists(), sorted(p.name for p in path.parent.iterdir())
    whole = trainer(tmp_path / "whole", batch_size=8)
    whole.fit(epochs=1)
    again = trainer(tmp_path / "again", batch_size=8)
    again.fit(epochs=1, resume=path)
    assert again.samples_seen == whole.samples_seen
    for a, b in zip(again.model.parameters(), whole.model.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    with pytest.raises(FileNotFoundError, match="step-99.pt"):
        trainer(tmp_path / "missing").fit(resume=tmp_path / "step-99.pt")


def test_close_leaves_the_model_as_given_and_the_journal_closed(tmp_path):
    net = make_model()
    with trainer(tmp_path, model=net) as run:
        assert net._forward_pre_hooks  # the input catcher (for pruning), until the first forward
        run.fit(epochs=1)
        assert not net._forward_pre_hooks  # it took the inputs and itself off: hooks slow every call
        assert run.tuner.ladder._inputs.example is not None
    assert not net._forward_pre_hooks and not net._forward_hooks
    assert run.log.journal._file is None
    with pytest.raises(RuntimeError, match="closed"):
        run.fit(epochs=1)
    run.close()  # again: nothing to do
