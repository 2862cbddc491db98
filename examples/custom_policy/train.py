"""Train with the plug-in policy, named in a preset file (install the plug-in first):

    pip install -e examples/custom_policy
    python examples/custom_policy/train.py
"""

from pathlib import Path

import torch
from torch import nn
from torch.utils.data import TensorDataset

from autotune import AutoTrainer

if __name__ == "__main__":
    data = TensorDataset(torch.randn(1024, 32), torch.randint(0, 4, (1024,)))
    model = nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 4))
    trainer = AutoTrainer(model, data, loss_fn=nn.functional.cross_entropy, batch_size=128, device="cpu",
                          policies=Path(__file__).with_name("preset.toml"), progress=False, monitor=False)
    result = trainer.fit(epochs=2)
    print(f"done: {result.samples_seen} samples; see {result.run_dir}/events.jsonl for the empty_cache actions")
