"""Resuming on another number of ranks: the same optimizer batch, split between this job's ranks.

The user's `batch_size` is each rank's share on the job it was written for, so a checkpoint of
A ranks at batch b resumed on B ranks trains global batches of A*b as before: each rank's batch
is A*b/B, and the position in the epoch's order is the job's, re-split (the ranks' batches k
together are global batch k on any number of ranks: data/sampler.py).

Owns the arithmetic and what is said about it. Touches: the position in the epoch (Progress),
the knobs' batch (through knobs.py), the input pipeline's batch size, the journal.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from autotune.common.notices import warn
from autotune.common.progress import Progress
from autotune.decisions.knobs import Knobs
from autotune.observe.journal import Journal
from autotune.observe.records import Kind


def batch_on_this_world(saved_batch: int, saved_world: int, world: int) -> int:
    """Each rank's batch on a job of `world` ranks for the job's batch of the checkpoint's."""
    global_batch = saved_batch * saved_world
    if global_batch % world:
        raise ValueError(f"the checkpoint was made by {saved_world} ranks at batch_size {saved_batch} each, an "
                         f"optimizer batch of {global_batch}, which {world} ranks cannot share evenly: resume on a "
                         "number of ranks that divides it")
    return global_batch // world


def go_on_with_this_world(counters: Progress, knobs: Knobs, input: Any, journal: Journal, *, saved_batch: int,
                          saved_world: int, world: int, batch_size: int, run_dir: Path) -> None:
    """After loading a checkpoint made by `saved_world` ranks: this job's batch (`batch_size`,
    from `batch_on_this_world`) and the job's position in the epoch's order, said once."""
    counters.regroup(saved_world, world)
    knobs.rebatch(batch_size)
    input.set_batch_size(batch_size)
    global_batch = batch_size * world
    journal.write(Kind.WORLD_CHANGED, counters.step, counters.epoch, from_world=saved_world, to_world=world,
                  batch_size_from=saved_batch, batch_size_to=batch_size, global_batch=global_batch,
                  position=counters.position, micro_batch_size=knobs.micro_batch_size)
    warn(f"resumed on {world} rank{'s' if world > 1 else ''} from a checkpoint of {saved_world}: each rank's batch "
         f"is {batch_size} (was {saved_batch}), so every optimizer step is still one of {global_batch} samples, "
         "in the same order", key=f"world_changed {run_dir}")
