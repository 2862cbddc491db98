"""The step core's failure paths, through AutoTrainer: errors that are OOMs in disguise, an OOM
in optimizer.step(), and cuDNN's NOT_SUPPORTED that may not be about memory at all."""

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from autotune import AutoTrainer, OutOfMemory
from tests.conftest import journal


def data(n=32):
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(n, 8, generator=g), torch.randint(0, 3, (n,), generator=g))


def model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))


def trainer(tmp_path, step_fn, name="run", optimizer=None, **kwargs):
    net = model()
    return AutoTrainer(net, data(), step_fn=step_fn, batch_size=8, device="cpu", progress=False, monitor=False,
                       optimizer=optimizer or (lambda p: torch.optim.SGD(p, lr=0.1)), run_dir=tmp_path / name,
                       **kwargs), net


def plain(model, micro):
    x, y = micro
    return nn.functional.cross_entropy(model(x), y)


def test_an_oom_that_torch_compile_wraps_is_survived_with_the_same_weights(tmp_path):
    from torch._dynamo.exc import InternalTorchDynamoError

    def compiled_like(model, micro):
        if len(micro[0]) > 2:
            try:
                bytearray(1 << 60)  # a real MemoryError, as a compiled graph's allocation raises it
            except MemoryError as exc:
                raise InternalTorchDynamoError("MemoryError: std::bad_alloc") from exc
        return plain(model, micro)

    capped, capped_model = trainer(tmp_path, compiled_like, "capped")
    result = capped.fit(epochs=2)
    reference, reference_model = trainer(tmp_path, plain, "reference", micro_batch_size=2)
    reference.fit(epochs=2)
    assert result.ooms >= 1 and result.micro_batch_size <= 2 and result.samples_seen == 64
    for a, b in zip(capped_model.parameters(), reference_model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


class StepRunsOutAt(torch.optim.SGD):
    """SGD whose `fail_at`-th step asks for memory no machine has: a real, message-less MemoryError."""

    def __init__(self, params, fail_at):
        super().__init__(params, lr=0.1)
        self.fail_at, self.steps = fail_at, 0

    def step(self, closure=None):
        self.steps += 1
        if self.steps == self.fail_at:
            bytearray(1 << 60)
        return super().step(closure)


def test_an_oom_in_optimizer_step_with_no_message_is_a_clear_out_of_memory(tmp_path):
    run, _ = trainer(tmp_path, plain, optimizer=lambda p: StepRunsOutAt(p, fail_at=3))
    with pytest.raises(OutOfMemory, match=r"in optimizer.step\(\).*MemoryError"):
        run.fit(epochs=1)
    records = journal(tmp_path / "run")
    gave_up = [r for r in records if r["kind"] == "out_of_memory"]
    assert gave_up and gave_up[0]["phase"] == "optimizer_step" and gave_up[0]["step"] == 2
    assert not [r for r in records if r["kind"] == "oom"]  # not retried: a smaller micro-batch cannot help
    assert [r for r in records if r["kind"] == "checkpoint"][-1]["reason"] == "out_of_memory"


NOT_SUPPORTED = "cuDNN error: CUDNN_STATUS_NOT_SUPPORTED. This error may appear if you passed in a non-contiguous input."


def test_cudnn_not_supported_is_halved_like_an_oom(tmp_path):
    def picky(model, micro):
        if len(micro[0]) > 2:
            raise RuntimeError(NOT_SUPPORTED)
        return plain(model, micro)

    run, _ = trainer(tmp_path, picky)
    result = run.fit(epochs=1)
    assert result.micro_batch_size == 2 and result.samples_seen == 32


def test_cudnn_not_supported_at_every_size_is_the_original_error_not_a_relief(tmp_path):
    def never(model, micro):
        raise RuntimeError(NOT_SUPPORTED)

    run, net = trainer(tmp_path, never)  # the default preset: its relief ladder must not be climbed
    shapes = [p.shape for p in net.parameters()]
    with pytest.raises(RuntimeError, match="CUDNN_STATUS_NOT_SUPPORTED") as info:
        run.fit(epochs=1)
    assert not isinstance(info.value, OutOfMemory)
    records = journal(tmp_path / "run")
    assert sorted({r["micro_batch_size"] for r in records if r["kind"] == "oom"}) == [2, 4, 8]
    assert not [r for r in records if r["kind"] in ("relief", "relief_failed", "out_of_memory")]
    assert [p.shape for p in net.parameters()] == shapes and run.reliefs == []


def test_cudnn_not_supported_above_a_floor_of_its_own_is_the_original_error_too(tmp_path):
    from autotune.policies import AutocastNearCap, HalveOnOOM

    def never(model, micro):
        raise RuntimeError(NOT_SUPPORTED)

    run, _ = trainer(tmp_path, never, policies=[HalveOnOOM(min_micro_batch=4), AutocastNearCap(floor_micro_batch=4)])
    with pytest.raises(RuntimeError, match="CUDNN_STATUS_NOT_SUPPORTED") as info:
        run.fit(epochs=1)
    assert not isinstance(info.value, OutOfMemory) and run.reliefs == []
