"""Keep your own training loop: `Tuner.step` makes each step survive out-of-memory errors.

A sequence classifier trained by a hand-written loop over a DataLoader, with AdamW, a cosine
schedule and gradient clipping. The data is bucketed by length, so the long sequences come
last in each epoch, as in many real pipelines: the first batches fit, then memory need jumps
5x. Under a memory cap (RLIMIT_AS) the plain loop dies at that point (try
`--plain`); with the tuner the same batch is split and retried, nothing is skipped, and the
optimizer step is the one the whole batch would have made.

    python examples/custom_loop.py                # tuned, capped: watch it halve and go on
    python examples/custom_loop.py --plain        # the same loop without the tuner: an OOM
    python examples/custom_loop.py --budget-mib 0 # no cap

The cap is measured on this machine: a quarter of a batch of the long sequences fits under it,
the whole batch does not (kernels and their memory differ from CPU to CPU).

The five lines that change in a loop you already have are marked `# autotune`.
"""

from __future__ import annotations

import argparse

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from autotune import Tuner


class Sequences(Dataset):
    """Token sequences labelled by their most frequent token class; short ones first (bucketing)."""

    def __init__(self, n: int = 640, short: int = 32, long: int = 160, long_share: float = 0.1, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        n_long = int(n * long_share)
        self.samples = [torch.randint(0, 256, (short if i < n - n_long else long,), generator=g) for i in range(n)]

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = self.samples[i]
        return tokens, torch.bincount(tokens % 4, minlength=4).argmax()


def collate(samples: list) -> tuple[torch.Tensor, torch.Tensor]:
    tokens, labels = zip(*samples)
    return nn.utils.rnn.pad_sequence(list(tokens), batch_first=True), torch.stack(labels)


class Classifier(nn.Module):
    def __init__(self, vocab: int = 256, dim: int = 64, hidden: int = 512):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.conv = nn.Sequential(nn.Conv1d(dim, hidden, 5, padding=2), nn.ReLU(), nn.Conv1d(hidden, dim, 5, padding=2))
        self.head = nn.Linear(dim, 4)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.conv(self.embed(tokens).transpose(1, 2))
        return self.head(h.mean(-1))


def step_fn(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    tokens, labels = batch
    return nn.functional.cross_entropy(model(tokens), labels)


def measured_headroom(model: nn.Module, data: Sequences, batch_size: int) -> int | None:
    """A cap under which a quarter of a batch of the longest sequences fits and the whole batch
    does not, on this machine (forward and backward under real caps: autotune.memory.limits)."""
    from autotune.memory.limits import adam_state_bytes, example_headroom

    longest = sorted(range(len(data)), key=lambda i: -len(data.samples[i]))

    def probe(size: int) -> None:
        try:
            step_fn(model, collate([data[i] for i in longest[:size]])).backward()
        finally:
            model.zero_grad(set_to_none=True)

    return example_headroom(probe, batch_size, extra_bytes=adam_state_bytes(model))  # AdamW's, at its first step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--budget-mib", type=float, default=None,
                        help="RLIMIT_AS headroom in MiB (default: measured on this machine; 0: no cap)")
    parser.add_argument("--plain", action="store_true", help="the loop without the tuner")
    parser.add_argument("--run-dir", default="runs/custom_loop")
    args = parser.parse_args()

    from autotune.memory.limits import cap_address_space, fix_mmap_threshold, lift_address_space_cap, single_malloc_arena

    single_malloc_arena()
    fix_mmap_threshold()  # what the warm-up frees is unmapped: the cap leaves the room it says
    torch.manual_seed(0)
    model = Classifier()
    data = Sequences()
    loader = DataLoader(data, batch_size=args.batch_size, collate_fn=collate)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.epochs * len(loader))
    step_fn(model, next(iter(loader))).backward()  # warms kernels and the allocator before the cap
    optimizer.zero_grad()
    headroom = None if args.budget_mib is None else int(args.budget_mib * 2**20)
    if args.budget_mib is None:
        headroom = measured_headroom(model, data, args.batch_size)
    if headroom:
        cap_address_space(headroom)
    try:
        if args.plain:
            for _ in range(args.epochs):
                for batch in loader:
                    loss = step_fn(model, batch)
                    loss.backward()
                    nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                    optimizer.step()
                    scheduler.step()
                    optimizer.zero_grad()
            print(f"done: plain loop, loss {loss.item():.3f}")
            return
        with Tuner(model, optimizer, scheduler=scheduler, clip_grad_norm=1.0,  # autotune
                   device="cpu", run_dir=args.run_dir) as tuner:              # autotune
            for _ in range(args.epochs):
                for batch in loader:
                    loss = tuner.step(batch, step_fn)  # autotune: forward, backward, clip, step, schedule
                # autotune: eval mode, no_grad, an OOM-resilient micro-batch of its own
                eval_loss = tuner.evaluate(batch, step_fn)
    finally:
        lift_address_space_cap()
    print(f"done: {tuner.samples_seen} samples, {tuner.step_count} steps, {tuner.ooms} OOMs survived, "
          f"micro-batch {tuner.micro_batch_size}, loss {loss.item():.3f}, last batch's eval loss "
          f"{float(eval_loss):.3f}; `autotune report {args.run_dir}`")


if __name__ == "__main__":
    main()
