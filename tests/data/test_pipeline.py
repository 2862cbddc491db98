"""Input-bound loops end to end through AutoTrainer: detection, caching switched on at a batch
boundary without changing the order, and compute-bound runs left alone."""

import os
import time

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset
from torchvision import datasets, transforms as T

from autotune import AutoTrainer
from autotune.data.sampler import EpochSampler
from tests.conftest import journal
from tests.data.conftest import write_jpegs


def kinds(run_dir, kind):
    return [r for r in journal(run_dir) if r["kind"] == kind]


def test_an_image_folder_is_detected_input_bound_and_cached(tmp_path):
    root = write_jpegs(tmp_path / "train", classes=2, per_class=160, size=256)
    # Random crops and flips: cheap next to decoding a JPEG, so load/decode clearly dominates (at
    # 128 pixels a loaded machine waited 21% of step time for data, next to the detector's 20%).
    dataset = datasets.ImageFolder(root, transform=T.Compose([T.RandomCrop(32), T.RandomHorizontalFlip(), T.ToTensor()]))
    model = nn.Sequential(nn.Conv2d(3, 8, 3, stride=2), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                          nn.Linear(8, 2))
    trainer = AutoTrainer(model, dataset, loss_fn=nn.functional.cross_entropy, batch_size=16, device="cpu",
                          progress=False, monitor=False, checkpoint_interval=None, run_dir=tmp_path / "run")
    # The epoch after the one that filled the cache hits every sample; one epoch spare for a
    # detector that needs a second window on a loaded machine.
    result = trainer.fit(epochs=4)
    assert result.samples_seen == 4 * 320  # nothing skipped or repeated across the switch
    (profile,) = kinds(tmp_path / "run", "input_profile")
    assert profile["cacheable"] and profile["verdict"] == "load/decode dominates", profile
    assert "ImageFolder" in profile["how"]
    (on,) = kinds(tmp_path / "run", "sample_cache_on")
    assert on["budget_bytes"] > 320 * 256 * 256 * 3 and on["limited_by"] and "waiting for data" in on["reason"]
    assert on["step"] <= 2 * 20, on  # within two epochs of 20 steps
    per_epoch = kinds(tmp_path / "run", "sample_cache")
    assert per_epoch[-1]["hit_rate"] == 1.0 and per_epoch[-1]["entries"] == 320, per_epoch
    assert dataset.transform is not None  # the user's dataset object is unchanged
    trainer.close()  # the shared-memory region goes with it, not when the trainer is collected
    assert not os.path.exists(on["path"])


class SlowToLoad(Dataset):
    """Each sample takes 2 ms to "read"; its augmentation is cheap and random. Yields its index."""

    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def load(self, index):
        time.sleep(0.002)
        return torch.full((8,), float(index))

    def augment(self, features):
        return features + 0.01 * torch.randn(8), int(features[0])

    def __getitem__(self, index):
        return self.augment(self.load(index))


def train_recording(tmp_path, name, policies, epochs=2):
    seen = []

    def step_fn(model, micro):
        features, ids = micro
        seen.extend(ids.tolist())
        return model(features).pow(2).mean()

    trainer = AutoTrainer(nn.Linear(8, 1), SlowToLoad(240), step_fn=step_fn, batch_size=8, device="cpu",
                          seed=3, progress=False, monitor=False, checkpoint_interval=None,
                          run_dir=tmp_path / name, policies=policies)
    trainer.fit(epochs=epochs)
    return seen


def test_switching_the_loader_mid_epoch_keeps_the_sample_order(tmp_path):
    tuned = train_recording(tmp_path, "tuned", "default")
    plain = train_recording(tmp_path, "plain", [])
    sampler = EpochSampler(240, shuffle=True, seed=3)
    expected = []
    for epoch in range(2):
        sampler.set_epoch(epoch)
        expected += sampler.order()
    assert plain == expected and tuned == expected
    rebuilt = kinds(tmp_path / "tuned", "loader_rebuilt")
    assert rebuilt and 0 < rebuilt[0]["position"] < 240  # switched inside the first epoch
    assert kinds(tmp_path / "tuned", "sample_cache_on")[0]["how"].startswith("load(index) cached")


class Instant(Dataset):
    cacheable = True

    def __len__(self):
        return 512

    def __getitem__(self, index):
        return torch.ones(256) * (index % 7), index % 2


def test_a_compute_bound_run_never_turns_caching_on(tmp_path):
    model = nn.Sequential(nn.Linear(256, 2048), nn.ReLU(), nn.Linear(2048, 2048), nn.ReLU(), nn.Linear(2048, 2))
    trainer = AutoTrainer(model, Instant(), loss_fn=nn.functional.cross_entropy, batch_size=16, device="cpu",
                          progress=False, monitor=False, checkpoint_interval=None, run_dir=tmp_path / "run")
    trainer.fit(epochs=1)
    records = journal(tmp_path / "run")
    assert not [r for r in records if r["kind"] in ("input_profile", "sample_cache_on", "loader_rebuilt")]
    assert not [r for r in records if r.get("event") == "io_bound"]


def test_a_callers_data_loader_is_never_rebuilt(tmp_path):
    loader = DataLoader(SlowToLoad(96), batch_size=4)
    trainer = AutoTrainer(nn.Linear(8, 1), loader, step_fn=lambda m, b: m(b[0]).pow(2).mean(), device="cpu",
                          progress=False, monitor=False, checkpoint_interval=None, run_dir=tmp_path / "run")
    trainer.fit(epochs=1)
    assert trainer.loader is loader
    (profile,) = kinds(tmp_path / "run", "input_profile")
    assert not profile["cacheable"] and "built by the caller" in profile["how"]
    assert not kinds(tmp_path / "run", "loader_rebuilt")


def test_the_tuned_worker_count_survives_a_checkpoint(tmp_path):
    def make(workers):
        return AutoTrainer(nn.Linear(8, 1), SlowToLoad(16), step_fn=lambda m, b: m(b[0]).pow(2).mean(),
                           batch_size=4, num_workers=workers, device="cpu", progress=False, monitor=False,
                           run_dir=tmp_path / "run")

    state = make(2).state_dict()
    resumed = make(0)
    resumed.load_state_dict(state)
    assert resumed.loader.num_workers == 2 and resumed.knobs.num_workers == 2
