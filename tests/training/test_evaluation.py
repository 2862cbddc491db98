"""Evaluation: its figures are the dataset's means (by items where the step reports them),
its own micro-batch survives OOMs without losing a sample or touching training's."""

import json

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from autotune import AutoTrainer, OutOfMemory
from tests.conftest import journal


def data(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, 8, generator=g), torch.randint(0, 3, (n,), generator=g))


def model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))


def accuracy(outputs, targets):
    return (outputs.argmax(-1) == targets).float().mean()


def trainer(tmp_path, name="run", **kwargs):
    kwargs.setdefault("loss_fn", nn.functional.cross_entropy)
    return AutoTrainer(model(), data(32), batch_size=8, device="cpu", progress=False, monitor=False,
                       optimizer=lambda p: torch.optim.SGD(p, lr=0.1), run_dir=tmp_path / name, **kwargs)


def by_hand(net, dataset):
    x, y = dataset.tensors
    with torch.no_grad():
        out = net(x)
    return {"loss": nn.functional.cross_entropy(out, y).item(), "accuracy": accuracy(out, y).item()}


def test_evaluate_gives_the_means_over_the_whole_dataset_in_eval_mode(tmp_path):
    run = trainer(tmp_path, metrics={"accuracy": accuracy}, eval_batch_size=7)  # 7 does not divide 20
    held_out = data(20, seed=1)
    metrics = run.evaluate(held_out)
    assert metrics == pytest.approx(by_hand(run.model, held_out), rel=1e-6)
    assert run.model.training  # back in train mode
    assert not run.model._forward_hooks  # the output catcher is gone


def test_items_weight_the_eval_loss_and_metrics(tmp_path):
    # Samples carry 1 or 3 "tokens": the mean over tokens is not the mean over samples.
    tokens = torch.tensor([1, 3] * 10)

    def step(model, micro):
        x, y, n = micro
        per_sample = nn.functional.cross_entropy(model(x), y, reduction="none")
        return (per_sample * n).sum() / n.sum(), n.sum()

    x, y = data(20).tensors
    run = AutoTrainer(model(), TensorDataset(x, y, tokens), step_fn=step, batch_size=8, device="cpu", progress=False,
                      monitor=False, run_dir=tmp_path / "run", eval_batch_size=3,
                      metrics={"token_accuracy": lambda out, micro: (
                          ((out.argmax(-1) == micro[1]).float() * micro[2]).sum() / micro[2].sum(), micro[2].sum())})
    metrics = run.evaluate(TensorDataset(x, y, tokens))
    with torch.no_grad():
        out = run.model(x)
    per_sample = nn.functional.cross_entropy(out, y, reduction="none")
    assert metrics["loss"] == pytest.approx(((per_sample * tokens).sum() / tokens.sum()).item(), rel=1e-6)
    right = (out.argmax(-1) == y).float()
    assert metrics["token_accuracy"] == pytest.approx(((right * tokens).sum() / tokens.sum()).item(), rel=1e-6)


def eval_hungry_above(limit):
    """A loss that needs more memory than any machine has above `limit` samples, in evaluation only."""
    def step(model, micro):
        x, y = micro
        if not model.training and len(x) > limit:
            torch.empty(1 << 55, dtype=torch.uint8)  # a real allocator refusal
        return nn.functional.cross_entropy(model(x), y)
    return step


def test_an_oom_in_evaluation_loses_no_sample_and_leaves_training_alone(tmp_path):
    common = dict(eval_dataset=data(24, seed=1), eval_every=2, loss_fn=None,
                  metrics={"accuracy": lambda out, micro: accuracy(out, micro[1])})  # step_fn: the whole micro-batch
    calm = trainer(tmp_path, "calm", step_fn=eval_hungry_above(100), **common)
    calm_result = calm.fit(epochs=1)
    tight = trainer(tmp_path, "tight", step_fn=eval_hungry_above(2), **common)
    result = tight.fit(epochs=1)
    assert result.micro_batch_size == 8 and tight.knobs.micro_batch_size == 8  # training's own, untouched
    assert result.metrics == pytest.approx(calm_result.metrics, rel=1e-6) and set(result.metrics) == {"loss", "accuracy"}
    records = journal(tmp_path / "tight")
    assert [r["micro_batch_size"] for r in records if r["kind"] == "eval_oom"] == [8, 4]  # then 2 fits: remembered
    evaluations = [r for r in records if r["kind"] == "evaluate"]
    assert [r["step"] for r in evaluations] == [2, 4] and all(r["samples"] == 24 for r in evaluations)
    assert [r["micro_batch_size"] for r in evaluations] == [2, 2]
    assert not [r for r in records if r["kind"] == "oom"]


def test_an_oom_in_evaluation_at_one_sample_checkpoints_then_raises(tmp_path):
    run = trainer(tmp_path, step_fn=eval_hungry_above(0), loss_fn=None, eval_dataset=data(4), eval_every="epoch")
    with pytest.raises(OutOfMemory, match="in evaluation.*micro-batch 1"):
        run.fit(epochs=1)
    assert [r["reason"] for r in journal(tmp_path / "run") if r["kind"] == "checkpoint"][-1] == "out_of_memory"


def test_evaluations_go_to_the_journal_tensorboard_and_the_fit_result(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = trainer(tmp_path, eval_dataset=data(16, seed=2), metrics={"accuracy": accuracy}, tensorboard=True)
    result = run.fit(epochs=2)  # eval_every defaults to each epoch
    evaluations = [r for r in journal(tmp_path / "run") if r["kind"] == "evaluate"]
    assert [r["step"] for r in evaluations] == [4, 8]
    assert result.metrics == evaluations[-1]["metrics"] == pytest.approx(by_hand(run.model, data(16, seed=2)))
    run.close()
    events = EventAccumulator(str(tmp_path / "run" / "tb")).Reload()
    assert [e.step for e in events.Scalars("eval/loss")] == [4, 8]
    assert "eval/accuracy" in events.Tags()["scalars"]
    fit_end = [r for r in journal(tmp_path / "run") if r["kind"] == "fit_end"][-1]
    assert json.dumps(fit_end["metrics"]) == json.dumps(result.metrics)


def test_the_report_shows_evaluations_and_their_ooms(tmp_path):
    from autotune.observe.report import render, summarize

    run = trainer(tmp_path, step_fn=eval_hungry_above(2), loss_fn=None, eval_dataset=data(8, seed=1), eval_every=2)
    run.fit(epochs=1)
    summary = summarize(tmp_path / "run")
    assert [e["step"] for e in summary["evaluations"]] == [2, 4]
    text = render(summary)
    assert "evaluations: 2 (2 OOMs survived in them, eval micro-batch 2)" in text and "step 4: loss " in text


def test_the_eval_micro_batch_grows_back_and_retries_a_failed_size_only_after_a_while(tmp_path):
    spikes = iter([True])  # size 4 fails once (a passing spike); 8 never fits

    def step(model, micro):
        x, y = micro
        if not model.training and (len(x) >= 8 or (len(x) == 4 and next(spikes, False))):
            torch.empty(1 << 55, dtype=torch.uint8)  # a real allocator refusal
        return nn.functional.cross_entropy(model(x), y)

    run = trainer(tmp_path, step_fn=step, loss_fn=None, eval_batch_size=8)
    run.evaluator.grow_after, run.evaluator.forget_after = 4, 12
    metrics = run.evaluate(data(96, seed=1))
    sizes = [r["micro_batch_size"] for r in journal(tmp_path / "run") if r["kind"] == "eval_oom"]
    # 4 again only 12 micro-batches after it failed; then 8, which still fails, tried again each 12
    assert sizes[:3] == [8, 4, 8] and set(sizes[3:]) <= {8} and len(sizes) <= 4
    assert run.evaluator.micro_batch_size == 4
    plain = trainer(tmp_path, "plain", step_fn=lambda m, b: nn.functional.cross_entropy(m(b[0]), b[1]), loss_fn=None)
    assert metrics == pytest.approx(plain.evaluate(data(96, seed=1)), rel=1e-6)  # nothing lost or repeated


def test_a_step_fn_handing_back_a_step_result_is_evaluated_too(tmp_path):
    # StepResult (loss and outputs) from the same step_fn AutoTrainer trains and evaluates with.
    import torch
    from torch import nn
    from torch.utils.data import TensorDataset

    from autotune import AutoTrainer, StepResult

    def step_fn(model, micro):
        x, y = micro
        out = model(x)
        return StepResult(nn.functional.mse_loss(out, y), outputs=out)

    torch.manual_seed(0)
    data = TensorDataset(torch.randn(32, 4), torch.randn(32, 1))
    with AutoTrainer(nn.Linear(4, 1), data, step_fn=step_fn, batch_size=8, device="cpu", run_dir=tmp_path,
                     monitor=False, progress=False, eval_dataset=data) as trainer:
        metrics = trainer.fit(epochs=1).metrics
        assert trainer.outputs.shape == (8, 1)
        with torch.no_grad():
            expected = nn.functional.mse_loss(trainer.model(data.tensors[0]), data.tensors[1]).item()
    assert abs(metrics["loss"] - expected) < 1e-5
