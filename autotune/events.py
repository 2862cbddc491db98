"""The events the training loop emits. A policy subscribes to some of them and is asked to
decide when one fires.

Where each one fires is drawn once, as the loop itself, in the docstring of
`autotune/trainer.py` (one copy, so the picture and the loop cannot drift apart).
"""

from __future__ import annotations

import enum


class Event(str, enum.Enum):
    """A point in the training loop where policies are consulted (see autotune/trainer.py)."""

    FIT_START = "fit_start"
    EPOCH_START = "epoch_start"
    OOM = "oom"
    BATCH_END = "batch_end"  # after every batch
    BATCH_MEASURED = "batch_measured"  # after a batch whose memory was measured (cadence.py): the step's need
    MEMORY_HIGH = "memory_high"
    MEMORY_PRESSURE = "memory_pressure"
    IO_BOUND = "io_bound"
    EPOCH_END = "epoch_end"
    FIT_END = "fit_end"
