"""The step core's failure paths, through AutoTrainer: errors that are OOMs in disguise, an OOM
in optimizer.step(), and cuDNN's NOT_SUPPORTED that may not be about memory at all."""

import json

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
    assert sorted({r["micro_batch_size"] for r in records if r["kind"] == "oom"}) == [2, 8]  # a quarter, then 1 raises
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


# ----------------------------------------------------------------------------- what the step learns
def hungry_above(limit):
    """A step whose memory need exceeds any machine's above `limit` samples: a real allocator refusal."""
    def step(model, micro):
        if len(micro[0]) > limit:
            torch.empty(1 << 55, dtype=torch.uint8)  # DefaultCPUAllocator: can't allocate memory
        return plain(model, micro)
    return step


def weights(net):
    return [p.detach().clone() for p in net.parameters()]


def assert_same(a, b, rtol=1e-5, atol=1e-7):
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, rtol=rtol, atol=atol)


def max_relative_difference(a, b):
    return max(((x - y).abs().max() / y.abs().max()).item() for x, y in zip(a, b))


@pytest.fixture(scope="module")
def causal_lm():
    pytest.importorskip("transformers")
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("hf_causal_lm", Path(__file__).parents[2] / "examples" / "hf_causal_lm.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def train_causal_lm(example, tmp_path, micro, step_fn, name):
    model, train, _, collator = example.build(samples=64, vocab_size=512)
    run = AutoTrainer(model, train, step_fn=step_fn, collate_fn=collator, batch_size=16, micro_batch_size=micro,
                      optimizer=lambda p: torch.optim.SGD(p, lr=0.5), device="cpu", progress=False, monitor=False,
                      policies=[], run_dir=tmp_path / name, shuffle=False)
    run.fit(epochs=1)
    return weights(model)


def test_token_weighted_steps_are_the_same_at_micro_batch_4_and_16(tmp_path, causal_lm):
    # The HF example's model, its collator (a BatchEncoding) and its (loss, n_items) step.
    at_4 = train_causal_lm(causal_lm, tmp_path, 4, causal_lm.step, "items4")
    at_16 = train_causal_lm(causal_lm, tmp_path, 16, causal_lm.step, "items16")
    assert_same(at_4, at_16)
    # Weighted by samples instead (the loss alone), the same two runs learn different weights.
    loss_only = lambda model, batch: causal_lm.step(model, batch)[0]  # noqa: E731
    by_samples = train_causal_lm(causal_lm, tmp_path, 4, loss_only, "samples4")
    assert max_relative_difference(by_samples, at_16) > 1e-3


def hand_loop(clip_norm=None, clip_value=None, epochs=1, precision=None):
    """What the trainer must equal: the whole batch at once, clipped once, stepped."""
    net = model()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    loader = torch.utils.data.DataLoader(data(), batch_size=8, shuffle=False)
    norms = []
    for _ in range(epochs):
        for x, y in loader:
            plain(net, (x, y)).backward()
            if clip_norm is not None:
                norms.append(nn.utils.clip_grad_norm_(net.parameters(), clip_norm).item())
            if clip_value is not None:
                nn.utils.clip_grad_value_(net.parameters(), clip_value)
            opt.step()
            opt.zero_grad()
    return weights(net), norms


@pytest.mark.parametrize("clip", [{"clip_grad_norm": 0.3}, {"clip_grad_value": 0.02}])
def test_clipping_with_accumulation_and_ooms_equals_a_loop_that_clips_the_whole_batch(tmp_path, clip):
    run, net = trainer(tmp_path, hungry_above(2), shuffle=False, policies="default", **clip)
    result = run.fit(epochs=1)
    expected, norms = hand_loop(clip.get("clip_grad_norm"), clip.get("clip_grad_value"))
    assert result.ooms >= 1 and result.micro_batch_size <= 2
    assert_same(weights(net), expected, rtol=1e-5, atol=1e-6)
    unclipped, _ = hand_loop()
    assert max_relative_difference(expected, unclipped) > 1e-3  # the clipping did something
    if norms:
        steps = [json.loads(line) for line in (tmp_path / "run" / "steps.jsonl").read_text().splitlines()]
        assert [s["grad_norm"] for s in steps] == pytest.approx(norms, rel=1e-5)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_runs_resume_exactly(tmp_path, precision):
    def make(name):
        return trainer(tmp_path, plain, name, precision=precision, clip_grad_norm=1.0, shuffle=True, seed=3,
                       optimizer=lambda p: torch.optim.AdamW(p, lr=1e-2))

    whole, whole_net = make("whole")
    whole.fit(epochs=2)
    first, _ = make("halves")
    first.fit(epochs=2, max_steps=5)
    first.close()  # the end checkpoint is on disk once close() returns (written in the background)
    state = torch.load(next((tmp_path / "halves" / "checkpoints").glob("*.pt")), weights_only=True)
    if precision == "fp16":
        assert state["core"]["grad_scaler"]["scale"] > 0  # the loss scale reached travels in the checkpoint
    second, second_net = make("halves")
    second.fit(epochs=2, resume=True)
    assert_same(weights(second_net), weights(whole_net), rtol=0, atol=0)
    assert whole.core.autocast.dtype == {"bf16": torch.bfloat16, "fp16": torch.float16}[precision]


def test_the_autocast_relief_says_it_changes_nothing_when_a_precision_was_chosen(tmp_path):
    from autotune.common.actions import UseAutocast

    run, _ = trainer(tmp_path, plain, precision="bf16")
    assert run.tuner.carry_out(UseAutocast(reason="test"))
    (relief,) = [r for r in journal(tmp_path / "run") if r["kind"] == "relief"]
    assert "changes nothing" in relief["note"] and run.core.autocast.dtype == torch.bfloat16


def test_schedules_by_epoch_and_on_a_plateau(tmp_path):
    by_epoch, _ = trainer(tmp_path, plain, "epoch", scheduler_interval="epoch",
                          scheduler=lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5))
    by_epoch.fit(epochs=3)
    assert by_epoch.optimizer.param_groups[0]["lr"] == pytest.approx(0.1 * 0.5 ** 3)
    # An improvement must beat the best by 10: none after the first evaluation, so the next one cuts the lr.
    plateau = lambda o: torch.optim.lr_scheduler.ReduceLROnPlateau(  # noqa: E731
        o, patience=0, factor=0.1, threshold=10, threshold_mode="abs")
    on_eval, _ = trainer(tmp_path, plain, "plateau", scheduler=plateau, eval_dataset=data(16), eval_every=2)
    on_eval.fit(epochs=1)  # 4 steps: evaluations at 2 and 4
    assert on_eval.optimizer.param_groups[0]["lr"] == pytest.approx(0.01)
    with pytest.raises(ValueError, match="scheduler_metric"):
        trainer(tmp_path, plain, "bad", scheduler=plateau, eval_dataset=data(16), scheduler_metric="accuracy")


@pytest.mark.parametrize("bad, match", [({"precision": "fp8"}, "precision='fp8'"),
                                        ({"clip_grad_norm": 0}, "clip_grad_norm"),
                                        ({"scheduler_interval": "batch"}, "scheduler_interval"),
                                        ({"eval_every": 5}, "eval_every=5 needs eval_dataset"),
                                        ({"metrics": {"loss": len}, "eval_dataset": []}, "other than 'loss'")])
def test_bad_step_options_are_named(tmp_path, bad, match):
    with pytest.raises((ValueError, TypeError), match=match):
        trainer(tmp_path, plain, **bad)


def test_a_step_that_returns_something_else_is_a_clear_error(tmp_path):
    run, _ = trainer(tmp_path, lambda model, micro: (plain(model, micro), "many"))
    with pytest.raises(TypeError, match="n_items must be an int"):
        run.fit(epochs=1)


def test_a_batch_in_one_piece_returns_its_loss_with_no_op_and_pieces_combine_by_weight():
    from autotune.step.losses import Losses, LossSum

    cpu = torch.device("cpu")
    whole = torch.tensor(2.0)
    one = Losses(parts=[(whole, 8)])
    assert one.mean(cpu) is whole and one.weight == 8  # no tensor op for the common batch
    pieces = Losses(parts=[(torch.tensor(1.0), 6), (torch.tensor(4.0), 2)])
    assert pieces.weight == 8 and pieces.total(cpu).item() == 14.0 and pieces.mean(cpu).item() == 1.75
    by_items = Losses(parts=[(torch.tensor(1.0), torch.tensor(3)), (torch.tensor(3.0), torch.tensor(1))])
    assert by_items.mean(cpu).item() == 1.5
    additive = Losses(parts=[(torch.tensor(0.5), 1), (torch.tensor(0.25), 1)], additive=True)
    assert additive.weight == 1 and additive.mean(cpu).item() == 0.75
    assert Losses().weight == 0 and Losses().mean(cpu).item() == 0.0
    epoch = LossSum(cpu, fold_every=2)  # folds after the second batch's parts, and when read
    for losses in (one, pieces, by_items, additive):
        epoch.add(losses)
    assert epoch.weight == 8 + 8 + 4 + 1
    assert epoch.mean() == pytest.approx((16.0 + 14.0 + 6.0 + 0.75) / 21)
    assert LossSum(cpu).mean() is None


@pytest.mark.parametrize("fused, on_nonfinite", [(False, "skip"), (True, "skip"), (False, "stop")])
def test_where_the_check_would_wait_a_fused_optimizer_reads_it_late_and_others_are_told_once(tmp_path, monkeypatch,
                                                                                             fused, on_nonfinite):
    # On CUDA (here: CPU standing in for it) a foreach optimizer's NaN/inf check is read at once, a
    # host-device wait each step: said once at INFO, naming the way out. A fused one needs no wait.
    # on_nonfinite="stop" reads at once whatever the optimizer: nothing to tell.
    from loguru import logger

    from autotune.step import finite as finite_module

    monkeypatch.setattr(finite_module, "READ_LATE_ON", frozenset({"cpu"}))
    said: list[str] = []
    sink = logger.add(lambda message: said.append(message.record["message"]), level="INFO")
    logger.enable("autotune")
    try:
        t, _ = trainer(tmp_path, plain, optimizer=lambda p: torch.optim.SGD(p, lr=0.1, foreach=not fused, fused=fused),
                       on_nonfinite=on_nonfinite)
        with t:
            t.fit(epochs=2)
            late = t.tuner.stepper._late
    finally:
        logger.remove(sink)
        logger.disable("autotune")
    hints = [m for m in said if "fused=True" in m]
    assert (late is not None) == fused
    assert len(hints) == (1 if not fused and on_nonfinite == "skip" else 0), hints
    assert not hints or "SGD step waits for cpu" in hints[0]
