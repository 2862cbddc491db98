"""Tensors in memory fetched a batch at a time (autotune/data/tensors.py): the same batches as the
DataLoader's own per-sample path, and no loader-worker trial a fast loop over them cannot win."""

import torch
from torch import nn
from torch.utils.data import DataLoader, Subset, TensorDataset

from autotune import AutoTrainer
from autotune.data.sampler import EpochSampler
from autotune.data.tensors import batched_view, take_batch
from tests.conftest import journal


def tensors(n=100):
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(n, 3, 4, generator=g), torch.randint(0, 10, (n,), generator=g),
                         torch.randn(n, generator=g).double())


def batches(dataset, collate_fn=None, num_workers=0):
    sampler = EpochSampler(len(dataset), shuffle=True, seed=3, batch_size=16)
    return list(DataLoader(dataset, batch_size=16, sampler=sampler, collate_fn=collate_fn, num_workers=num_workers))


def assert_same(left, right):
    assert len(left) == len(right)
    for a, b in zip(left, right):
        assert type(a) is type(b) and len(a) == len(b)
        for x, y in zip(a, b):
            assert x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y)


def test_a_gathered_batch_is_the_batch_default_collate_makes():
    dataset = tensors()
    assert_same(batches(batched_view(dataset), take_batch), batches(dataset))
    subset = Subset(Subset(dataset, list(range(90, 0, -1))), list(range(0, 80, 2)))
    assert_same(batches(batched_view(subset), take_batch), batches(subset))
    assert_same(batches(batched_view(dataset), take_batch, num_workers=1), batches(dataset))  # in a worker too


def test_other_datasets_are_fetched_as_before():
    assert batched_view([torch.zeros(2)] * 4) is None
    assert batched_view(Subset(list(range(8)), [1, 2])) is None


def test_a_fast_loop_over_tensors_in_memory_starts_no_loader_worker_trial(tmp_path):
    # Rows of 2048 floats and a one-layer model: fetched a sample at a time, the loop waits on the
    # loader for most of each step (input-bound at once: the default preset's tune_workers started
    # a worker trial in the first window, and went back when it lost).
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(4096, 2048, generator=g), torch.randint(0, 4, (4096,), generator=g))
    torch.manual_seed(0)
    model = nn.Linear(2048, 4)
    trainer = AutoTrainer(model, data, loss_fn=nn.functional.cross_entropy, batch_size=128, device="cpu",
                          progress=False, monitor=False, checkpoint_interval=None, run_dir=tmp_path / "run")
    result = trainer.fit(epochs=2)
    trainer.close()
    assert result.samples_seen == 2 * 4096
    records = journal(tmp_path / "run")
    assert [r for r in records if r["kind"] == "loader_rebuilt"] == []
    assert [r for r in records if r["kind"] == "action" and r.get("policy") == "tune_workers"] == []


def test_on_cuda_batches_already_on_a_device_are_not_pinned():
    # torch's pinning raises "cannot pin 'torch.cuda.FloatTensor'" on a tensor already on the device;
    # "meta" tensors stand in for CUDA ones here (neither is in host memory).
    from autotune.data.pipeline import InputPipeline, batches_on_host
    from autotune.ranks.distributed import Solo

    assert batches_on_host({"x": [torch.zeros(2)], "y": (torch.zeros(1), 3)})
    assert not batches_on_host([torch.zeros(2), {"y": torch.zeros(1, device="meta")}])

    def pins(dataset, collate_fn=None):
        return InputPipeline(dataset, batch_size=4, shuffle=False, seed=0, num_workers=0, collate_fn=collate_fn,
                             device=torch.device("cuda", 0), ranks=Solo()).loader.pin_memory

    on_host = tensors(8)
    assert pins(on_host)
    assert not pins(TensorDataset(torch.zeros(8, 2, device="meta")))
    assert not pins(on_host, collate_fn=lambda rows: [torch.zeros(4, device="meta")])  # a collate that moves them
    assert not InputPipeline(on_host, batch_size=4, shuffle=False, seed=0, num_workers=0, collate_fn=None,
                             device=torch.device("cpu"), ranks=Solo()).loader.pin_memory
