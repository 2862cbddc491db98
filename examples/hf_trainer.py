"""Keep the Hugging Face Trainer: `AutoTuneTrainer` makes its training steps survive OOMs.

The tiny GPT-2 and data of hf_causal_lm.py, trained by `transformers.Trainer`'s own loop
(its optimizer, schedule, clipping, gradient accumulation, logging and checkpoints) under a
memory cap (RLIMIT_AS) that `per_device_train_batch_size` does not fit. The one change is the
class name: each batch is split and retried at a smaller micro-batch on OOM, with
`num_items_in_batch`, so every optimizer step is the one HF would have made.

    pip install 'autotune[hf]'
    python examples/hf_trainer.py                    # capped: watch it halve and go on
    python examples/hf_trainer.py --plain            # transformers.Trainer itself: an OOM
    python examples/hf_trainer.py --resume           # continue from the last checkpoint
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from transformers import Trainer, TrainingArguments

from autotune.integrations.transformers import AutoTuneTrainer  # autotune

sys.path.insert(0, str(Path(__file__).parent))
from hf_causal_lm import build, longest_first  # noqa: E402  (the model, data and collator)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=256)
    parser.add_argument("--epochs", type=float, default=1)
    parser.add_argument("--budget-mib", type=float, default=None,
                        help="RLIMIT_AS headroom in MiB (default: measured on this machine; 0: no cap)")
    parser.add_argument("--plain", action="store_true", help="transformers.Trainer, without autotune")
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--output-dir", default="runs/hf_trainer")
    args = parser.parse_args()

    from autotune.memory.limits import cap_address_space, fix_mmap_threshold, lift_address_space_cap, single_malloc_arena

    single_malloc_arena()
    fix_mmap_threshold()  # what the warm-up frees is unmapped: the cap leaves the room it says
    model, train, evaluation, collator = build(args.samples)
    training = TrainingArguments(
        output_dir=args.output_dir, per_device_train_batch_size=32, gradient_accumulation_steps=2,
        num_train_epochs=args.epochs, learning_rate=3e-3, warmup_steps=1, max_grad_norm=1.0, use_cpu=True,
        save_strategy="steps", save_steps=2, logging_steps=1, report_to="none", disable_tqdm=True, seed=0)
    trainer_class = Trainer if args.plain else AutoTuneTrainer  # autotune: the one line that changes
    trainer = trainer_class(model=model, args=training, train_dataset=train, eval_dataset=evaluation,
                            data_collator=collator)
    if args.budget_mib != 0:
        trainer.evaluate()  # warms kernels and the allocator before the cap, as a real run has
        headroom = None if args.budget_mib is None else int(args.budget_mib * 2**20)
        if headroom is None:  # measured here: a quarter of a device batch fits, the whole one does not
            from autotune.memory.limits import adam_state_bytes, example_headroom

            longest = longest_first(train)

            def probe(size: int) -> None:
                try:
                    model(**collator([train[i] for i in longest[:size]])).loss.backward()
                finally:
                    model.zero_grad(set_to_none=True)

            headroom = example_headroom(probe, training.per_device_train_batch_size,
                                        extra_bytes=adam_state_bytes(model))
        if headroom is not None:
            cap_address_space(headroom)
    try:
        result = trainer.train(resume_from_checkpoint=True if args.resume else None)
    finally:
        lift_address_space_cap()
    tuned = (f", {trainer.tuner.ooms} OOMs survived, micro-batch {trainer.micro_batch_size}; "
             f"`autotune report {args.output_dir}`") if not args.plain else ""
    print(f"done: {result.global_step} steps, train loss {result.training_loss:.3f}{tuned}")


if __name__ == "__main__":
    main()
