"""The arguments `AutoTrainer` and `Tuner` share, documented once and appended to both classes'
docstrings (as Hugging Face shares its docstrings with `add_start_docstrings`), so the two
references cannot drift apart. Each class documents its own arguments itself.

Owns the shared text. Touches the two classes' `__doc__` only.
"""

from __future__ import annotations

from typing import TypeVar

SHARED = """        device: "cpu", "cuda", "cuda:1" or a `torch.device`; default CUDA when available.
        policies: a preset name ("default", "conservative"), a path to a TOML preset, or a
            list of policy objects; None or [] for none (an OOM is then an error at once).
        keep_effective_batch: on OOM, accumulate smaller micro-batches into the same optimizer
            step (True) or make each smaller chunk its own optimizer step (False).
        split_fn: `split_fn(batch, size) -> list of micro-batches` for batch types the
            built-in splitter does not know.
        run_dir: where the journal (events.jsonl) goes; default `runs/<timestamp>`.
        monitor: sample memory in a background process (run_dir/samples.jsonl) and turn
            it into MEMORY_HIGH / MEMORY_PRESSURE events; False turns it off.
        monitor_interval: seconds between memory samples (0.05 to 10).
        scheduler_interval: step the scheduler after each optimizer step ("step") or at each
            epoch end ("epoch"; with a Tuner, `tuner.step_scheduler()` is yours to call).
        precision: "fp32", or "bf16" / "fp16" (autocast; fp16 with a gradient scaler, saved in
            checkpoints). With either, the autocast relief changes nothing.
        clip_grad_norm, clip_grad_value: clip the whole batch's gradient once per optimizer
            step (after every micro-batch, the ranks' average and unscaling); the norm before
            clipping goes to steps.jsonl and TensorBoard.
        compile: `torch.compile` the model (the batch dimension marked dynamic, so micro-batch
            changes do not recompile each time); a dict is passed to torch.compile as options
            (`{"backend": "aot_eager"}`). A model the user compiled is trained as it is.
        memory_cap: keep memory under this: a fraction of the device (0 < f <= 1), bytes (an
            int), or a size such as "12GiB". On CUDA it is enforced with
            `torch.cuda.set_per_process_memory_fraction`; on CPU it is a soft cap on the
            resident memory of the process and its workers that the policies keep under (the
            effective cap is the tightest of it, the cgroup limit and RLIMIT_AS). It is the
            denominator of memory pressure.
        inject_oom: probability per micro-batch of a fake `torch.OutOfMemoryError`, raised
            through the same path as a real one, to test a setup (default: the
            AUTOTUNE_INJECT_OOM environment variable, else off).
        tensorboard: write loss, throughput, memory, micro-batch and every action to
            TensorBoard in `run_dir/tb` (True) or in the folder given; needs the optional
            `tensorboard` package.
        memory_snapshot: CUDA only: keep the allocator's last 100,000 allocations (an int: that
            many) with their Python stacks, and write `run_dir/oom-<step>.pickle` at each OOM,
            for https://pytorch.org/memory_viz; the journal and `autotune report` name the
            largest allocation sites (see memory_history.py).
        shard: under torchrun, shard the model with FSDP2 (`fully_shard` on each repeated block,
            then the root) instead of replicating it with DDP. A model you sharded yourself is
            trained as it is. Either way an OOM on any rank, in forward or backward, is retried
            by every rank at the same smaller micro-batch (see sharded.py). Alone, ignored.
        on_nonfinite: a batch with NaN or inf gradients is never trained on: "skip" its optimizer
            step (the default; journaled, said once on stderr, its samples not counted as trained)
            or "stop" with `autotune.NonFiniteStep` (AutoTrainer: after a checkpoint of the last
            finite step). A model whose weights are not finite is never checkpointed.
"""

T = TypeVar("T")


def with_shared_arguments(cls: T) -> T:
    """Append `SHARED` to `cls`'s docstring, whose Args section comes last: the shared entries
    continue it."""
    cls.__doc__ = (cls.__doc__ or "").rstrip() + "\n" + SHARED
    return cls
