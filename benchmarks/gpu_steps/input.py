"""GPU check (h): the input pipeline on CUDA.

- A dataset of CUDA tensors trains (a TensorDataset on the device, and a map-style dataset that
  returns device tensors): such batches are not pinned (torch's pinning raises on them).
- Batches of CPU tensors are pinned.
- The shared-memory sample cache, switched on at the first epoch, changes no weight.
"""

from __future__ import annotations

import dataclasses
import sys
import tempfile
from pathlib import Path
from typing import ClassVar

sys.path.insert(0, str(Path(__file__).parent))
from _step import Report, main  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import Dataset, TensorDataset  # noqa: E402
from autotune import AutoTrainer, Event  # noqa: E402
from autotune.common.actions import CacheSamples  # noqa: E402


def run(report: Report, device) -> None:
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(256, 16, generator=g), torch.randint(0, 4, (256,), generator=g)

    class OnDevice(Dataset):
        def __len__(self):
            return len(y)

        def __getitem__(self, i):
            return x[i].to(device), y[i].to(device)

    class Cacheable(Dataset):
        cacheable = True  # deterministic: its whole output may be cached

        def __len__(self):
            return len(y)

        def __getitem__(self, i):
            return x[i], y[i]

    @dataclasses.dataclass
    class CacheFromTheStart:
        name: ClassVar[str] = "cache_from_the_start"
        events: ClassVar[frozenset] = frozenset({Event.EPOCH_START})

        def decide(self, event, snap):
            return [CacheSamples(reason="check")] if snap.epoch == 0 else []

        def state_dict(self):
            return {}

        def load_state_dict(self, state):
            return None

    def fit(dataset, run_dir: Path, policies="default"):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
        trainer = AutoTrainer(model, dataset, loss_fn=nn.functional.cross_entropy, batch_size=32, device=device,
                              progress=False, run_dir=run_dir, policies=policies, checkpoint_interval=None)
        pinned = trainer.input.loader.pin_memory
        result = trainer.fit(epochs=2)
        cached = trainer.input.cache is not None
        trainer.close()
        return result, {k: v.detach().cpu() for k, v in model.state_dict().items()}, pinned, cached

    with tempfile.TemporaryDirectory() as folder:
        for name, dataset in (("a TensorDataset on the device", TensorDataset(x.to(device), y.to(device))),
                              ("a dataset returning device tensors", OnDevice())):
            try:
                result, _, pinned, _ = fit(dataset, Path(folder) / name.replace(" ", "-"))
                report.check(f"{name} trains, unpinned", result.samples_seen == 512 and not pinned)
            except Exception as exc:  # the crash this check is for: "cannot pin 'torch.cuda.FloatTensor'"
                report.check(f"{name} trains, unpinned", False, f"{type(exc).__name__}: {exc}")
        plain, plain_weights, pinned, _ = fit(Cacheable(), Path(folder) / "plain", policies=[])
        report.check("CPU batches are pinned", pinned)
        cached, cached_weights, _, cache_on = fit(Cacheable(), Path(folder) / "cached", policies=[CacheFromTheStart()])
        report.check("the sample cache was on", cache_on)
        report.check("the cache changes no weight", all(torch.equal(plain_weights[k], cached_weights[k])
                                                        for k in plain_weights))


if __name__ == "__main__":
    main(run)
