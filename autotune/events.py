"""The events the training loop emits, and where each one fires.

A policy subscribes to some of these and is asked to decide when one fires::

    fit():                                          FIT_START
      for epoch:                                    EPOCH_START
        for batch in loader:                        (time blocked in next() = data wait)
          while True:                               # retry the same batch until it fits
            try:
              for micro in split(batch, micro_batch_size):
                loss = step(model, micro) * len(micro) / len(batch)
                loss.backward()
              optimizer.step(); zero_grad()
              break
            except OOM: note it (no reference to the exception is kept)
            clean up outside `except`: zero_grad(set_to_none), gc, empty_cache
                                                    OOM  -> e.g. SetMicroBatch(n // 2)
            at the smallest micro-batch and still OOM: raise autotune.OutOfMemory
                                                    BATCH_END (timing, memory, retries)
          monitor samples -> detectors              MEMORY_HIGH | MEMORY_PRESSURE | IO_BOUND
                                                    EPOCH_END
                                                    FIT_END
"""

from __future__ import annotations

import enum


class Event(str, enum.Enum):
    """A point in the training loop where policies are consulted (see the module docstring)."""

    FIT_START = "fit_start"
    EPOCH_START = "epoch_start"
    OOM = "oom"
    BATCH_END = "batch_end"
    MEMORY_HIGH = "memory_high"
    MEMORY_PRESSURE = "memory_pressure"
    IO_BOUND = "io_bound"
    EPOCH_END = "epoch_end"
    FIT_END = "fit_end"
