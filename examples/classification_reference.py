"""torchvision's classification reference (references/classification/train.py), moved onto autotune.

Its shape kept: a torchvision model (mobilenet_v3_small: BatchNorm and dropout), SGD with momentum and
weight decay, cross-entropy with label smoothing, gradient clipping, a linear warm-up then a cosine
schedule stepped per epoch, an EMA of the weights and buffers updated every `model_ema_steps` optimizer
steps (its `ExponentialMovingAverage`, reset during warm-up), acc@1 and acc@5 of every training batch,
and the EMA model evaluated after each epoch.
`train_one_epoch` and `evaluate` are the reference's; `train_one_epoch_tuned` and `evaluate_tuned` are
the same with the lines that change marked `# autotune` (docs/loops/tuner.md shows them as a diff).

    python examples/classification_reference.py            # tuned, under a cap measured here
    python examples/classification_reference.py --plain    # the reference's loop: the allocator's error
    python examples/classification_reference.py --budget-mib 0  # no cap

The cap is measured on this machine: a quarter of a batch trains under it, the whole batch does not.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import Any

import torch
import torchvision
from torch import nn
from torch.utils.data import DataLoader
from torchvision import transforms

from autotune import StepResult, Tuner


@dataclass
class Args:
    epochs: int = 2
    batch_size: int = 64
    lr: float = 0.1
    momentum: float = 0.9
    weight_decay: float = 1e-4
    label_smoothing: float = 0.1
    clip_grad_norm: float = 1.0
    lr_warmup_epochs: int = 1
    lr_warmup_decay: float = 0.01
    model_ema_steps: int = 1
    model_ema_decay: float = 0.99
    samples: int = 256
    seen: dict = field(default_factory=dict)  # what a run measured: steps, EMA updates, acc@1 per batch


class ExponentialMovingAverage(torch.optim.swa_utils.AveragedModel):
    """The reference's EMA (its utils.py): weights and buffers, `decay * average + (1 - decay) * weights`."""

    def __init__(self, model: nn.Module, decay: float):
        def ema_avg(avg_model_param, model_param, num_averaged):
            return decay * avg_model_param + (1 - decay) * model_param

        super().__init__(model, "cpu", ema_avg, use_buffers=True)


def accuracy(output: torch.Tensor, target: torch.Tensor, topk: tuple[int, ...] = (1,)) -> list[float]:
    """The reference's: the top-k accuracies in percent."""
    with torch.inference_mode():
        _, pred = output.topk(max(topk), 1, True, True)
        correct = pred.t().eq(target[None])
        return [correct[:k].flatten().sum(dtype=torch.float32).item() * 100.0 / target.size(0) for k in topk]


def build(args: Args) -> tuple[nn.Module, DataLoader, DataLoader, torch.optim.Optimizer, Any, nn.Module]:
    """The reference's pieces, seeded: model, loaders, optimizer, warm-up then cosine, the EMA model."""
    torch.manual_seed(0)
    train = torchvision.datasets.FakeData(args.samples, (3, 96, 96), 10, transforms.ToTensor())
    test = torchvision.datasets.FakeData(args.batch_size, (3, 96, 96), 10, transforms.ToTensor(), random_offset=1)
    loader = DataLoader(train, batch_size=args.batch_size, shuffle=True, generator=torch.Generator().manual_seed(0))
    test_loader = DataLoader(test, batch_size=args.batch_size)
    model = torchvision.models.mobilenet_v3_small(num_classes=10)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum,
                                weight_decay=args.weight_decay)
    warmup = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=args.lr_warmup_decay,
                                               total_iters=args.lr_warmup_epochs)
    cosine = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs - args.lr_warmup_epochs)
    scheduler = torch.optim.lr_scheduler.SequentialLR(optimizer, [warmup, cosine], milestones=[args.lr_warmup_epochs])
    return model, loader, test_loader, optimizer, scheduler, ExponentialMovingAverage(model, args.model_ema_decay)


def train_one_epoch(model, criterion, optimizer, data_loader, epoch, args, model_ema):
    model.train()
    for i, (image, target) in enumerate(data_loader):
        output = model(image)
        loss = criterion(output, target)
        optimizer.zero_grad()
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), args.clip_grad_norm)
        optimizer.step()
        if model_ema and i % args.model_ema_steps == 0:
            model_ema.update_parameters(model)
            if epoch < args.lr_warmup_epochs:
                model_ema.n_averaged.fill_(0)  # reset the EMA during warm-up, as the reference does
        acc1, acc5 = accuracy(output, target, topk=(1, 5))
        args.seen.setdefault("acc1", []).append(acc1)  # the reference's metric_logger.update(loss=..., acc1=...)
        args.seen.setdefault("loss", []).append(loss.item())


def evaluate(model, criterion, data_loader):
    model.eval()
    with torch.inference_mode():
        for image, target in data_loader:
            output = model(image)
            loss = criterion(output, target)
            acc1, acc5 = accuracy(output, target, topk=(1, 5))
    return acc1, loss.item()


def train_one_epoch_tuned(tuner, criterion, data_loader, epoch, args, model_ema):
    def step_fn(model, batch):                                                 # autotune: the step, one
        image, target = batch                                                  # autotune: micro-batch at a time
        output = model(image)                                                  # autotune
        return StepResult(criterion(output, target), outputs=output)           # autotune: keep the logits

    for i, (image, target) in enumerate(data_loader):
        loss = tuner.step((image, target), step_fn)  # autotune: forward, backward, clip, step, zero_grad
        if model_ema and i % args.model_ema_steps == 0:
            model_ema.update_parameters(tuner.model)
            if epoch < args.lr_warmup_epochs:
                model_ema.n_averaged.fill_(0)
        acc1, acc5 = accuracy(tuner.outputs, target, topk=(1, 5))  # autotune: the whole batch's logits
        args.seen.setdefault("acc1", []).append(acc1)
        args.seen.setdefault("loss", []).append(loss.item())
        args.seen.setdefault("outputs", []).append(len(tuner.outputs))


def evaluate_tuned(tuner, model, criterion, data_loader):
    model.eval()
    for image, target in data_loader:
        output = tuner.evaluate((image, target), lambda _, batch: model(batch[0]))  # autotune: OOM-resilient
        loss = criterion(output, target)
        acc1, acc5 = accuracy(output, target, topk=(1, 5))
    return acc1, loss.item()


def run(args: Args, *, plain: bool, headroom: int | None, run_dir: str = "runs/classification_reference") -> Args:
    """The reference's main loop (plain) or the moved one, under a cap of `headroom` bytes (None: none)."""
    from autotune.memory.limits import cap_address_space, lift_address_space_cap

    model, data_loader, test_loader, optimizer, lr_scheduler, model_ema = build(args)
    criterion = nn.CrossEntropyLoss(label_smoothing=args.label_smoothing)
    if headroom:
        cap_address_space(headroom)
    try:
        if plain:
            for epoch in range(args.epochs):
                train_one_epoch(model, criterion, optimizer, data_loader, epoch, args, model_ema)
                lr_scheduler.step()
                args.seen["ema_acc1"], _ = evaluate(model_ema, criterion, test_loader)
        else:
            with Tuner(model, optimizer, clip_grad_norm=args.clip_grad_norm, device="cpu",  # autotune
                       run_dir=run_dir) as tuner:                                           # autotune
                for epoch in range(args.epochs):
                    train_one_epoch_tuned(tuner, criterion, data_loader, epoch, args, model_ema)
                    lr_scheduler.step()
                    args.seen["ema_acc1"], _ = evaluate_tuned(tuner, model_ema, criterion, test_loader)
            args.seen.update(steps=tuner.step_count, ooms=tuner.ooms, micro_batch=tuner.micro_batch_size)
    finally:
        lift_address_space_cap()
    first_norm = next(m for m in model.modules() if isinstance(m, nn.BatchNorm2d))
    args.seen.update(ema_updates=int(model_ema.n_averaged), batches_tracked=int(first_norm.num_batches_tracked))
    return args


def measured_headroom(args: Args) -> int | None:
    """A cap under which the reference's step trains a batch in quarters and not whole, on this
    machine (under real caps: autotune.memory.limits), with the momentum buffers its first step adds. The
    probe is the loop's own step (a batch from the loader, forward and backward a micro-batch at a
    time, the optimizer step): a forward and backward alone needed 38 MiB less than that here."""
    from autotune.memory.limits import example_headroom

    model, data_loader, _, optimizer, *_ = build(args)
    criterion = nn.CrossEntropyLoss(label_smoothing=args.label_smoothing)

    def probe(size: int) -> None:
        image, target = next(iter(data_loader))
        for micro in range(0, len(image), size):
            criterion(model(image[micro:micro + size]), target[micro:micro + size]).backward()
        optimizer.step()
        optimizer.zero_grad()

    momentum = sum(p.numel() * p.element_size() for p in model.parameters())
    probe(args.batch_size // 4)  # warms the kernels and the allocator before any cap (and makes the momentum)
    return example_headroom(probe, args.batch_size, extra_bytes=momentum)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--budget-mib", type=float, default=None,
                        help="RLIMIT_AS headroom in MiB (default: measured on this machine; 0: no cap)")
    parser.add_argument("--plain", action="store_true", help="the reference's loop, without the tuner")
    parser.add_argument("--run-dir", default="runs/classification_reference")
    options = parser.parse_args()
    from autotune.memory.limits import fix_mmap_threshold, single_malloc_arena

    single_malloc_arena()
    fix_mmap_threshold()  # what the warm-up frees is unmapped: the cap leaves the room it says
    args = Args(epochs=options.epochs)
    headroom = measured_headroom(args) if options.budget_mib is None else int(options.budget_mib * 2**20)
    seen = run(args, plain=options.plain, headroom=headroom, run_dir=options.run_dir).seen
    print(f"done: {seen.get('steps')} steps, {seen.get('ooms')} OOMs survived, micro-batch {seen.get('micro_batch')}, "
          f"last batch acc@1 {seen['acc1'][-1]:.1f}, EMA acc@1 {seen['ema_acc1']:.1f} "
          f"({seen['ema_updates']} EMA updates); `autotune report {options.run_dir}`")


if __name__ == "__main__":
    main()
