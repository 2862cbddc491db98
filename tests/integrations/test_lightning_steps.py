"""Lightning's logs and evaluation through autotune's strategy: what `training_step` logs is one
value a batch however many micro-batches (and failed attempts) it took, so `train_loss_epoch`
is plain Lightning's; a validation batch that does not fit under a cap runs in pieces and ends
with the uncapped `val_loss`, where plain Lightning fails under the same cap."""

import pytest

from autotune.memory import kernel_room
from tests.conftest import run_python

pytest.importorskip("lightning")
pytestmark = pytest.mark.slow  # a fresh interpreter a case: Lightning and a memory cap

MODULE = """
import torch
import lightning as L
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from autotune.integrations.lightning import AutoTuneStrategy

HOG = 2**20  # bytes a sample in validation: a real allocation that grows with the micro-batch

class Module(L.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(16, 64), nn.Linear(64, 4)
    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))
    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.cross_entropy(self(x), y)
        self.log("train_loss", loss, on_step=True, on_epoch=True)
        return loss
    def validation_step(self, batch, batch_idx):
        x, y = batch
        torch.empty(HOG * x.shape[0], dtype=torch.uint8).fill_(1)
        loss = nn.functional.cross_entropy(self(x), y)
        self.log("val_loss", loss)
        self.log("val_acc", (self(x).argmax(-1) == y).float().mean())
        return loss
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

g = torch.Generator().manual_seed(0)
data = TensorDataset(torch.randn(600, 16, generator=g), torch.randint(0, 4, (600,), generator=g))

def trainer(strategy, root, **kw):
    return L.Trainer(max_epochs=2, accelerator="cpu", devices=1, strategy=strategy, default_root_dir=root,
                     logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                     num_sanity_val_steps=0, **kw)
"""

LOGS = MODULE + """
plain_module, tuned_module = Module(), Module()
plain = trainer("auto", ROOT + "/plain")
plain.fit(plain_module, DataLoader(data, batch_size=64))
tuned = trainer(AutoTuneStrategy("cpu", tuner_options={"inject_oom": 0.3, "seed": 2, "monitor": False}), ROOT + "/tuned")
tuned.fit(tuned_module, DataLoader(data, batch_size=64))
weights = max((a - b).abs().max().item() for a, b in zip(plain_module.state_dict().values(),
                                                        tuned_module.state_dict().values()))
save({"plain": plain.callback_metrics["train_loss_epoch"].item(), "tuned": tuned.callback_metrics["train_loss_epoch"].item(),
      "plain_step": plain.callback_metrics["train_loss_step"].item(),
      "tuned_step": tuned.callback_metrics["train_loss_step"].item(),
      "ooms": tuned.strategy.tuner.ooms, "weights": weights})
"""

VALIDATE = MODULE + """
from autotune.memory.limits import cap_address_space, fix_mmap_threshold, lift_address_space_cap
fix_mmap_threshold()
module = Module()
loader = DataLoader(data, batch_size=64)
reference = trainer("auto", ROOT + "/plain").validate(module, loader, verbose=False)[0]
tuned = trainer(AutoTuneStrategy("cpu", tuner_options={"monitor": False}), ROOT + "/tuned")
tuned.validate(module, loader, verbose=False)  # its kernels and threads, before the cap
cap_address_space(40 * 2**20)  # 64 samples x 1 MiB cannot be had; 32 can
result = tuned.validate(module, loader, verbose=False)[0]
out = {"reference": reference, "capped": result, "ooms": tuned.strategy._evaluator.ooms,
       "micro": tuned.strategy._evaluator.micro_batch_size}
save(out)
try:  # plain Lightning under the same cap
    trainer("auto", ROOT + "/plain-capped").validate(module, loader, verbose=False)
    out["plain_capped"] = "finished"
except Exception as exc:
    out["plain_capped"] = f"{type(exc).__name__}: {str(exc)[:200]}"
lift_address_space_cap()
save(out)
"""


def test_train_loss_epoch_is_plain_lightnings_through_injected_ooms(tmp_path):
    proc, result = run_python(f"ROOT={str(tmp_path)!r}\n" + LOGS, tmp_path, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert result["ooms"] >= 3, result  # uneven micro-batches (600 = 9 x 64 + 24) and failed attempts
    assert abs(result["tuned"] - result["plain"]) < 1e-6, result
    assert abs(result["tuned_step"] - result["plain_step"]) < 1e-6, result
    assert result["weights"] < 1e-6, result


def test_a_validation_that_does_not_fit_ends_with_the_uncapped_val_loss(tmp_path):
    proc, result = run_python(f"ROOT={str(tmp_path)!r}\n" + VALIDATE, tmp_path, timeout=240)
    assert result is not None and "capped" in result, proc.stderr[-3000:]
    assert result["ooms"] >= 1 and result["micro"] < 64, result
    for name in ("val_loss", "val_acc"):
        assert abs(result["capped"][name] - result["reference"][name]) < 1e-6, result
    assert result.get("plain_capped", "lost") != "finished", result


BF16_SCRIPT = """
import torch
import lightning as L
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from autotune.integrations.lightning import AutoTuneStrategy
from autotune.memory.limits import cap_address_space, fix_mmap_threshold, least_headroom, lift_address_space_cap

class Module(L.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 1024), nn.GELU(), nn.Linear(1024, 10))
    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.cross_entropy(self.net(x), y)
        self.log("train_loss", loss)
        return loss
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

g = torch.Generator().manual_seed(0)
data = TensorDataset(torch.randn(256, 256, generator=g), torch.randint(0, 10, (256,), generator=g))

def fit(strategy):
    trainer = L.Trainer(max_steps=2, accelerator="cpu", devices=1, strategy=strategy, precision="bf16-mixed",
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0, default_root_dir=OUT_DIR)
    module = Module()
    trainer.fit(module, DataLoader(data, batch_size=128))
    return module

fix_mmap_threshold()
plain = fit("auto")  # imports and the kernels of batch 128, before any cap
need = least_headroom(lambda: fit("auto"), 256 * 2**20, resolution_bytes=2**20)  # plain Lightning's, here
if need is None:
    save({"uncalibrated": "plain Lightning did not run under 256 MiB of headroom"})
    raise SystemExit(0)
save({"need": need})  # calibrated: a crash from here on is the tuned run's
cap_address_space(need + MARGIN)  # autotune's Tuner is built under the cap, at the first training_step
strategy = AutoTuneStrategy("cpu", tuner_options={"monitor": False})
tuned = fit(strategy)
lift_address_space_cap()
diff = max((a - b).abs().max().item() for a, b in zip(plain.state_dict().values(), tuned.state_dict().values()))
save({"need": need, "ooms": strategy.tuner.ooms, "micro": strategy.micro_batch_size, "diff": diff})
"""


def test_a_bf16_lightning_run_fits_where_plain_lightning_does(tmp_path):
    # The Tuner starts under the user's cap: before, its sampler thread's 8 MiB stack alone made
    # this run need 24 MiB of headroom where plain Lightning needed 14 (it ended "even at
    # micro-batch 1", or oneDNN crashed compiling the smaller sizes' kernels). The margin: 8 MiB over
    # plain Lightning's measured need. 6 MiB failed 4 runs of 11 on a 2-core AMX Xeon (autotune's
    # code at 16f7f47 and today's alike: an OOM at 128 with 6 MiB left, before the first forward's
    # activations); the 8 MiB stack that regressed it would still fail here. Where the rest of
    # autotune's own memory goes under a cap is issue 34's to measure and cut.
    # Plus the kernel room's reserve (autotune/memory/kernel_room.py): under a cap, autotune's first bf16
    # step checks each product for its output and RESERVE_BYTES of room for kernels oneDNN may build, where
    # plain Lightning's bisection ran on kernels its first fit had built (room for the output was enough).
    # Without it: the mm of [1024, 128] x [128, 1024] refused with less than 6 MiB left, 1 to 3 runs in 6.
    settings = f"OUT_DIR={str(tmp_path / 'out')!r}\nMARGIN={8 * 2**20 + kernel_room.RESERVE_BYTES}\n"
    proc, result = run_python(settings + BF16_SCRIPT, tmp_path, timeout=240)
    if proc.returncode < 0 and not (result and "need" in result):
        # Plain Lightning died of a signal while its need was bisected, before autotune ran: torch
        # 2.14's oneDNN writes through the null pointer a refused allocation returns (a bf16 matmul's
        # primitive descriptor, 252 KiB, copied at every kernel-cache miss: `matmul_pd_t`'s
        # constructor, a core dump shows). 1 run in 24 on a 2-core AMD EPYC with AVX512_BF16 (and CI),
        # both times at its 16 MiB probe, the nearest the need. The measurement is taken again, once.
        proc, result = run_python(settings + BF16_SCRIPT, tmp_path, timeout=240)
    assert proc.returncode == 0 and result is not None, proc.stderr[-3000:]
    if "uncalibrated" in result:
        pytest.skip(result["uncalibrated"])
    assert result["ooms"] == 0 and result["micro"] == 128, result  # plain's batch, in one piece
    assert result["diff"] < 1e-6, result  # the same computation as plain Lightning's
