"""The Tuner's options: one frozen record of every keyword of `Tuner` but what it trains (the model,
optimizer, scheduler, loss_fn and step_fn), with the step's options as a part of it (step/options.py).

The Tuner builds it once from its keywords (config.py's `tuner_options`: checked, `inject_oom`
resolved) and hands the parts to the rooms below; `AutoTrainer` forwards the Tuner's options among its
own keywords through `tuner_keywords`, by name. Each field's doc is the user's doc of the keyword
(common/options.py; tuning/arguments.py shows it in the classes' docstrings).

Owns the Tuner's options and their docs. Touches nothing.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from autotune.common.options import keywords, option, part
from autotune.step.options import StepOptions

if TYPE_CHECKING:
    from autotune.decisions.policy import Policy


@dataclasses.dataclass(frozen=True)
class TunerOptions:
    """What a `Tuner` is told besides what it trains (the defaults: `Tuner`'s)."""

    micro_batch_size: int | None = option(None, "samples per forward/backward at the start (default: the whole batch).",
                                          trainer="""samples per forward/backward at the start; default `batch_size`.
        "auto" starts at `batch_size` and lets the policies find the largest that fits.""")
    batch_size: int | None = option(None, """the largest batch you will pass (default: the largest seen so far);
        the micro-batch never grows past it.""", trainer="samples per optimizer step.")
    max_micro_batch_size: int | None = option(None, """the largest micro-batch the policies may grow to (default:
        the batch; a `micro_batch_size` above it starts at it). A micro-batch grown past the one you gave is said
        once on stderr; this keeps yours.""")
    device: str | torch.device | None = option(None, """"cpu", "cuda", "cuda:1" or a `torch.device`; default CUDA
        when available.""")
    policies: str | Path | Sequence[Policy] | None = option("default", """a preset name ("default",
        "conservative"), a path to a TOML preset, or a list of policy objects; None or [] for none (an OOM is
        then an error at once).""")
    memory_cap: float | int | str | None = option(None, """keep memory under this: a fraction of the device
        (0 < f <= 1), bytes (an int), or a size such as "12GiB". On CUDA it is enforced with
        `torch.cuda.set_per_process_memory_fraction`; on CPU it is a soft cap on the resident memory of the
        process and its workers that the policies keep under (the effective cap is the tightest of it, the
        cgroup limit and RLIMIT_AS). It is the denominator of memory pressure.""")
    run_dir: str | Path | None = option(None, "where the journal (events.jsonl) goes; default `runs/<timestamp>`.")
    monitor: bool = option(True, """sample memory in a background process (run_dir/samples.jsonl) and turn it
        into MEMORY_HIGH / MEMORY_PRESSURE events; False turns it off.""")
    monitor_interval: float = option(0.5, "seconds between memory samples (0.05 to 10).")
    tensorboard: bool | str | Path = option(False, """write loss, throughput, memory, micro-batch and every action
        to TensorBoard in `run_dir/tb` (True) or in the folder given; needs the optional `tensorboard`
        package.""")
    progress: bool = option(False, "a tqdm bar (AutoTrainer's).",
                            trainer="show a tqdm bar with loss, micro-batch and memory.")
    memory_snapshot: bool | int = option(False, """CUDA only: keep the allocator's last 100,000 allocations (an
        int: that many) with their Python stacks, and write `run_dir/oom-<step>.pickle` at each OOM, for
        https://pytorch.org/memory_viz; the journal and `autotune report` name the largest allocation sites
        (see memory/history.py).""")
    shard: bool = option(False, """under torchrun, shard the model with FSDP2 (`fully_shard` on each repeated
        block, then the root) instead of replicating it with DDP. A model you sharded yourself is trained as
        it is. Either way an OOM on any rank, in forward or backward, is retried by every rank at the same
        smaller micro-batch (see ranks/sharded.py). Alone, ignored.""")
    reliefs: bool = option(True, """let policies change the model (autocast, activation checkpointing, pruning)
        at the smallest micro-batch; False where another framework owns the optimizer.""")
    step: StepOptions = part(StepOptions)


def tuner_keywords(given: Mapping[str, Any], **resolved: Any) -> dict[str, Any]:
    """The Tuner's options among a host's keywords `given` (its `locals()` at its first line), by name,
    with `resolved` in place of those the host resolved itself (AutoTrainer: the device, the sizes).
    A Tuner option the host does not take is left to the Tuner's default (`reliefs`)."""
    return {name: given[name] for name, *_ in keywords(TunerOptions) if name in given} | resolved
