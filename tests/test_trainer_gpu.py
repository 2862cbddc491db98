"""CUDA only (run by `make gpu-check`): a real CUDA OOM under a per-process memory fraction, recovered."""

import dataclasses
from typing import ClassVar

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from autotune import AutoTrainer, Event
from autotune.decisions.policy import PolicyBase
from autotune.tuning.presets import resolve_policies
from tests.conftest import journal

pytestmark = pytest.mark.gpu


def test_real_cuda_oom_is_recovered_with_the_same_weights(tmp_path):
    device = torch.device("cuda", 0)  # set_per_process_memory_fraction wants an index
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(2048, 256, generator=g), torch.randint(0, 8, (2048,), generator=g))

    def run(name, cap_bytes):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(256, 32768), nn.ReLU(), nn.Linear(32768, 8))
        trainer = AutoTrainer(model, data, loss_fn=nn.functional.cross_entropy, batch_size=2048,
                              optimizer=lambda p: torch.optim.SGD(p, lr=0.01), device=device,
                              run_dir=tmp_path / name, progress=False)
        torch.cuda.empty_cache()
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(cap_bytes / total if cap_bytes else 1.0, device)
        try:
            result = trainer.fit(epochs=2)
        finally:
            torch.cuda.set_per_process_memory_fraction(1.0, device)
        return result, {k: v.cpu() for k, v in model.state_dict().items()}

    free, free_weights = run("free", None)
    # activations at 2048 x 32768 floats are 256 MiB each; leave room for ~1/4 of the batch
    base = torch.cuda.memory_allocated(device)
    capped, capped_weights = run("capped", base + 400 * 2**20)
    assert free.ooms == 0 and capped.ooms >= 1 and capped.micro_batch_size < 2048
    assert capped.samples_seen == free.samples_seen == 4096
    assert any(r["kind"] == "oom" and r["device"].startswith("cuda") for r in journal(tmp_path / "capped"))
    for key in free_weights:
        torch.testing.assert_close(free_weights[key], capped_weights[key], rtol=1e-4, atol=1e-5)


def wide(samples):
    """`samples` of 256 features in 8 classes, and a model whose 32768-wide activations fill the memory."""
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(samples, 256, generator=g), torch.randint(0, 8, (samples,), generator=g))
    torch.manual_seed(0)
    return data, nn.Sequential(nn.Linear(256, 32768), nn.ReLU(), nn.Linear(32768, 8))


def test_memory_cap_is_enforced_and_recovered_from(tmp_path):
    device = torch.device("cuda", 0)  # set_per_process_memory_fraction wants an index
    data, model = wide(4096)
    torch.cuda.empty_cache()
    cap = torch.cuda.memory_allocated(device) + 1 * 2**30  # activations at 4096 x 32768 floats need ~1.5 GiB
    peaks = RecordReservedPeaks()
    try:
        trainer = AutoTrainer(model, data, loss_fn=nn.functional.cross_entropy, batch_size=4096, device="cuda",
                              optimizer=lambda p: torch.optim.SGD(p, lr=0.01), memory_cap=cap,
                              run_dir=tmp_path / "run", progress=False, policies=[*resolve_policies("default"), peaks])
        result = trainer.fit(epochs=1)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, device)
    assert result.ooms >= 1 and result.micro_batch_size < 4096 and result.samples_seen == 4096
    # every step's peak, not only the last one's (the trainer resets the allocator's peak each step)
    assert len(peaks.seen) == result.steps and max(peaks.seen) <= cap + 64 * 2**20, peaks.seen


@dataclasses.dataclass
class RecordReservedPeaks(PolicyBase):
    """Keeps each step's reserved-memory peak (CUDA allocator); never acts."""

    name: ClassVar[str] = "record_reserved_peaks"
    events: ClassVar[frozenset] = frozenset({Event.BATCH_END})
    seen: list = dataclasses.field(default_factory=list)

    def decide(self, event, snap):
        self.seen.append(snap.allocator.reserved_peak_bytes)
        return []


def test_close_gives_back_the_memory_fraction_and_bf16_trains(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(64, 8, generator=g), torch.randint(0, 3, (64,), generator=g))
    with AutoTrainer(model, data, loss_fn=nn.functional.cross_entropy, batch_size=16, device="cuda",
                     memory_cap=0.5, precision="bf16", clip_grad_norm=1.0, progress=False,
                     run_dir=tmp_path / "run") as trainer:
        assert torch.cuda.get_per_process_memory_fraction(trainer.device) == pytest.approx(0.5, abs=1e-3)
        result = trainer.fit(epochs=1)
    assert result.samples_seen == 64
    assert torch.cuda.get_per_process_memory_fraction(trainer.device) == 1.0


def test_an_oom_writes_the_allocator_snapshot_and_its_largest_sites(tmp_path):
    import pickle

    from autotune.observe.report import render, summarize

    device = torch.device("cuda", 0)  # set_per_process_memory_fraction wants an index
    data, model = wide(2048)
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated(device)
    total = torch.cuda.get_device_properties(device).total_memory
    trainer = AutoTrainer(model, data, loss_fn=nn.functional.cross_entropy, batch_size=2048, device=device,
                          optimizer=lambda p: torch.optim.SGD(p, lr=0.01), run_dir=tmp_path / "run", progress=False,
                          memory_snapshot=10_000)
    torch.cuda.set_per_process_memory_fraction((base + 400 * 2**20) / total, device)
    try:
        result = trainer.fit(epochs=1)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, device)
    assert result.ooms >= 1
    oom = next(r for r in journal(tmp_path / "run") if r["kind"] == "oom")
    snapshot = oom["memory_snapshot"]
    with open(snapshot["path"], "rb") as f:
        assert pickle.load(f)["segments"]  # what memory_viz reads
    sites = snapshot["largest_sites"]
    assert sites and sites[0]["bytes"] >= 128 * 2**20  # a 2048 x 32768 activation, at least half of one
    assert snapshot["refused"]["bytes"] >= 2**20  # the allocation that failed, from the history
    assert any("test_trainer_gpu.py" in s["site"] or "torch" not in s["site"] for s in sites)
    breakdown = oom["breakdown"]
    assert breakdown["measure"] == "cuda" and breakdown["allocator_cache"] is not None
    assert breakdown["outside_torch"] is not None
    assert "largest sites" in render(summarize(tmp_path / "run"))


@pytest.mark.parametrize("optimizer", ["SGD", "AdamW"])
def test_steady_steps_of_a_fused_optimizer_make_no_host_device_synchronisation(tmp_path, optimizer):
    # The NaN/inf check's flag goes to the fused optimizer as found_inf and is read a step late
    # (finite.py's LateRead); a foreach optimizer's check is read at once, one sync a step.
    device = torch.device("cuda", 0)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 4))
    x, y = torch.randn(32, 64, device=device), torch.randint(0, 4, (32,), device=device)
    from autotune import Tuner

    factory = getattr(torch.optim, optimizer)
    with Tuner(model, lambda p: factory(p, lr=0.01, fused=True), loss_fn=nn.functional.cross_entropy, device=device,
               scheduler=lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda s: 0.99 ** s),
               run_dir=tmp_path / "run", monitor=False) as tuner:
        for _ in range(60):  # past the start's measured steps: the steady state
            tuner.step((x, y))
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            for _ in range(100):  # measured steps (one in 32) among them
                tuner.step((x, y))
        finally:
            torch.cuda.set_sync_debug_mode("default")
        nan = torch.full_like(x, float("nan"))
        tuner.step((nan, y))  # skipped on the device, read at the next step
        tuner.step((x, y))
        assert tuner.step_count == 161
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert tuner.scheduler.last_epoch == 161
    skipped = [r for r in journal(tmp_path / "run") if r["kind"] == "nonfinite"]
    assert [r["at_step"] for r in skipped] == [161]


# Issue 45's fixes, on the card (their CPU tests use scripted figures: tests/fake_cuda.py).
def test_a_dataset_of_cuda_tensors_trains_unpinned_and_cpu_batches_are_pinned(tmp_path):
    device = torch.device("cuda", 0)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(128, 8, generator=g), torch.randint(0, 3, (128,), generator=g)
    for name, data, pinned in (("device", TensorDataset(x.to(device), y.to(device)), False),
                               ("host", TensorDataset(x, y), True)):
        trainer = AutoTrainer(nn.Linear(8, 3), data, loss_fn=nn.functional.cross_entropy, batch_size=32,
                              device=device, progress=False, run_dir=tmp_path / name)
        assert trainer.input.loader.pin_memory is pinned
        assert trainer.fit(epochs=1).samples_seen == 128  # torch's pinning raised on device tensors
        trainer.close()


def test_under_a_memory_cap_the_room_is_counted_in_reserved_bytes_of_the_cap(tmp_path):
    from autotune import Tuner
    from autotune.memory.figures import allocator_stats

    device = torch.device("cuda", 0)
    total = torch.cuda.get_device_properties(device).total_memory
    cap = 2 * 2**30
    with Tuner(nn.Linear(256, 256), loss_fn=nn.functional.mse_loss, device=device, memory_cap=cap,
               run_dir=tmp_path / "run", monitor=False) as tuner:
        x = torch.randn(512, 256, device=device)
        tuner.step((x, x))
        # The fraction counts this process's reserved bytes alone: the context is not taken off it.
        assert abs(tuner.demand.binding_cap - cap) <= total * 1e-6 + 2**20
        memory = tuner.demand.last_memory
        assert memory is not None and 0 < memory.need_bytes < memory.room_bytes <= cap
    stats = allocator_stats(device)  # every figure autotune reads is there in this torch
    assert stats.reserved_bytes >= stats.allocated_bytes >= 0


def test_a_spurious_first_oom_is_retried_at_the_same_size(tmp_path):
    device = torch.device("cuda", 0)
    data, model = wide(1024)
    spiked, calls = [], []

    def step(m, batch):
        calls.append(1)
        if len(calls) == 2 and not spiked:  # the second batch, once: a request larger than the card, a real
            spiked.append(1)                # CUDA OOM at a size that completed a batch, which the retry does not repeat
            torch.empty(2 * torch.cuda.get_device_properties(device).total_memory, dtype=torch.uint8, device=device)
        return nn.functional.cross_entropy(m(batch[0]), batch[1])

    before = torch.cuda.memory_stats(device).get("num_ooms", 0)
    trainer = AutoTrainer(model, data, step_fn=step, batch_size=256, device=device, progress=False,
                          run_dir=tmp_path / "run")
    result = trainer.fit(epochs=1)
    assert result.ooms == 1 == torch.cuda.memory_stats(device)["num_ooms"] - before
    assert result.micro_batch_size == 256 and result.samples_seen == 1024
    kinds = [r["kind"] for r in journal(tmp_path / "run")]
    assert kinds.count("oom_retry") == 1 and "action" not in kinds
