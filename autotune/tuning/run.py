"""The parts of one Tuner's run that the rooms of a batch share, wired once (Composer's `State`).

The Tuner makes one `Run` and hands it to the rooms a batch goes through (batch.py, recovery.py,
reactions.py, tuning/relief_ladder.py) instead of the same five objects to each constructor. What a
room owns stays its own; a `Run` holds only what several of them read, and `Lent`: the three
calls that need the whole Tuner (tell the policies, carry out a relief, checkpoint), lent once
here instead of handed down through every call of a batch.

Owns nothing of what it holds (the knobs are knobs.py's to change, the counters progress.py's).
Touches nothing.
"""

from __future__ import annotations

import dataclasses
import weakref
from pathlib import Path
from typing import Any

import torch
from torch import nn

from autotune.common.progress import Progress
from autotune.decisions.knobs import Knobs
from autotune.observe.journal import Journal
from autotune.ranks.process import Process


class Lent:
    """What the Tuner lends the rooms that recover from an OOM and react to the policies: the
    calls that need the whole run. Held weakly: no room keeps the Tuner alive, and no reference
    cycle forms with it (a Tuner dropped without `close()` is collected at once)."""

    def __init__(self, tuner: Any):
        self._tuner = weakref.ref(tuner)

    def fire(self, event: Any, **snapshot: Any) -> None:
        """Tell the policies subscribed to `event` (`Tuner.fire`)."""
        self._tuner().fire(event, **snapshot)

    def carry_out(self, relief: Any) -> bool:
        """Carry out the relief a policy asked for (`Tuner.carry_out`); False if it failed."""
        return self._tuner().carry_out(relief)

    def checkpoint(self, reason: str, report_failure: bool = True) -> Path | None:
        """A checkpoint now, the host's or the Tuner's own (`Tuner.checkpoint`)."""
        return self._tuner().checkpoint(reason, report_failure)


@dataclasses.dataclass(eq=False)
class Run:
    """What the rooms of one Tuner share."""

    model: nn.Module  # the user's model, on the device (the DDP wrapper is the job's: `ranks.module`)
    device: torch.device
    ranks: Process  # the job: its collectives, and `ranks.job` its strategy
    knobs: Knobs  # what policies control
    counters: Progress  # where the run is
    journal: Journal  # events.jsonl (rank 0 writes)
    run_dir: Path
    keep_effective_batch: bool  # a batch is one optimizer step whatever its micro-batches
    lent: Lent  # the Tuner's calls that need the whole run
