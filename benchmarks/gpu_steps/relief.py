"""GPU check (e): the relief ladder on CUDA, each rung through the Tuner that carries it out.

torchvision's resnet50, batch 64 at 128x128, AdamW, fp32: the step's peak (allocated above what
was allocated when it began) plain, then with bf16 autocast, then with activation checkpointing
too: each rung must lower it (by how much is kept). Then pruning 10% of the channels: what stays
allocated between steps (weights and AdamW's two moments) must fall by the removed parameters'
bytes, three times over (within 10%).
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _step import MiB, Report, main  # noqa: E402
import torch  # noqa: E402
import torchvision  # noqa: E402
from torch import nn  # noqa: E402
from autotune import Tuner  # noqa: E402
from autotune.common.actions import CheckpointActivations, PruneChannels, UseAutocast  # noqa: E402


def run(report: Report, device) -> None:
    torch.manual_seed(0)
    model = torchvision.models.resnet50(num_classes=100)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(64, 3, 128, 128, generator=g).to(device), torch.randint(0, 100, (64,), generator=g).to(device)

    def plain(m, batch):
        return nn.functional.cross_entropy(m(batch[0]), batch[1])

    with tempfile.TemporaryDirectory() as folder, Tuner(model, lambda p: torch.optim.AdamW(p, lr=1e-4), device=device,
                                                         policies=[], run_dir=folder, monitor=False) as tuner:
        def peak() -> int:
            tuner.step((x, y), plain)  # warm: the optimizer's state, the kernels of this rung
            torch.cuda.synchronize(device)
            before = torch.cuda.memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)
            tuner.step((x, y), plain)
            torch.cuda.synchronize(device)
            return torch.cuda.max_memory_allocated(device) - before

        peaks = {"plain": peak()}
        for name, relief in (("autocast", UseAutocast(reason="check")),
                             ("checkpointing", CheckpointActivations(reason="check"))):
            report.check(f"{name}: carried out", tuner.carry_out(relief), tuner.reliefs)
            peaks[name] = peak()
        for name, value in peaks.items():
            report.figure(f"step peak, {name} (MiB)", round(value / MiB))
        report.check("autocast lowers the step's peak", peaks["autocast"] < peaks["plain"],
                     f"{peaks['autocast'] / peaks['plain']:.2f} of plain")
        report.check("checkpointing lowers it again", peaks["checkpointing"] < peaks["autocast"],
                     f"{peaks['checkpointing'] / peaks['autocast']:.2f} of autocast")

        torch.cuda.synchronize(device)
        held_before = torch.cuda.memory_allocated(device)
        count_before = sum(p.numel() for p in tuner.model.parameters())
        report.check("pruning: carried out", tuner.carry_out(PruneChannels(0.1, reason="check")), tuner.reliefs)
        tuner.step((x, y), plain)
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        held_after = torch.cuda.memory_allocated(device)
        removed = count_before - sum(p.numel() for p in tuner.model.parameters())
        expected = removed * 4 * 3  # fp32 weights, AdamW's exp_avg and exp_avg_sq
        freed = held_before - held_after
        report.figure("pruning: parameters removed", removed)
        report.figure("pruning: freed / expected (MiB)", (round(freed / MiB, 1), round(expected / MiB, 1)))
        report.check("pruning frees the removed weights' and optimizer state's memory",
                     removed > 0 and abs(freed - expected) <= 0.1 * expected, f"{freed / max(expected, 1):.3f}")


if __name__ == "__main__":
    main(run)
