"""Callbacks: an EMA of the weights, early stopping on the eval loss and a logger, each
surviving a resume; request_stop ends the fit with a checkpoint."""

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from autotune import AutoTrainer
from autotune.training.callbacks import Callback
from tests.conftest import journal


def data(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, 8, generator=g), torch.randint(0, 3, (n,), generator=g))


def trainer(tmp_path, callbacks, name="run", **kwargs):
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3))
    kwargs.setdefault("optimizer", lambda p: torch.optim.SGD(p, lr=0.1))
    return AutoTrainer(net, data(64), loss_fn=nn.functional.cross_entropy, batch_size=8, device="cpu",
                       progress=False, monitor=False, run_dir=tmp_path / name, callbacks=callbacks, **kwargs)


class EMA(Callback):
    """An exponential moving average of the weights, updated after every optimizer step."""

    def __init__(self, decay=0.9):
        self.decay, self.shadow = decay, None

    def on_step_end(self, trainer):
        params = [p.detach() for p in trainer.model.parameters()]
        if self.shadow is None:
            self.shadow = [p.clone() for p in params]
        else:
            torch._foreach_lerp_(self.shadow, params, 1 - self.decay)

    def state_dict(self):
        return {"shadow": self.shadow}

    def load_state_dict(self, state):
        self.shadow = state["shadow"]


class EarlyStopping:
    """Stop when the eval loss has not improved for `patience` evaluations (no base class: duck typing)."""

    def __init__(self, patience):
        self.patience, self.best, self.bad = patience, float("inf"), 0

    def on_evaluate(self, trainer, metrics):
        if metrics["loss"] < self.best - 1e-9:
            self.best, self.bad = metrics["loss"], 0
        else:
            self.bad += 1
            if self.bad >= self.patience:
                trainer.request_stop(f"eval loss has not improved for {self.bad} evaluations")

    def state_dict(self):
        return {"best": self.best, "bad": self.bad}

    def load_state_dict(self, state):
        self.best, self.bad = state["best"], state["bad"]


class Logger(Callback):
    def __init__(self):
        self.lines = []

    def on_fit_start(self, trainer):
        self.lines.append(("start", trainer.step))

    def on_epoch_end(self, trainer):
        self.lines.append(("epoch", trainer.epoch))

    def on_evaluate(self, trainer, metrics):
        self.lines.append(("eval", trainer.step, round(metrics["loss"], 6)))

    def on_fit_end(self, trainer, result):
        self.lines.append(("end", result.steps))


def test_an_ema_of_the_weights_survives_a_resume(tmp_path):
    whole = EMA()
    trainer(tmp_path, [whole], "whole", shuffle=True).fit(epochs=2)
    first = EMA()
    trainer(tmp_path, [first], "halves", shuffle=True).fit(epochs=2, max_steps=11)
    resumed = EMA()
    trainer(tmp_path, [resumed], "halves", shuffle=True).fit(epochs=2, resume=True)
    for a, b in zip(resumed.shadow, whole.shadow):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_early_stopping_on_the_eval_loss_stops_with_a_checkpoint_and_survives_a_resume(tmp_path):
    # lr 3 makes the eval loss worse: no improvement after the first evaluation.
    stop = EarlyStopping(patience=2)
    run = trainer(tmp_path, [stop], eval_dataset=data(16, 1), eval_every=2,
                  optimizer=lambda p: torch.optim.SGD(p, lr=3.0))
    result = run.fit(epochs=3)
    assert result.stopped and "not improved for 2" in result.stopped and result.steps == 6
    records = journal(tmp_path / "run")
    assert [r["reason"] for r in records if r["kind"] == "checkpoint"][-1] == "stop_requested"
    assert [r["kind"] for r in records].count("stop_requested") == 1
    again = EarlyStopping(patience=2)
    trainer(tmp_path, [again], eval_dataset=data(16, 1), eval_every=2,
            optimizer=lambda p: torch.optim.SGD(p, lr=3.0)).fit(epochs=3, resume=True, max_steps=6)
    assert (again.best, again.bad) == (stop.best, stop.bad)


def test_a_logger_sees_every_hook_in_order(tmp_path):
    log = Logger()
    trainer(tmp_path, [log], eval_dataset=data(16, 1)).fit(epochs=2)
    kinds = [line[0] for line in log.lines]
    assert kinds == ["start", "eval", "epoch", "eval", "epoch", "end"]
    assert log.lines[1][1] == 8 and log.lines[-1] == ("end", 16)


def test_a_callback_without_hooks_is_refused_by_name(tmp_path):
    with pytest.raises(TypeError, match=r"callbacks\[0\] \(object\) has none of the hooks"):
        trainer(tmp_path, [object()])


def test_resuming_with_other_callbacks_is_a_clear_error(tmp_path):
    trainer(tmp_path, [EMA()]).fit(epochs=1, max_steps=2)
    with pytest.raises(ValueError, match="no state for callback 0:EarlyStopping"):
        trainer(tmp_path, [EarlyStopping(1)], eval_dataset=data(8)).fit(epochs=1, resume=True)
