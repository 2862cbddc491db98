"""GPU check (d): ResNet-50 under a memory cap, against the largest micro-batch a plain loop fits.

The cap is set from two uncapped measurements so that about 96 of the batch's 256 images fit a
step. A plain loop (the batch in micro-batches of one size, accumulated, one SGD step) is probed
under the same `set_per_process_memory_fraction` for its largest size (bisection, two steps a
probe); then AutoTrainer (memory_cap, default preset, the whole batch to start) trains 50 steps.

Asserted: the reserved bytes never pass the cap at any step; <= 4 OOMs; the settled micro-batch
within 10% of the plain loop's largest (or above it); no see-saw (one change of direction at
most); the last 20 steps' throughput >= 0.95 of the plain loop's at its size.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _step import MiB, Report, main  # noqa: E402
import torch  # noqa: E402
import torchvision  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import TensorDataset  # noqa: E402
from autotune import AutoTrainer  # noqa: E402
from autotune.common.oom import is_oom  # noqa: E402

BATCH, IMAGE, CLASSES, SAMPLES, STEPS = 256, 128, 100, 2048, 50


def run(report: Report, device) -> None:
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(SAMPLES, 3, IMAGE, IMAGE, generator=g),
                         torch.randint(0, CLASSES, (SAMPLES,), generator=g))
    x_all, y_all = data.tensors[0][:BATCH].to(device), data.tensors[1][:BATCH].to(device)
    total = torch.cuda.get_device_properties(device).total_memory

    def model():
        torch.manual_seed(0)
        return torchvision.models.resnet50(num_classes=CLASSES).to(device)

    def plain_steps(micro: int, steps: int) -> float:
        """`steps` plain steps at `micro`; seconds per step of the last (an OOM raises)."""
        net = model()
        optimizer = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
        try:
            for _ in range(steps):
                torch.cuda.synchronize(device)
                start = time.perf_counter()
                for a in range(0, BATCH, micro):
                    loss = nn.functional.cross_entropy(net(x_all[a:a + micro]), y_all[a:a + micro])
                    (loss * len(y_all[a:a + micro]) / BATCH).backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                torch.cuda.synchronize(device)
                took = time.perf_counter() - start
            return took
        finally:
            del net, optimizer
            torch.cuda.empty_cache()

    def reserved_peak(micro: int) -> int:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        plain_steps(micro, 2)
        return torch.cuda.max_memory_reserved(device)

    at32, at64 = reserved_peak(32), reserved_peak(64)
    per_image = (at64 - at32) / 32
    cap = int(at32 + per_image * (96 - 32))
    report.figure("reserved peak at 32 / 64 images (MiB)", (at32 // MiB, at64 // MiB))
    report.figure("cap (MiB)", cap // MiB)

    def fits(micro: int) -> bool:
        torch.cuda.empty_cache()
        torch.cuda.set_per_process_memory_fraction(cap / total, device)
        try:
            plain_steps(micro, 2)
            return True
        except Exception as exc:  # cuDNN and cuBLAS say it their own ways: what autotune counts as an OOM
            if not is_oom(exc):
                raise
            return False
        finally:
            torch.cuda.set_per_process_memory_fraction(1.0, device)

    lo, hi = 8, BATCH
    if not report.check("the cap tells sizes apart (8 fits, the whole batch does not)", fits(lo) and not fits(hi)):
        return
    while hi - lo > max(1, lo // 50):
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    plain = report.figure("plain loop's largest micro-batch", lo)
    plain_seconds = min(plain_steps(plain, 3) for _ in range(3))
    report.figure("plain loop: seconds a step at its largest", round(plain_seconds, 4))

    sizes, stamps, peaks = [], [], []

    class Watch:
        def on_step_end(self, trainer):
            torch.cuda.synchronize(device)
            stamps.append(time.perf_counter())
            sizes.append(trainer.knobs.micro_batch_size)
            peaks.append(torch.cuda.max_memory_reserved(device))
            torch.cuda.reset_peak_memory_stats(device)  # after autotune read its own (this step's) figures

    torch.cuda.empty_cache()
    with tempfile.TemporaryDirectory() as folder:
        trainer = AutoTrainer(model(), data, loss_fn=nn.functional.cross_entropy, batch_size=BATCH, device=device,
                              optimizer=lambda p: torch.optim.SGD(p, lr=0.01, momentum=0.9), memory_cap=cap,
                              progress=False, run_dir=folder, callbacks=[Watch()], checkpoint_interval=None)
        torch.cuda.reset_peak_memory_stats(device)
        try:
            result = trainer.fit(epochs=100, max_steps=STEPS)
        finally:
            trainer.close()
            torch.cuda.set_per_process_memory_fraction(1.0, device)
    report.figure("micro-batch by step", sizes)
    report.figure("OOMs", result.ooms)
    over = [(i, p // MiB) for i, p in enumerate(peaks) if p > cap]
    report.check("the cap holds at every step (reserved peak <= cap)", not over, over[:5])
    report.check("<= 4 OOMs", result.ooms <= 4, result.ooms)
    settled = sizes[-1]
    report.check("settled within 10% of the plain loop's largest, or above", settled >= 0.9 * plain,
                 f"{settled} vs {plain}")
    turns = sum(1 for a, b, c in zip(sizes, sizes[1:], sizes[2:]) if (b - a) * (c - b) < 0)
    report.check("no see-saw (one change of direction at most)", turns <= 1, f"{turns} turns")
    last = stamps[-21:]
    auto_seconds = (last[-1] - last[0]) / (len(last) - 1)
    ratio = report.figure("throughput over the plain loop's (last 20 steps)", round(plain_seconds / auto_seconds, 3))
    report.check("throughput >= 0.95 of the plain loop at its size", ratio >= 0.95)


if __name__ == "__main__":
    main(run)
