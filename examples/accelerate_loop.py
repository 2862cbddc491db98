"""An Accelerate loop with gradient accumulation, kept as it is: `Tuner.step` inside
`accelerator.accumulate(model)` makes each batch survive out-of-memory errors.

The sequence classifier of custom_loop.py (long sequences last in each epoch: memory need jumps
5x), trained with `Accelerator(gradient_accumulation_steps=2)`, a prepared model, optimizer,
scheduler and DataLoader. Under a memory cap (RLIMIT_AS, measured on this machine: a quarter of
a batch of the long sequences fits, the whole batch does not) the tuner splits a batch that does
not fit and retries it; gradients Accelerate holds back between its sync steps are kept aside
meanwhile, so the weights end where the plain Accelerate loop's do. The example trains that
plain loop first, uncapped, and prints how far apart the two end.

    python examples/accelerate_loop.py                 # plain (uncapped), then tuned under the cap
    python examples/accelerate_loop.py --budget-mib 0  # no cap

The lines that change in an Accelerate loop are marked `# autotune`. Two things to know: the step
function divides its loss by the accumulation steps itself (`accelerator.backward` would), and
clipping belongs to the sync step (`accelerator.clip_grad_norm_` there, not `clip_grad_norm=` of
the Tuner, which would clip every batch's partial sum).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).parent))
from custom_loop import Classifier, Sequences, collate, measured_headroom, step_fn  # noqa: E402

from autotune import Tuner  # noqa: E402  # autotune

ACCUMULATE = 2


def build(batch_size: int) -> tuple:
    torch.manual_seed(0)
    model, data = Classifier(), Sequences()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=5, gamma=0.5)
    return model, data, optimizer, scheduler, DataLoader(data, batch_size=batch_size, collate_fn=collate)


def scaled(model: torch.nn.Module, batch: tuple) -> torch.Tensor:
    return step_fn(model, batch) / ACCUMULATE  # what accelerator.backward(loss) divides by  # autotune


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--budget-mib", type=float, default=None,
                        help="RLIMIT_AS headroom in MiB (default: measured on this machine; 0: no cap)")
    parser.add_argument("--run-dir", default="runs/accelerate_loop")
    args = parser.parse_args()

    from autotune.memory.limits import cap_address_space, fix_mmap_threshold, lift_address_space_cap, single_malloc_arena

    single_malloc_arena()
    fix_mmap_threshold()
    accelerator = Accelerator(gradient_accumulation_steps=ACCUMULATE, cpu=True)

    # The plain Accelerate loop, uncapped: what the tuned run must learn too.
    model, data, optimizer, scheduler, loader = build(args.batch_size)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    for _ in range(args.epochs):
        for batch in loader:
            with accelerator.accumulate(model):
                accelerator.backward(step_fn(model, batch))
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
    plain = {k: v.detach().clone() for k, v in accelerator.unwrap_model(model).state_dict().items()}

    model, data, optimizer, scheduler, loader = build(args.batch_size)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    headroom = None if args.budget_mib is None else int(args.budget_mib * 2**20)
    if args.budget_mib is None:
        headroom = measured_headroom(model, data, args.batch_size)
    if headroom:
        cap_address_space(headroom)
    try:
        with Tuner(model, optimizer, scheduler=scheduler, device="cpu", run_dir=args.run_dir) as tuner:  # autotune
            for _ in range(args.epochs):
                for batch in loader:
                    with accelerator.accumulate(model):
                        loss = tuner.step(batch, scaled)  # autotune: forward, backward, step on sync batches
    finally:
        lift_address_space_cap()
    tuned = accelerator.unwrap_model(model).state_dict()
    apart = max((tuned[k] - v).abs().max().item() for k, v in plain.items())
    print(f"done: {tuner.samples_seen} samples, {tuner.ooms} OOMs survived, micro-batch {tuner.micro_batch_size}, "
          f"loss {loss.item() * ACCUMULATE:.3f}; weights vs the plain Accelerate loop: {apart:.1e} apart; "
          f"`autotune report {args.run_dir}`")


if __name__ == "__main__":
    main()
