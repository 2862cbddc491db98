"""The parts of one Tuner's run that the rooms of a batch share, wired once (Composer's `State`).

The Tuner makes one `Run` and hands it to the rooms a batch goes through (batch.py, recovery.py,
reactions.py, relief/ladder.py) instead of the same five objects to each constructor. What a
room owns stays its own; a `Run` holds only what several of them read.

Owns nothing of what it holds (the knobs are knobs.py's to change, the counters progress.py's).
Touches nothing.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
from torch import nn

from autotune.distributed import Ranks, Solo
from autotune.journal import Journal
from autotune.knobs import Knobs
from autotune.progress import Progress


@dataclasses.dataclass(eq=False)
class Run:
    """What the rooms of one Tuner share."""

    model: nn.Module  # the user's model, on the device (the DDP wrapper is the job's: `ranks.module`)
    device: torch.device
    ranks: Solo | Ranks  # the job: its collectives, and `ranks.job` its strategy
    knobs: Knobs  # what policies control
    counters: Progress  # where the run is
    journal: Journal  # events.jsonl (rank 0 writes)
    run_dir: Path
    keep_effective_batch: bool  # a batch is one optimizer step whatever its micro-batches
