"""run.py: what the rooms of a batch share, and what the Tuner lends them."""

import gc
import weakref

import torch

from autotune import Tuner


def test_a_tuner_dropped_without_close_is_collected_at_once(tmp_path):
    # The rooms reach the Tuner's fire/carry_out/checkpoint through run.Lent, which holds it
    # weakly: a strong hold would make a cycle, and the Tuner (with its journal and monitor
    # link) would live until the cyclic collector ran.
    model = torch.nn.Linear(4, 1)
    tuner = Tuner(model, torch.optim.SGD(model.parameters(), lr=0.1), loss_fn=torch.nn.functional.mse_loss,
                  run_dir=tmp_path, monitor=False)
    tuner.step((torch.randn(8, 4), torch.randn(8, 1)))
    assert tuner.recovery.lent.checkpoint("test") is not None  # lent: the Tuner's own checkpoint
    ref = weakref.ref(tuner)
    gc.disable()
    try:
        del tuner
        assert ref() is None
    finally:
        gc.enable()
