"""A two-rank FSDP2 run whose sharded checkpoint tests/checkpoints/format1-sharded/ keeps (written
by eb37a61's code, format 1):

    PYTHONPATH=/tmp/eb37 torchrun --standalone --nproc-per-node 2 tests/checkpoints/sharded_run.py write OUT
    (then copy OUT/checkpoints/step-000000003 to tests/checkpoints/format1-sharded)

`resume FOLDER OUT` continues from that folder to step 6, `whole OUT` runs the 6 steps at once; both
save the gathered weights in OUT/final.pt (rank 0) for test_checkpoint_format.py to compare.
"""

import os
import sys

import torch
from torch import nn
from torch.utils.data import TensorDataset

from autotune import AutoTrainer
from autotune.ranks.sharded import full_state

mode, *paths = sys.argv[1:]
out = paths[-1]
rank = int(os.environ["RANK"])


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm, self.linear = nn.LayerNorm(16), nn.Linear(16, 16)

    def forward(self, x):
        return x + torch.tanh(self.linear(self.norm(x)))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.head = nn.Linear(16, 3)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


torch.manual_seed(0)
g = torch.Generator().manual_seed(0)
data = TensorDataset(torch.randn(96, 16, generator=g), torch.randint(0, 3, (96,), generator=g))
model = Net()
trainer = AutoTrainer(model, data, loss_fn=nn.functional.cross_entropy, batch_size=16, device="cpu", shard=True,
                      optimizer=lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), run_dir=out, progress=False,
                      monitor=False, checkpoint_interval=None)
if mode == "write":
    trainer.fit(epochs=2, max_steps=3)
elif mode == "resume":
    trainer.fit(epochs=2, max_steps=6, resume=paths[0])
else:
    trainer.fit(epochs=2, max_steps=6)
weights = full_state(model, None)[0]
if rank == 0:
    torch.save({"weights": weights, "step": trainer.step, "samples_seen": trainer.samples_seen},
               os.path.join(out, "final.pt"))
trainer.close()
open(os.path.join(out, f"rank{rank}.done"), "w").close()
