"""Fault injection: fake OOMs through the same path as real ones."""

import dataclasses
from typing import ClassVar

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from autotune import AutoTrainer, Event, SetMicroBatch
from autotune.policies import HalveOnOOM
from tests.conftest import journal


@dataclasses.dataclass
class BackToFullBatch:
    """Test policy: after every batch, back to the whole batch, so injected OOMs keep coming."""

    name: ClassVar[str] = "back_to_full_batch"
    events: ClassVar[frozenset] = frozenset({Event.BATCH_END})

    def decide(self, event, snap):
        return [SetMicroBatch(snap.batch_size, reason="test: start every batch whole")]

    def state_dict(self):
        return {}

    def load_state_dict(self, state):
        return None


def train(tmp_path, name, inject):
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(1280, 16, generator=g), torch.randint(0, 4, (1280,), generator=g))
    model = nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 4))
    trainer = AutoTrainer(model, data, loss_fn=nn.functional.cross_entropy, batch_size=64, device="cpu",
                          optimizer=lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), inject_oom=inject,
                          policies=[HalveOnOOM(), BackToFullBatch()], run_dir=tmp_path / name, progress=False,
                          monitor=False)
    return trainer.fit(epochs=3), model


@pytest.mark.slow
def test_fifty_injected_ooms_change_nothing(tmp_path):
    clean, clean_model = train(tmp_path, "clean", 0.0)
    faulty, faulty_model = train(tmp_path, "faulty", 0.5)
    injected = [r for r in journal(tmp_path / "faulty") if r["kind"] == "oom"]
    assert len(injected) >= 50 and all(r["injected"] for r in injected)
    assert {"forward", "before backward"} <= {("forward" if "in forward" in r["message"] else "before backward")
                                               for r in injected}
    assert faulty.ooms == len(injected) and faulty.samples_seen == clean.samples_seen == 1280 * 3
    for a, b in zip(clean_model.parameters(), faulty_model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_the_environment_variable_turns_it_on(tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOTUNE_INJECT_OOM", "0.5")
    result, _ = train(tmp_path, "env", None)
    assert result.ooms > 0


@pytest.mark.parametrize("value", ["often", "1.5", "-0.1"])
def test_a_bad_rate_is_a_clear_error(tmp_path, monkeypatch, value):
    monkeypatch.setenv("AUTOTUNE_INJECT_OOM", value)
    with pytest.raises(ValueError, match=f"AUTOTUNE_INJECT_OOM={value!r}"):
        train(tmp_path, "bad", None)
