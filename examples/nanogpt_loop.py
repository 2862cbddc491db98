"""nanoGPT's train.py (karpathy/nanoGPT), moved onto autotune.

Its shape kept: a GPT (nanoGPT's model.py, small: 2 layers, a 4096-token vocabulary), batches drawn at
random offsets of a token stream (`get_batch`), gradient accumulation, AdamW with nanoGPT's
weight-decay groups, a warm-up then cosine learning rate set by hand each iteration, gradient
clipping, and `estimate_loss` every `eval_interval` iterations. `train` is nanoGPT's loop;
`train_tuned` the same with the lines that change marked `# autotune` (docs/loops/tuner.md shows them
as a diff): the accumulation loop goes (the Tuner splits the iteration's batch as memory allows) and
`estimate_loss` evaluates through the Tuner.

    python examples/nanogpt_loop.py            # tuned, under a cap measured here
    python examples/nanogpt_loop.py --plain    # nanoGPT's loop: the allocator's error
    python examples/nanogpt_loop.py --budget-mib 0  # no cap

The cap is measured on this machine: a micro-batch of 4 trains under it and an evaluation batch of
`batch_size` does not (the logits over the vocabulary dominate an LM's evaluation).
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.nn import functional as F

from autotune import Tuner


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int, dropout: float):
        super().__init__()
        self.c_attn = nn.Linear(n_embd, 3 * n_embd, bias=False)
        self.c_proj = nn.Linear(n_embd, n_embd, bias=False)
        self.resid_dropout = nn.Dropout(dropout)
        self.n_head, self.dropout = n_head, dropout

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in self.c_attn(x).split(C, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0, is_causal=True)
        return self.resid_dropout(self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C)))


class Block(nn.Module):
    def __init__(self, n_embd, n_head, dropout):
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(n_embd, bias=False), nn.LayerNorm(n_embd, bias=False)
        self.attn = CausalSelfAttention(n_embd, n_head, dropout)
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd, bias=False), nn.GELU(),
                                 nn.Linear(4 * n_embd, n_embd, bias=False), nn.Dropout(dropout))

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, vocab_size=65, block_size=64, n_layer=2, n_head=4, n_embd=128, dropout=0.0):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab_size, n_embd), nn.Embedding(block_size, n_embd)
        self.drop = nn.Dropout(dropout)
        self.h = nn.ModuleList(Block(n_embd, n_head, dropout) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd, bias=False)
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        self.wte.weight = self.lm_head.weight  # weight tying

    def forward(self, idx, targets=None):
        pos = torch.arange(idx.size(1), device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        loss = None if targets is None else F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
        return logits, loss


@dataclass
class Config:
    vocab_size: int = 4096
    block_size: int = 64
    batch_size: int = 32  # nanoGPT's micro-batch
    gradient_accumulation_steps: int = 2
    max_iters: int = 6
    eval_interval: int = 3
    eval_iters: int = 2
    learning_rate: float = 1e-3
    weight_decay: float = 0.1
    warmup_iters: int = 2
    lr_decay_iters: int = 6
    min_lr: float = 1e-4
    grad_clip: float = 1.0
    seen: dict = field(default_factory=dict)  # what a run measured: losses, estimate_loss's results


Built = tuple["GPT", torch.optim.Optimizer, dict[str, torch.Tensor], dict[str, torch.Generator]]


def build(cfg: Config) -> Built:
    """The model, nanoGPT's AdamW groups (decay on matrices only), the two splits' token streams, and
    a random stream for training's draws and one for evaluation's (nanoGPT draws both from the global
    one; apart, the plain and tuned loops see the same batches though they draw at other moments)."""
    torch.manual_seed(0)
    model = GPT(cfg.vocab_size, cfg.block_size)
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW(groups, lr=cfg.learning_rate, betas=(0.9, 0.95))
    stream = torch.Generator().manual_seed(1)
    data = {"train": torch.randint(cfg.vocab_size, (50_000,), generator=stream),
            "val": torch.randint(cfg.vocab_size, (10_000,), generator=stream)}
    return model, optimizer, data, {"train": torch.Generator().manual_seed(2), "eval": torch.Generator().manual_seed(3)}


def get_lr(it: int, cfg: Config) -> float:
    """nanoGPT's: linear warm-up, cosine decay to `min_lr`."""
    if it < cfg.warmup_iters:
        return cfg.learning_rate * (it + 1) / (cfg.warmup_iters + 1)
    if it > cfg.lr_decay_iters:
        return cfg.min_lr
    decay_ratio = (it - cfg.warmup_iters) / (cfg.lr_decay_iters - cfg.warmup_iters)
    return cfg.min_lr + 0.5 * (1.0 + math.cos(math.pi * decay_ratio)) * (cfg.learning_rate - cfg.min_lr)


def train(model, optimizer, data, streams, cfg: Config) -> None:
    def get_batch(split, stream="train"):
        ix = torch.randint(len(data[split]) - cfg.block_size, (cfg.batch_size,), generator=streams[stream])
        x = torch.stack([data[split][i:i + cfg.block_size] for i in ix])
        y = torch.stack([data[split][i + 1:i + 1 + cfg.block_size] for i in ix])
        return x, y

    @torch.no_grad()
    def estimate_loss():
        out = {}
        model.eval()
        for split in ["train", "val"]:
            losses = torch.zeros(cfg.eval_iters)
            for k in range(cfg.eval_iters):
                X, Y = get_batch(split, "eval")
                logits, loss = model(X, Y)
                losses[k] = loss.item()
            out[split] = losses.mean().item()
        model.train()
        return out

    X, Y = get_batch("train")
    for iter_num in range(cfg.max_iters):
        lr = get_lr(iter_num, cfg)
        for param_group in optimizer.param_groups:
            param_group["lr"] = lr
        if iter_num % cfg.eval_interval == 0:
            cfg.seen.setdefault("estimates", []).append(estimate_loss())
        for micro_step in range(cfg.gradient_accumulation_steps):
            logits, loss = model(X, Y)
            loss = loss / cfg.gradient_accumulation_steps
            X, Y = get_batch("train")
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        cfg.seen.setdefault("losses", []).append(loss.item() * cfg.gradient_accumulation_steps)


def train_tuned(model, optimizer, data, streams, cfg: Config, run_dir: str = "runs/nanogpt") -> Tuner:
    def get_batch(split, stream="train", batch_size=cfg.batch_size):           # autotune: a batch size to ask for
        ix = torch.randint(len(data[split]) - cfg.block_size, (batch_size,), generator=streams[stream])
        x = torch.stack([data[split][i:i + cfg.block_size] for i in ix])
        y = torch.stack([data[split][i + 1:i + 1 + cfg.block_size] for i in ix])
        return x, y

    def lm_loss(model, batch):                                                 # autotune: a micro-batch's loss
        return model(*batch)[1]                                                # autotune

    def estimate_loss():
        out = {}
        for split in ["train", "val"]:
            losses = torch.zeros(cfg.eval_iters)
            for k in range(cfg.eval_iters):
                losses[k] = tuner.evaluate(get_batch(split, "eval"), lm_loss)  # autotune: OOM-resilient, no_grad
            out[split] = losses.mean().item()
        return out

    tuner = Tuner(model, optimizer, micro_batch_size=cfg.batch_size,              # autotune
                  clip_grad_norm=cfg.grad_clip, device="cpu", run_dir=run_dir)  # autotune
    with tuner:
        for iter_num in range(cfg.max_iters):
            lr = get_lr(iter_num, cfg)
            for param_group in optimizer.param_groups:
                param_group["lr"] = lr
            if iter_num % cfg.eval_interval == 0:
                cfg.seen.setdefault("estimates", []).append(estimate_loss())
            # autotune: the iteration's whole batch at once (nanoGPT's micro-steps' samples, in their order)
            batch = get_batch("train", batch_size=cfg.batch_size * cfg.gradient_accumulation_steps)
            loss = tuner.step(batch, lm_loss)                                    # autotune: split, clip, step
            cfg.seen.setdefault("losses", []).append(loss.item())
    return tuner


def measured_headroom(cfg: Config) -> int | None:
    """A cap under which a micro-batch of 4 trains (nanoGPT's step: forward and backward a micro-batch at
    a time, clip, AdamW's step) and an evaluation batch of `batch_size` does not, on this machine
    (under real caps: autotune.memory.limits)."""
    from autotune.memory.limits import calibrate_headroom

    model, optimizer, data, streams = build(cfg)
    x = torch.randint(cfg.vocab_size, (cfg.batch_size, cfg.block_size))

    def step(size: int) -> None:
        for micro in range(0, len(x), size):
            model(x[micro:micro + size], x[micro:micro + size])[1].backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def probe(size: int) -> None:
        if size == cfg.batch_size:  # the evaluation batch
            with torch.no_grad():
                model(x, x)
        else:
            step(size)

    step(4)  # warms the kernels and the allocator before any cap (and makes AdamW's state)
    adam = 2 * sum(p.numel() * p.element_size() for p in model.parameters())
    calibration = calibrate_headroom(probe, fits=4, fails=cfg.batch_size, extra_bytes=adam, fails_extra_bytes=0)
    print(f"memory cap: {calibration}" if calibration.headroom_bytes else f"no memory cap: {calibration}", flush=True)
    return calibration.headroom_bytes


def run(cfg: Config, *, plain: bool, headroom: int | None, run_dir: str = "runs/nanogpt") -> Config:
    """nanoGPT's loop (plain) or the moved one, under a cap of `headroom` bytes (None: none)."""
    from autotune.memory.limits import cap_address_space, lift_address_space_cap

    model, optimizer, data, streams = build(cfg)
    if headroom:
        cap_address_space(headroom)
    try:
        if plain:
            train(model, optimizer, data, streams, cfg)
        else:
            tuner = train_tuned(model, optimizer, data, streams, cfg, run_dir)
            cfg.seen.update(steps=tuner.step_count, ooms=tuner.ooms, micro_batch=tuner.micro_batch_size,
                            eval_ooms=tuner.evaluator.ooms)
    finally:
        lift_address_space_cap()
    cfg.seen["weights"] = [p.detach().clone() for p in model.parameters()]
    return cfg


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--budget-mib", type=float, default=None,
                        help="RLIMIT_AS headroom in MiB (default: measured on this machine; 0: no cap)")
    parser.add_argument("--plain", action="store_true", help="nanoGPT's loop, without the tuner")
    parser.add_argument("--run-dir", default="runs/nanogpt")
    options = parser.parse_args()
    from autotune.memory.limits import fix_mmap_threshold, single_malloc_arena

    single_malloc_arena()
    fix_mmap_threshold()  # what the warm-up frees is unmapped: the cap leaves the room it says
    cfg = Config()
    headroom = measured_headroom(cfg) if options.budget_mib is None else int(options.budget_mib * 2**20)
    seen = run(cfg, plain=options.plain, headroom=headroom, run_dir=options.run_dir).seen
    print(f"done: {seen.get('steps')} iterations, {seen.get('ooms')} OOMs survived in training and "
          f"{seen.get('eval_ooms')} in evaluation, micro-batch {seen.get('micro_batch')}, "
          f"loss {seen['losses'][-1]:.3f}, "
          f"estimate_loss {seen['estimates'][-1]}; `autotune report {options.run_dir}`")


if __name__ == "__main__":
    main()
