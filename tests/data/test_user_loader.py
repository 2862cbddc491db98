"""A DataLoader the user built, shuffled, killed mid-epoch (SIGKILL) and resumed: every sample is
trained once per epoch, in the uninterrupted run's order, ending with its weights."""

import concurrent.futures
import json

import pytest
import torch

from tests.conftest import run_python

pytestmark = pytest.mark.slow  # two interpreters a case

TRAIN = """
import json, os, signal, torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from autotune import AutoTrainer

torch.manual_seed(0)
g = torch.Generator().manual_seed(0)
data = TensorDataset(torch.randn(256, 8, generator=g), torch.randn(256, 1, generator=g), torch.arange(256))
model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.2), nn.Linear(16, 1))
if KIND == "stateful":
    from torchdata.stateful_dataloader import StatefulDataLoader
    loader = StatefulDataLoader(data, batch_size=32, shuffle=True)
else:
    loader = DataLoader(data, batch_size=32, shuffle=True, num_workers=WORKERS,
                        generator=torch.Generator().manual_seed(42) if KIND == "seeded" else None)
trained = open(RUN_DIR + "/trained.jsonl", "a")

def step(model, batch):
    if KILL_AT is not None and trainer.step == KILL_AT:
        os.kill(os.getpid(), signal.SIGKILL)
    x, y, index = batch
    trained.write(json.dumps([trainer.epoch, index.tolist()]) + "\\n")
    trained.flush()
    return nn.functional.mse_loss(model(x), y)

trainer = AutoTrainer(model, loader, step_fn=step, device="cpu", checkpoint_every=1, run_dir=RUN_DIR,
                      optimizer=lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9), progress=False, monitor=False)
result = trainer.fit(epochs=2, resume=RESUME)
torch.save(model.state_dict(), RUN_DIR + "/final.pt")
save({"samples_seen": result.samples_seen, "steps": result.steps})
"""


def train(tmp_path, run_dir, kind, workers=0, kill_at=None, resume=False):
    run_dir.mkdir(parents=True, exist_ok=True)
    settings = f"KIND={kind!r}\nWORKERS={workers}\nKILL_AT={kill_at}\nRESUME={resume}\nRUN_DIR={str(run_dir)!r}\n"
    return run_python(settings + TRAIN, tmp_path)


def trained(run_dir):
    """{epoch: the sample indices trained in it, in order}."""
    epochs = {}
    for line in (run_dir / "trained.jsonl").read_text().splitlines():
        epoch, indices = json.loads(line)
        epochs.setdefault(epoch, []).extend(indices)
    return epochs


@pytest.mark.parametrize("kind, workers", [("unseeded", 0), ("seeded", 0), ("seeded", 2), ("stateful", 0)])
def test_a_shuffled_user_loader_killed_at_step_11_of_16_resumes_on_the_same_samples(tmp_path, kind, workers):
    if kind == "stateful":
        pytest.importorskip("torchdata.stateful_dataloader")
    # The uninterrupted run and the one killed at step 11 side by side: most of each is its interpreter starting.
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        whole = pool.submit(train, tmp_path / "a", tmp_path / "a" / "run", kind, workers)
        killed = pool.submit(train, tmp_path / "b", tmp_path / "b" / "run", kind, workers, kill_at=11)
        (proc, reference), (killed_proc, _) = whole.result(), killed.result()
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert killed_proc.returncode == -9, killed_proc.stderr[-3000:]
    proc, resumed = train(tmp_path / "b", tmp_path / "b" / "run", kind, workers, resume=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "unsafe" not in proc.stderr and "trained twice" not in proc.stderr, proc.stderr[-2000:]

    expected, got = trained(tmp_path / "a" / "run"), trained(tmp_path / "b" / "run")
    for epoch in (0, 1):
        assert sorted(got[epoch]) == list(range(256)), f"epoch {epoch}: a sample trained twice or never"
        assert got[epoch] == expected[epoch]
    assert resumed == reference == {"samples_seen": 512, "steps": 16}
    weights = torch.load(tmp_path / "b" / "run" / "final.pt", weights_only=True)
    for key, value in torch.load(tmp_path / "a" / "run" / "final.pt", weights_only=True).items():
        torch.testing.assert_close(weights[key], value, rtol=1e-6, atol=1e-7)


def test_an_iterable_dataset_resumed_mid_epoch_says_the_replay_may_not_be_exact(tmp_path, capfd):
    from torch import nn
    from torch.utils.data import DataLoader, IterableDataset

    from autotune import AutoTrainer

    class Stream(IterableDataset):
        def __iter__(self):
            g = torch.Generator().manual_seed(0)
            for _ in range(256):
                yield torch.randn(8, generator=g), torch.randn(1, generator=g)

    def fit(resume, max_steps):
        torch.manual_seed(0)
        with AutoTrainer(nn.Linear(8, 1), DataLoader(Stream(), batch_size=32), loss_fn=nn.functional.mse_loss,
                         device="cpu", run_dir=tmp_path / "run", checkpoint_every=1, progress=False,
                         monitor=False) as t:
            return t.fit(epochs=1, max_steps=max_steps, resume=resume)

    assert fit(False, 3).steps == 3
    assert "replaying" not in capfd.readouterr().err
    assert fit(True, None).samples_seen == 256
    err = capfd.readouterr().err
    assert "resuming your DataLoader mid-epoch by replaying its first 3 batches: its dataset is an IterableDataset " \
           "(Stream)" in err and "StatefulDataLoader" in err, err
