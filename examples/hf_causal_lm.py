"""Fine-tune a causal language model the Hugging Face way, moved into AutoTrainer unchanged.

A tiny GPT-2 (`GPT2Config`, randomly initialised), a BPE tokenizer trained here on the spot
with `tokenizers` (nothing is downloaded), HF's own collator (`DataCollatorForLanguageModeling`,
which returns a `BatchEncoding` with labels = -100 on padding), bf16 autocast, gradient
clipping, a warm-up schedule, an evaluation every few steps with a token-accuracy metric,
under a memory cap (RLIMIT_AS) that the first micro-batch does not fit.

The step returns `(loss, n_items)`: HF's loss is the mean over label tokens, so autotune
weights micro-batches by tokens and the optimizer step is the same at any micro-batch size.

    pip install 'autotune[hf]'
    python examples/hf_causal_lm.py               # bf16, capped: watch it halve and go on
    python examples/hf_causal_lm.py --precision fp32 --budget-mib 0   # no cap

The cap is measured on this machine (`autotune.memory.limits.calibrate_headroom`): what a step at a
quarter of the batch needs and what the whole batch needs differ from CPU to CPU (on one with
native bf16, each new micro-batch size compiles ~30 MiB of oneDNN kernels), so the headroom is
set between them; where they cannot be told apart the example says so and runs uncapped.
"""

from __future__ import annotations

import argparse
import random

import torch
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from torch.utils.data import Dataset
from transformers import DataCollatorForLanguageModeling, GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

from autotune import AutoTrainer

WORDS = ("the cat dog bird sat ran flew on under over a mat tree roof quickly slowly and then "
         "it was red blue green small big old new happy sad fox jumps lazy brown").split()


def corpus(n: int, seed: int = 0) -> list[str]:
    """Sentences of 4 to 60 words: lengths vary, so padding (and item weighting) matters."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 60))) for _ in range(n)]


def tokenizer_for(texts: list[str]) -> PreTrainedTokenizerFast:
    """A byte-pair tokenizer learned from `texts`, as a transformers tokenizer."""
    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=200, special_tokens=["[PAD]", "[UNK]", "[EOS]"],
                                                            show_progress=False))
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]", eos_token="[EOS]")


class Texts(Dataset):
    """Tokenized sentences, one dict per sample, as HF datasets hand them to a collator."""

    def __init__(self, texts: list[str], tokenizer: PreTrainedTokenizerFast):
        self.samples = [tokenizer(t, truncation=True, max_length=64) for t in texts]

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.samples[i]["input_ids"], "attention_mask": self.samples[i]["attention_mask"]}


def build(samples: int = 256, seed: int = 0, vocab_size: int = 4096):
    """The model, train and eval sets and the collator (the tests train this model too)."""
    texts = corpus(samples + samples // 4, seed)
    tokenizer = tokenizer_for(texts)
    torch.manual_seed(seed)
    # A vocabulary larger than the tokenizer's (unused rows) makes the logits, as in a real
    # LM, the largest activation: that is what runs out of memory first.
    config = GPT2Config(vocab_size=vocab_size, n_positions=64, n_embd=64, n_layer=2, n_head=2,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, pad_token_id=tokenizer.pad_token_id,
                        bos_token_id=tokenizer.eos_token_id, eos_token_id=tokenizer.eos_token_id)
    model = GPT2LMHeadModel(config)
    model.loss_type = "ForCausalLM"  # the mean over label tokens (what n_items below counts)
    # Padded to the full 64 tokens: every batch has the shape the cap was measured at (on a CPU
    # with native bf16 each new shape also compiles new kernels, which the measure would miss).
    collator = DataCollatorForLanguageModeling(tokenizer, mlm=False, return_tensors="pt", pad_to_multiple_of=64)
    return model, Texts(texts[:samples], tokenizer), Texts(texts[samples:], tokenizer), collator


def step(model, batch):
    """HF's loss (mean over label tokens) and how many label tokens it is the mean over."""
    loss = model(**batch).loss
    return loss, (batch["labels"][:, 1:] != -100).sum()  # the model shifts labels by one


def token_accuracy(outputs, batch):
    predicted = outputs.logits[:, :-1].argmax(-1)
    labels = batch["labels"][:, 1:]
    mask = labels != -100
    return (predicted == labels)[mask].float().mean(), mask.sum()


def warmup_then_linear(total_steps: int, warmup: int):
    def factor(step: int) -> float:
        return (step + 1) / warmup if step < warmup else max(0.0, (total_steps - step) / max(1, total_steps - warmup))
    return lambda optimizer: torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def longest_first(train: Texts) -> list[int]:
    """The samples by length, longest first: a cap measured on them holds for every batch."""
    return sorted(range(len(train)), key=lambda i: -len(train[i]["input_ids"]))


def measured_headroom(trainer: AutoTrainer, model, train: Texts, collator, batch_size: int) -> int | None:
    """A cap under which a quarter of the batch fits and the whole batch does not, on this
    machine: forward and backward of the longest samples at each size, under real caps."""
    from autotune.memory.limits import adam_state_bytes, example_headroom

    longest = longest_first(train)
    probe = lambda size: trainer.tuner.core.forward_backward(collator([train[i] for i in longest[:size]]))
    return example_headroom(probe, batch_size, extra_bytes=adam_state_bytes(model))  # AdamW's, at its first step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--precision", default="bf16", choices=("fp32", "bf16", "fp16"))
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--micro-batch", type=int, default=None)
    parser.add_argument("--samples", type=int, default=256)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--budget-mib", type=float, default=None,
                        help="RLIMIT_AS headroom in MiB (default: measured on this machine; 0: no cap)")
    parser.add_argument("--run-dir", default="runs/hf_causal_lm")
    args = parser.parse_args()

    from autotune.memory.limits import cap_address_space, lift_address_space_cap, single_malloc_arena

    single_malloc_arena()
    model, train, evaluation, collator = build(args.samples)
    steps = args.epochs * (len(train) // args.batch_size)
    trainer = AutoTrainer(
        model, train, step_fn=step, collate_fn=collator, batch_size=args.batch_size,
        micro_batch_size=args.micro_batch, device="cpu", run_dir=args.run_dir, progress=False,
        optimizer=lambda params: torch.optim.AdamW(params, lr=3e-3), scheduler=warmup_then_linear(steps, max(1, steps // 4)),
        precision=args.precision, clip_grad_norm=1.0,
        eval_dataset=evaluation, eval_every=max(1, steps // 2), metrics={"token_accuracy": token_accuracy})
    with trainer:
        if args.budget_mib != 0:
            trainer.evaluate()  # warms kernels and the allocator before the cap, as a real run has
            headroom = None if args.budget_mib is None else int(args.budget_mib * 2**20)
            if headroom is None:
                headroom = measured_headroom(trainer, model, train, collator, args.batch_size)
            if headroom is not None:
                cap_address_space(headroom)
        try:
            result = trainer.fit(epochs=args.epochs)
        finally:
            lift_address_space_cap()
    print(f"done: {result.samples_seen} samples, {result.steps} steps, {result.ooms} OOMs survived, "
          f"micro-batch {result.micro_batch_size}, eval loss {result.metrics['loss']:.3f}, "
          f"token accuracy {result.metrics['token_accuracy']:.3f}")


if __name__ == "__main__":
    main()
