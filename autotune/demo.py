"""`autotune demo`: a real training run that starts with a batch that does not fit.

A torchvision ResNet-18 learns torchvision's FakeData (or CIFAR-10 from --data DIR when
it is there; nothing is downloaded) under a memory cap the demo sets for its own process.
The first micro-batch runs out of memory; autotune halves it, retries the same batch and
finishes the training, then prints what happened.

On CPU the cap is RLIMIT_AS. oneDNN (mkldnn) convolutions do not always fail cleanly
when an allocation is refused under a hard address-space cap (a crash about one run in
four was measured with ResNet-18), so the demo runs PyTorch's native convolutions while
capped: slower, but every OOM is a clean, catchable error.

Owns: the demo's model, data and cap. Touches: the demo's run folder.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from loguru import logger

# torch is imported inside the functions: `autotune --help` and `autotune monitor` stay light.


def _dataset(data_dir: str | None, samples: int):
    import torch
    import torchvision
    from torchvision import transforms

    normalize = transforms.Compose([transforms.ToTensor(), transforms.Normalize((0.5,) * 3, (0.25,) * 3)])
    if data_dir:
        root = Path(data_dir)
        try:
            full = torchvision.datasets.CIFAR10(root, train=True, download=False, transform=normalize)
        except RuntimeError as exc:
            raise SystemExit(f"--data {root}: no CIFAR-10 there ({exc}); omit --data to use FakeData") from exc
        return torch.utils.data.Subset(full, range(min(samples, len(full)))), "CIFAR-10"
    fake = torchvision.datasets.FakeData(size=samples, image_size=(3, 32, 32), num_classes=10,
                                         transform=normalize, random_offset=0)
    return fake, "FakeData"


def _measured_budget(model, device, batch_size: int) -> int:
    """Room under which a quarter of the batch trains and the whole of it does not, measured on
    this machine with real OOMs on CPU (what a step needs differs from CPU to CPU: autotune.memory.limits).
    On CUDA, where kernels do not change with the CPU, 300 MiB, as the demo always had."""
    import torch
    from torch import nn

    from autotune.memory.limits import calibrate_headroom

    if device.type == "cuda":
        return 300 * 2**20

    def probe(size: int) -> None:
        try:
            x = torch.randn(size, 3, 32, 32)
            nn.functional.cross_entropy(model(x), torch.zeros(size, dtype=torch.long)).backward()
        finally:
            model.zero_grad(set_to_none=True)

    # What the run holds that a probe does not, once it trains at a quarter of the batch: SGD's
    # momentum (from its first step) and, from the second micro-batch of a batch on, the gradients
    # accumulated so far, held through the whole forward (a probe allocates its gradients as
    # backward frees its activations). The size that must fail is the whole batch, as the run's
    # first attempt makes it: with neither (half the batch plus them was measured before, and on an
    # AMX Xeon the whole batch of 256 then fitted under the cap: 0 OOMs).
    parameter_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    calibration = calibrate_headroom(probe, fits=max(1, batch_size // 4), fails=max(2, batch_size),
                                     extra_bytes=2 * parameter_bytes, fails_extra_bytes=0, quick=True)
    if calibration.headroom_bytes is None and calibration.fits_bytes is not None:
        # The whole batch measured too close to a quarter's training need (on a loaded machine the
        # figures move by 20 MiB and more): the quarter's need and a margin still let the quarter
        # train; the whole batch may fit too, and the summary then shows no OOM survived.
        print(f"measured: {calibration}; the cap is a quarter's need + 12 MiB", flush=True)
        return calibration.fits_bytes + 12 * 2**20
    if calibration.headroom_bytes is None:
        raise SystemExit(f"autotune demo: no memory cap found on this machine ({calibration}); "
                         "pass --budget-mib to choose one")
    print(f"measured: {calibration}")
    return calibration.headroom_bytes


def run_demo(args: argparse.Namespace) -> int:
    """Run the demo with parsed CLI arguments; returns the exit code."""
    import torch
    from torch import nn

    from autotune.common.units import format_bytes
    from autotune.memory.limits import cap_address_space, cap_cuda_memory, lift_address_space_cap, single_malloc_arena
    from autotune.trainer import AutoTrainer, resolve_device

    device = resolve_device(args.device)
    if device.type == "cpu":
        single_malloc_arena()  # before any thread allocates: makes what fits repeatable
    import torchvision

    torch.manual_seed(args.seed)
    dataset, name = _dataset(args.data, args.samples)
    model = torchvision.models.resnet18(num_classes=10)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    model.to(device)

    # Warm up threads, allocator arenas and kernels with a tiny step (no optimizer step,
    # so the weights do not change) before the cap, so the cap measures training memory.
    if device.type == "cpu":
        torch.backends.mkldnn.enabled = False
    x = torch.randn(2, 3, 32, 32, device=device)
    nn.functional.cross_entropy(model(x), torch.zeros(2, dtype=torch.long, device=device)).backward()
    model.zero_grad(set_to_none=True)

    if args.tensorboard:
        import torch.utils.tensorboard  # noqa: F401  (imported before the cap: it is large)

    # Built before the cap is measured and set: what it holds is not training memory.
    trainer = AutoTrainer(
        model, dataset, loss_fn=nn.functional.cross_entropy, optimizer=optimizer,
        batch_size=args.batch_size, device=device, run_dir=args.run_dir, seed=args.seed,
        policies=args.policies, progress=not args.no_progress, tensorboard=args.tensorboard,
    )
    budget = None if args.budget_mib is None else int(args.budget_mib * 2**20)
    if budget is None:
        budget = _measured_budget(model, device, args.batch_size)
    if device.type == "cuda":
        fraction = cap_cuda_memory(device, torch.cuda.memory_allocated(device) + budget)
        cap_text = f"torch.cuda.set_per_process_memory_fraction({fraction:.4f})"
    else:
        cap = cap_address_space(budget)
        cap_text = f"RLIMIT_AS {format_bytes(cap)} (virtual size now + {format_bytes(budget)})"
    print(f"autotune demo: ResNet-18 on {len(dataset)} {name} images, {device}, batch {args.batch_size}")
    print(f"memory cap: {cap_text}; the first micro-batch of {args.batch_size} will not fit\n")

    started = time.perf_counter()
    result = trainer.fit(epochs=args.epochs)
    wall = time.perf_counter() - started
    print("\nsummary")
    print(f"  OOMs survived       {result.ooms}")
    print(f"  micro-batch         {args.batch_size} -> {result.micro_batch_size} (batch {result.batch_size}, "
          "gradients accumulated)")
    print(f"  samples trained     {result.samples_seen} ({result.epochs} epochs x {len(dataset)}; none skipped)")
    print(f"  final loss          {result.loss:.4f}")
    print(f"  throughput          {result.samples_seen / wall:.1f} samples/s")
    print(f"  wall time           {wall:.1f} s")
    print(f"  run dir             {result.run_dir} (journal: events.jsonl)")
    if device.type == "cpu":
        lift_address_space_cap()  # the cap was for training; drawing needs matplotlib's own memory
    from autotune.observe.report_plot import plot_timeline

    plot_timeline(result.run_dir)
    print(f"  timeline            {result.run_dir / 'timeline.png'} (autotune report {result.run_dir} for the details)")
    if args.tensorboard:
        print(f"  tensorboard         tensorboard --logdir {result.run_dir / 'tb'}")
    logger.info("demo finished")
    return 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda[:N]")
    parser.add_argument("--data", default=None, help="a folder holding CIFAR-10 (cifar-10-batches-py); default FakeData")
    parser.add_argument("--samples", type=int, default=1536, help="images to train on (default 1536)")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=512)
    parser.add_argument("--budget-mib", type=float, default=None,
                        help="memory the cap leaves for training, in MiB (default: measured on this machine, "
                             "so that a quarter of the batch fits and the whole batch does not)")
    parser.add_argument("--policies", default="default", help="preset name or TOML path")
    parser.add_argument("--run-dir", default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument("--tensorboard", action="store_true",
                        help="also write TensorBoard scalars to RUN_DIR/tb (needs autotune[tensorboard])")
