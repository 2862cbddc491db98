"""The knobs' micro-batch: grown past the size the user gave, said once on stderr; never past
max_micro_batch_size (issue 58, item 2)."""

import pytest
import torch
from torch import nn

from autotune.common.actions import SetMicroBatch
from autotune.decisions.knobs import Knobs, apply

CPU = torch.device("cpu")


def test_growing_past_the_size_given_is_said_once_with_the_way_to_keep_it(capsys):
    knobs = Knobs.given(64, 8, CPU, None)
    assert apply(SetMicroBatch(4, "halved"), knobs).applied and capsys.readouterr().err == ""  # shrunk: the OOM says it
    assert apply(SetMicroBatch(8), knobs).applied and capsys.readouterr().err == ""  # back to yours: not past it
    assert apply(SetMicroBatch(16, "room for 16"), knobs).applied
    assert capsys.readouterr().err == ("autotune: micro-batch 8 -> 16, past the 8 you gave (room for 16). "
                                       "Pass max_micro_batch_size=8 to keep yours\n")
    assert apply(SetMicroBatch(32), knobs).applied and capsys.readouterr().err == ""  # once a run
    assert apply(SetMicroBatch(4), knobs).applied and apply(SetMicroBatch(16), knobs).applied
    assert capsys.readouterr().err == ""  # crossing yours again: still once a run
    assert knobs.micro_batch_size == 16


def test_a_checkpoints_size_past_yours_is_said_and_a_shrink_from_there_is_not(capsys):
    knobs = Knobs.given(64, 2, CPU, None)
    knobs.restore(16)  # a resume of a run that had tuned itself to 16
    assert capsys.readouterr().err == ("autotune: micro-batch 2 -> 16, past the 2 you gave (the checkpoint's, as "
                                       "the run had tuned it). Pass max_micro_batch_size=2 to keep yours\n")
    other = Knobs.given(64, 2, CPU, None)
    other.micro_batch_size = 16  # above yours already, however it got there
    assert apply(SetMicroBatch(8, "halving to 8"), other).applied and capsys.readouterr().err == ""  # a move down
    assert apply(SetMicroBatch(32), other).applied and capsys.readouterr().err == ""  # it did not cross yours


def test_a_size_the_tuner_chose_itself_is_not_said(capsys):
    knobs = Knobs.given(None, None, CPU, None)
    knobs.size_for(64)
    knobs.micro_batch_size = 8
    assert apply(SetMicroBatch(16), knobs).applied and capsys.readouterr().err == ""


def test_max_micro_batch_size_is_a_ceiling_for_every_way_the_size_is_set():
    knobs = Knobs.given(64, 8, CPU, None, ceiling=16)
    assert apply(SetMicroBatch(64), knobs).applied and knobs.micro_batch_size == 16
    assert not apply(SetMicroBatch(32), knobs).applied and knobs.micro_batch_size == 16
    knobs.restore(48)  # a checkpoint of a run without the ceiling
    assert knobs.micro_batch_size == 16
    assert Knobs.given(64, 32, CPU, None, ceiling=16).micro_batch_size == 16  # a start above it starts at it
    unsized = Knobs.given(None, None, CPU, None, ceiling=16)
    unsized.size_for(100)
    assert (unsized.batch_size, unsized.micro_batch_size) == (100, 16)


def tuner(tmp_path, **kwargs):
    from autotune import Tuner
    from autotune.policies import GrowBack

    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
    return Tuner(model, torch.optim.SGD(model.parameters(), lr=0.1), loss_fn=nn.functional.cross_entropy,
                 device="cpu", monitor=False, run_dir=tmp_path / "run", micro_batch_size=2, batch_size=32,
                 policies=[GrowBack(calm_steps=1)], **kwargs)


@pytest.mark.parametrize("ceiling", [None, 4])
def test_a_tuner_that_grows_says_so_once_and_keeps_under_its_ceiling(tmp_path, capsys, ceiling):
    batch = (torch.randn(32, 16), torch.randint(0, 4, (32,)))
    with tuner(tmp_path, max_micro_batch_size=ceiling) as t:
        sizes = []
        for _ in range(6):
            t.step(batch)
            sizes.append(t.micro_batch_size)
    said = [line for line in capsys.readouterr().err.splitlines() if "past the 2 you gave" in line]
    assert len(said) == 1 and "max_micro_batch_size=2" in said[0], said
    assert max(sizes) == (32 if ceiling is None else 4), sizes


@pytest.mark.parametrize("bad", [0, -1, 2.5, "8"])
def test_a_bad_ceiling_is_refused_naming_it(tmp_path, bad):
    with pytest.raises((TypeError, ValueError), match="max_micro_batch_size"):
        tuner(tmp_path, max_micro_batch_size=bad)
    assert not (tmp_path / "run").exists() or not any((tmp_path / "run").iterdir())
