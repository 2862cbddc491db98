"""Which batches are measured: their peak memory read and the policies asked (`Event.BATCH_MEASURED`).

Measuring a batch costs ~0.2 ms on CPU in the middle of a run (two reads of /proc/self/status,
a snapshot, every policy's decision): next to nothing for a large step, a fifth of a 1 ms one.
Only a batch that can tell something new needs it, so a batch is measured when

- it is one of the first `settle` batches after a start, a change of micro-batch size, an
  OOM or a relief (while the sizing is moving, every batch counts), or
- the last measured batch demanded at least `near` of the room (near the cap, every batch
  counts: the relief triggers count steps in a row there), or
- `every` batches, or `interval` seconds, have gone by since the last measured one (the steady
  state is still watched, at least twice a second; a model whose steps take longer than
  `interval` is measured at every step, where the cost is lost in the step). Steps of 2-15 ms
  are measured every `every`: at 1 in 5 (a 10 ms step against 0.05 s) the measuring alone
  cost such a step 0.3-0.5%.

An OOM is never missed: it is caught, and the retry measured, whether the batch was to be
measured or not. `every=1` measures every batch.

Owns: when a batch is measured. Touches nothing (the Tuner asks it, and tells it of changes).
"""

from __future__ import annotations

import time

from autotune.common.validate import check_fraction, check_int, is_number


class MeasureCadence:
    """Decides, batch by batch, whether to measure (see the module docstring)."""

    def __init__(self, every: int = 32, settle: int = 8, near: float = 0.8, interval: float = 0.5):
        check_int("measure cadence", "every", every, 1)
        check_int("measure cadence", "settle", settle, 0)
        check_fraction("measure cadence", "near", near)
        if not is_number(interval) or interval < 0:
            raise ValueError(f"measure cadence: interval must be a number >= 0, got {interval!r}")
        self.every, self.settle, self.near, self.interval = every, settle, near, interval
        self._left = settle  # batches still to measure after the last change
        self._since = every  # batches since the last measured one (the first is measured)
        self._measured_at = 0.0  # perf_counter at the end of the last measured batch
        self._micro: int | None = None
        self.last_measured = False  # whether the batch before this one was measured

    def due(self, micro_batch_size: int) -> bool:
        """Whether the batch about to run at `micro_batch_size` is measured."""
        if micro_batch_size != self._micro:
            self._micro = micro_batch_size
            self.changed()
        return (self._left > 0 or self._since >= self.every
                or time.perf_counter() - self._measured_at >= self.interval)

    def changed(self) -> None:
        """Something moved (an OOM, a relief, the room measured again): measure the next batches."""
        self._left = self.settle

    def done(self, measured: bool, demand: float | None) -> None:
        """After a batch: whether it was measured, and what it demanded if so."""
        self.last_measured = measured
        if not measured:
            self._since += 1
            return
        self._since = 1
        self._measured_at = time.perf_counter()
        self._left = max(0, self._left - 1)
        if demand is not None and demand >= self.near:
            self._left = max(self._left, 1)
