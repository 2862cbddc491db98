"""Actions: journal names and parameters, and reliefs encoded as integers for torchrun."""

import pytest

from autotune.actions import (CheckpointActivations, PruneChannels, SetMicroBatch, UseAutocast, action_kind,
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

    from autotune.knobs import Knobs, apply

    knobs = Knobs(batch_size=32, micro_batch_size=8, device=torch.device("cpu"))
    assert apply(SetMicroBatch(1000), knobs).applied and knobs.micro_batch_size == 32
    assert not apply(SetMicroBatch(64), knobs).applied and knobs.micro_batch_size == 32  # already the batch
    assert apply(SetMicroBatch(0), knobs).applied and knobs.micro_batch_size == 1
