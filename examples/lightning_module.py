"""Keep Lightning: autotune's strategy makes a LightningModule's training_step survive OOMs.

The sequence classifier and bucketed data of custom_loop.py (long sequences last in the
epoch) as a `LightningModule`, trained by `lightning.Trainer` with gradient accumulation,
clipping, a cosine schedule and a CSV logger, under a memory cap (RLIMIT_AS) that the late
batches do not fit. The change is the strategy: each batch is split and retried at a smaller
micro-batch on OOM, and Lightning's optimizer step is the one the whole batch would have made.

    pip install 'autotune[lightning]'
    python examples/lightning_module.py            # capped: watch it halve and go on
    python examples/lightning_module.py --plain    # Lightning's own strategy: an OOM
    torchrun --nproc-per-node 2 examples/lightning_module.py --budget-mib 0   # DDP on CPU
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader

from autotune.integrations.lightning import AutoTuneDDPStrategy, AutoTuneStrategy  # autotune

sys.path.insert(0, str(Path(__file__).parent))
from custom_loop import Classifier, Sequences, collate, measured_headroom  # noqa: E402  (model and data)


class SequenceModule(L.LightningModule):
    def __init__(self, steps: int):
        super().__init__()
        self.net, self.steps = Classifier(), steps

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        tokens, labels = batch
        loss = nn.functional.cross_entropy(self.net(tokens), labels)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=3e-3)
        schedule = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=self.steps)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--budget-mib", type=float, default=None,
                        help="RLIMIT_AS headroom in MiB (default: measured on this machine; 0: no cap)")
    parser.add_argument("--plain", action="store_true", help="Lightning's own strategy, without autotune")
    parser.add_argument("--root-dir", default="runs/lightning_module")
    args = parser.parse_args()

    from autotune.memory.limits import cap_address_space, fix_mmap_threshold, lift_address_space_cap, single_malloc_arena

    single_malloc_arena()
    fix_mmap_threshold()  # what the warm-up frees is unmapped: the cap leaves the room it says
    torch.manual_seed(0)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    data = Sequences()
    loader = DataLoader(data, batch_size=64, collate_fn=collate)
    module = SequenceModule(steps=args.epochs * len(loader) // (2 * world))
    if args.plain:
        strategy = "ddp" if world > 1 else "auto"
    else:
        strategy = AutoTuneDDPStrategy() if world > 1 else AutoTuneStrategy("cpu")  # autotune
    trainer = L.Trainer(max_epochs=args.epochs, accelerator="cpu", devices=world, strategy=strategy,
                        accumulate_grad_batches=2, gradient_clip_val=1.0, default_root_dir=args.root_dir,
                        logger=L.pytorch.loggers.CSVLogger(args.root_dir), log_every_n_steps=1,
                        enable_progress_bar=False, enable_model_summary=False)
    batch = next(iter(loader))
    nn.functional.cross_entropy(module.net(batch[0]), batch[1]).backward()  # warm-up before the cap
    module.zero_grad(set_to_none=True)
    headroom = None if args.budget_mib is None else int(args.budget_mib * 2**20)
    if args.budget_mib is None:
        headroom = measured_headroom(module.net, data, 64)
    if headroom:
        cap_address_space(headroom)
    try:
        trainer.fit(module, loader)
    finally:
        lift_address_space_cap()
    if trainer.is_global_zero:
        tuned = "" if args.plain else (f", {strategy.tuner.ooms} OOMs survived, micro-batch "
                                       f"{strategy.micro_batch_size}; `autotune report {strategy.tuner.run_dir}`")
        print(f"done: {trainer.global_step} steps, loss {trainer.callback_metrics['train_loss']:.3f}{tuned}")


if __name__ == "__main__":
    main()
