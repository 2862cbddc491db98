"""Lightning: the strategies under a real memory cap (RLIMIT_AS), alone and under torchrun (two gloo ranks).

The module's memory grows 1 MiB a sample; the cap refuses a batch of 64 and admits 32. Each run
trains a plain Lightning run first (no cap), then the same with autotune's strategy under the
cap: one epoch, and a second resumed from the first's checkpoint. Both must end with the plain
run's weights, every sample trained once, and the resumed run at the micro-batch it had settled on.
"""

import concurrent.futures
import json
import os
import subprocess
import sys

import pytest

from tests.conftest import torchrun

pytest.importorskip("lightning")
pytestmark = pytest.mark.slow

SCRIPT = r'''import glob, json, os, sys, torch
import lightning as L
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from autotune.integrations.lightning import AutoTuneDDPStrategy, AutoTuneStrategy
from autotune.memory.limits import cap_address_space, lift_address_space_cap

out = sys.argv[1]
world = int(os.environ.get("WORLD_SIZE", "1"))
rank = int(os.environ.get("RANK", "0"))
HOG = 2**20  # bytes per sample: activations that grow with the micro-batch, a real allocation the cap can refuse

class Hog(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        torch.empty(HOG * x.shape[0], dtype=torch.uint8).fill_(1)
        return x.view_as(x)
    @staticmethod
    def backward(ctx, grad):
        return grad

class Module(L.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(16, 64), nn.Linear(64, 4)
    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.cross_entropy(self.b(torch.tanh(Hog.apply(self.a(x)))), y)
        self.log("train_loss", loss)
        return loss
    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, 2, 0.5)}

g = torch.Generator().manual_seed(0)
data = TensorDataset(torch.randn(512, 16, generator=g), torch.randint(0, 4, (512,), generator=g))

def fit(strategy, root, epochs=2, ckpt_path=None):
    module = Module()
    trainer = L.Trainer(max_epochs=epochs, accelerator="cpu", devices=world, strategy=strategy,
                        accumulate_grad_batches=2, gradient_clip_val=1.0, default_root_dir=root,
                        logger=L.pytorch.loggers.CSVLogger(root, name="", version=0), enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0, log_every_n_steps=1)
    trainer.fit(module, DataLoader(data, batch_size=64), ckpt_path=ckpt_path)
    return module, trainer

plain, _ = fit("ddp" if world > 1 else "auto", os.path.join(out, "plain"))
make = (lambda: AutoTuneDDPStrategy(tuner_options={"monitor": False})) if world > 1 else \
    (lambda: AutoTuneStrategy("cpu", tuner_options={"monitor": False}))
if rank == world - 1:
    cap_address_space(40 * 2**20)  # 64 samples x 1 MiB cannot be had; 32 can
first = make()
fit(first, os.path.join(out, "tuned"), epochs=1)
second = make()
tuned, trainer = fit(second, os.path.join(out, "tuned"), epochs=2,
                     ckpt_path=glob.glob(os.path.join(out, "tuned", "version_0", "checkpoints", "epoch=0-*.ckpt"))[0])
lift_address_space_cap()
diff = max((a - b).abs().max().item() for a, b in zip(plain.state_dict().values(), tuned.state_dict().values()))
with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
    json.dump({"diff": diff, "first_ooms": first.tuner.ooms, "settled": first.micro_batch_size,
               "second_ooms": second.tuner.ooms, "micro": second.micro_batch_size, "steps": trainer.global_step,
               "samples": second.tuner.samples_seen, "first": first.tuner.samples_seen}, f)
'''


def _check(result):
    assert result["first_ooms"] >= 1 and result["settled"] < 64
    # 2 epochs of 512, each sample once (counted over ranks); the resumed run counts on from the first
    assert result["first"] == 512 and result["samples"] == 1024
    assert result["diff"] < 1e-5  # the plain Lightning run's weights


def test_a_lightning_module_survives_ooms_alone_and_under_ddp_with_plain_lightnings_weights(tmp_path):
    # The run alone and the torchrun job at once (three interpreters: they only share the CPUs).
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    alone, job = tmp_path / "alone", tmp_path / "ddp"
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        single = pool.submit(subprocess.run, [sys.executable, str(script), str(alone)], capture_output=True,
                             text=True, timeout=240, env={**os.environ, "MALLOC_ARENA_MAX": "1"})
        results = [job / f"rank{r}.json" for r in (0, 1)]
        ddp = pool.submit(torchrun, script, [str(job)], results)
        proc = single.result()
        ddp.result()
    assert proc.returncode == 0, proc.stderr[-4000:]

    # Alone: accumulation, clipping, a logger, and a resume from Lightning's checkpoint.
    result = json.loads((alone / "rank0.json").read_text())
    _check(result)
    assert result["steps"] == 8
    records = [json.loads(line) for line in (alone / "tuned" / "version_0" / "events.jsonl").open()]
    resumed = [r for r in records if r["kind"] == "resume"]
    assert resumed and resumed[0]["micro_batch_size"] == result["settled"]  # from the Lightning checkpoint
    assert (alone / "tuned" / "version_0" / "metrics.csv").exists()  # the logger still logs

    # Under DDP: an OOM on one rank (only rank 1 is capped) is agreed by both.
    ranks = [json.loads(path.read_text()) for path in results]
    for result in ranks:
        _check(result)
        assert result["steps"] == 4  # 256 samples a rank an epoch: 4 batches, 2 optimizer steps
    assert ranks[0]["first_ooms"] == ranks[1]["first_ooms"]  # both saw rank 1's OOMs
    assert ranks[0]["settled"] == ranks[1]["settled"]
