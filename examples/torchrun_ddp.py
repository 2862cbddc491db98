"""Multi-process training with torchrun: the same AutoTrainer code, no changes.

    torchrun --nproc-per-node 2 examples/torchrun_ddp.py          # CPU (gloo) or one GPU per rank (NCCL)

AutoTrainer sees WORLD_SIZE > 1, joins the process group, wraps the model in DDP, gives
each rank its shard of every epoch, and makes an OOM on any rank a decision all ranks take
together. Only rank 0 writes the journal and checkpoints. `batch_size` is per rank.
"""

import torch
from torch import nn
from torch.utils.data import TensorDataset

from autotune import AutoTrainer

torch.manual_seed(0)
g = torch.Generator().manual_seed(0)
data = TensorDataset(torch.randn(4096, 32, generator=g), torch.randint(0, 4, (4096,), generator=g))
model = nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 4))

trainer = AutoTrainer(model, data, loss_fn=nn.functional.cross_entropy, batch_size=128,
                      optimizer=lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9))  # run_dir: runs/<time>, rank 0's
result = trainer.fit(epochs=2)
if trainer.is_main:
    print(f"{result.samples_seen} samples over {trainer.ranks.world if trainer.ranks else 1} ranks, "
          f"loss {result.loss:.3f}, journal {result.run_dir}/events.jsonl")
