"""Actions: journal names and parameters, and reliefs encoded as integers for torchrun."""

import pytest

from autotune.common.actions import (CheckpointActivations, PruneChannels, SetMicroBatch, UseAutocast, action_kind,
                              action_params, relief_from_ints, relief_to_ints)


def test_journal_name_and_params():
    action = SetMicroBatch(size=16, reason="halving")
    assert action_kind(action) == "set_micro_batch" and action_params(action) == {"size": 16}


@pytest.mark.parametrize("relief", [UseAutocast(reason="r"), CheckpointActivations(reason="r"),
                                    PruneChannels(ratio=0.1875, reason="r"), None])
def test_a_relief_survives_the_trip_through_integers(relief):
    code, ratio = relief_to_ints(relief)
    assert all(isinstance(v, int) and v >= 0 for v in (code, ratio))  # a MAX all-reduce keeps rank 0's
    assert relief_from_ints(code, ratio, reason="r") == relief


def test_codes_follow_the_ladder_cheapest_first():
    codes = [relief_to_ints(r)[0] for r in (UseAutocast(), CheckpointActivations(), PruneChannels(ratio=0.1))]
    assert codes == [1, 2, 3] and relief_to_ints(None) == [0, 0]


def test_a_micro_batch_asked_for_is_clamped_between_1_and_the_batch():
    # issue 46: removing either clamp passed every quick test
    import torch

    from autotune.decisions.knobs import Knobs, apply

    knobs = Knobs(batch_size=32, micro_batch_size=8, device=torch.device("cpu"))
    assert apply(SetMicroBatch(1000), knobs).applied and knobs.micro_batch_size == 32
    assert not apply(SetMicroBatch(64), knobs).applied and knobs.micro_batch_size == 32  # already the batch
    assert apply(SetMicroBatch(0), knobs).applied and knobs.micro_batch_size == 1


def test_a_policy_asking_above_the_batch_gets_the_batch_and_one_oom_halves_from_there(tmp_path):
    # A policy of the user's asks for far more than the batch (a growth rule gone wrong). The
    # micro-batch stops at the batch, so the next batch's OOM halves it to 16 at once; unclamped it
    # would halve from 10_000, each size above 16 a whole-batch OOM (10 of them) before one fitted.
    import dataclasses
    from typing import ClassVar

    import torch
    from torch import nn

    from autotune import Event, Tuner
    from autotune.policies.halve_on_oom import HalveOnOOM
    from autotune.decisions.policy import PolicyBase
    from tests.conftest import journal

    @dataclasses.dataclass
    class AskTooMuch(PolicyBase):
        name: ClassVar[str] = "ask_too_much"
        events: ClassVar[frozenset[Event]] = frozenset({Event.BATCH_END})
        asked: bool = False

        def decide(self, event, snap):
            if self.asked:
                return []
            self.asked = True
            return [SetMicroBatch(10_000, reason="more")]

    def step_fn(model, micro):
        x, y = micro
        if len(x) > 16:  # more than 16 samples at once does not fit: a real refusal by the allocator
            torch.empty(1 << 62, dtype=torch.uint8)
        return nn.functional.mse_loss(model(x), y)

    model = nn.Linear(4, 1)
    batch = (torch.randn(32, 4), torch.randn(32, 1))
    with Tuner(model, torch.optim.SGD(model.parameters(), lr=0.1), step_fn=step_fn, device="cpu", monitor=False,
               micro_batch_size=8, batch_size=32, policies=[AskTooMuch(), HalveOnOOM()],
               run_dir=tmp_path / "run") as tuner:
        tuner.step(batch)
        assert tuner.micro_batch_size == 32
        tuner.step(batch)
        assert (tuner.micro_batch_size, tuner.ooms, tuner.step_count) == (16, 1, 2)
    (asked,) = [r for r in journal(tmp_path / "run") if r["kind"] == "action" and r["policy"] == "ask_too_much"]
    assert asked["applied"] and asked["note"] == "micro-batch 8 -> 32"
