"""Wrap a torchvision model and dataset in AutoTrainer: the 20-line example.

    python examples/torchvision_resnet.py            # FakeData, CPU or CUDA
    python examples/torchvision_resnet.py --data DIR # CIFAR-10 already in DIR (no download)
"""

import argparse

import torch
import torchvision
from torch import nn
from torchvision import transforms

from autotune import AutoTrainer

parser = argparse.ArgumentParser()
parser.add_argument("--data", default=None)
parser.add_argument("--epochs", type=int, default=1)
args = parser.parse_args()

augment = transforms.Compose([transforms.RandomHorizontalFlip(), transforms.ToTensor()])
if args.data:
    dataset = torchvision.datasets.CIFAR10(args.data, train=True, download=False, transform=augment)
else:
    dataset = torchvision.datasets.FakeData(size=512, image_size=(3, 32, 32), num_classes=10, transform=augment)

model = torchvision.models.resnet18(num_classes=10)
trainer = AutoTrainer(
    model, dataset,
    loss_fn=nn.functional.cross_entropy,
    optimizer=lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9),
    batch_size=256,          # the optimizer always sees 256 samples per step
    policies="default",      # on OOM: halve the micro-batch, retry the same batch
)
result = trainer.fit(epochs=args.epochs)
print(f"{result.samples_seen} samples, {result.ooms} OOMs survived, micro-batch {result.micro_batch_size}, "
      f"loss {result.loss:.3f}, journal in {result.run_dir}/events.jsonl")
