"""The run whose checkpoints the format tests keep: small, deterministic, with every part a
checkpoint holds (momentum, a scheduler, an evaluation, a callback's state, an OOM policy's)."""

from pathlib import Path

import torch
from torch import nn
from torch.utils.data import TensorDataset

STOP_AT = 5  # the step the kept checkpoints were written at
STEPS = 12  # the whole run


def data(n: int = 96, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, 6, generator=g), torch.randint(0, 3, (n,), generator=g))


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 3))


class CountSteps:
    """A callback with a state of its own."""

    def __init__(self):
        self.steps = 0

    def on_step_end(self, trainer):
        self.steps += 1

    def state_dict(self):
        return {"steps": self.steps}

    def load_state_dict(self, state):
        self.steps = state["steps"]


def trainer(run_dir: Path, callback: CountSteps | None = None):
    from autotune import AutoTrainer

    return AutoTrainer(model(), data(), loss_fn=nn.functional.cross_entropy, batch_size=16, micro_batch_size=8,
                       optimizer=lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
                       scheduler=lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=4, gamma=0.5),
                       eval_dataset=data(32, seed=1), eval_every=4, callbacks=[callback or CountSteps()],
                       device="cpu", run_dir=run_dir, progress=False, monitor=False, checkpoint_interval=None)


def batches() -> list:
    d = data()
    return [d[i:i + 16] for i in range(0, 96, 16)] * 2


def tuner(run_dir: Path):
    from autotune import Tuner

    return Tuner(model(), lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), loss_fn=nn.functional.cross_entropy,
                 scheduler=lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=4, gamma=0.5),
                 micro_batch_size=8, device="cpu", run_dir=run_dir, monitor=False)
