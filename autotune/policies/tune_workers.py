"""tune_workers: when the loop waits on its data and cores are idle, load with more workers;
go back when it did not help.

When: `Event.IO_BOUND` to add workers; `Event.BATCH_MEASURED` to judge the change.
What: `SetLoaderWorkers` to twice the current count (at least `step_workers`), up to the
cores this process may use less one for the training loop (or `max_workers`). The loader
is rebuilt at the next batch with the same sample order (and pinned memory on CUDA).
After `judge_steps` steps with the new count (judged at the first measured batch past them:
at most `judge_steps` + 32 steps, cadence.py), samples per second are compared with the
figure before: under `min_gain` better, it returns to the old count and never tries more
than that again in this run (the cores were not idle after all, or the disk is the limit);
its reason says what the trial cost (seconds lost against the rate before it).
Only for loaders the trainer built (a caller's DataLoader is left as it is), and never over
tensors in memory (a TensorDataset, whose batch the loader makes with one gather per tensor:
data/tensors.py): a worker would make the same gather and send the batch back through shared
memory, so the trial could not win, and a short run would pay for it (a 128-step loop of ~5 ms
steps took 1.35x the same run without the trial).

Parameters:
    max_workers: the most workers (default 0: cores available - 1).
    step_workers: the fewest workers to add at once from zero (default 2).
    judge_steps: steps to measure a new count over before judging it (default 20).
    min_gain: the throughput gain a change must bring to stay (default 0.1).

Owns: this policy's state (saved in checkpoints). Touches nothing: it reads a Snapshot and returns actions.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, Sequence

from autotune.common.actions import Action, SetLoaderWorkers
from autotune.common.events import Event
from autotune.common.snapshot import Snapshot
from autotune.common.validate import check_int
from autotune.decisions.policy import PolicyBase


@dataclasses.dataclass
class TuneWorkers(PolicyBase):
    """Raise DataLoader workers while input-bound with idle cores; revert a change that did not help."""

    name: ClassVar[str] = "tune_workers"
    events: ClassVar[frozenset[Event]] = frozenset({Event.IO_BOUND, Event.BATCH_MEASURED})

    max_workers: int = 0
    step_workers: int = 2
    judge_steps: int = 20
    min_gain: float = 0.1

    ceiling: int | None = dataclasses.field(default=None, init=False, repr=False)  # a count that did not help
    trial: dict[str, Any] | None = dataclasses.field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        check_int(self.name, "max_workers", self.max_workers, 0)
        check_int(self.name, "step_workers", self.step_workers, 1)
        check_int(self.name, "judge_steps", self.judge_steps, 1)
        if isinstance(self.min_gain, bool) or not isinstance(self.min_gain, (int, float)) or self.min_gain < 0:
            raise ValueError(f"{self.name}: min_gain must be a number >= 0, got {self.min_gain!r}")

    def decide(self, event: Event, snap: Snapshot) -> Sequence[Action]:
        state = snap.input
        if state is None or not state.loader_owned or state.gathered:
            return []
        if event is Event.BATCH_MEASURED:
            return self._judge(snap)
        if self.trial is not None:
            return []  # still measuring the last change
        limit = self.max_workers or max(0, state.cpu_cores - 1)
        if self.ceiling is not None:
            limit = min(limit, self.ceiling)
        if state.max_workers is not None:  # more could not start (/dev/shm full)
            limit = min(limit, state.max_workers)
        current = state.num_workers
        target = min(limit, max(current * 2, current + self.step_workers) if current else self.step_workers)
        if target <= current:
            return []
        self.trial = {"from": current, "to": target, "step": snap.step, "before": state.samples_per_second}
        return [SetLoaderWorkers(target, reason=f"{state.data_wait_fraction:.0%} of step time waiting for data, "
                                                f"{state.cpu_cores} cores, {current} workers: trying {target}")]

    def _judge(self, snap: Snapshot) -> Sequence[Action]:
        trial, state = self.trial, snap.input
        if trial is not None and state.max_workers is not None and trial["to"] > state.max_workers:
            self.trial = None  # its workers could not start: the loader fell back, there is nothing to judge
            return []
        if trial is None or state.num_workers != trial["to"] or state.steps < self.judge_steps:
            return []
        self.trial = None
        before, after = trial["before"], state.samples_per_second
        if after >= before * (1 + self.min_gain):
            return []
        self.ceiling = trial["from"]
        # What the trial cost: its steps' samples at the rate it gave, beside the rate before it.
        trained = (snap.step - trial["step"]) * snap.batch_size
        lost = trained / after - trained / before if after > 0 and before > 0 else None
        cost = f"; the trial cost ~{lost:.2f} s over {snap.step - trial['step']} steps" if lost is not None else ""
        return [SetLoaderWorkers(trial["from"], reason=f"{trial['to']} workers gave {after:.1f} samples/s vs "
                                                       f"{before:.1f} with {trial['from']}: going back{cost}")]

    def action_suppressed(self, action: Action, why: str) -> None:
        if isinstance(action, SetLoaderWorkers) and self.trial is not None and action.num_workers == self.trial["to"]:
            self.trial = None  # the count never changed: there is nothing to judge, and it may try again

    def state_dict(self) -> dict[str, Any]:
        return {"ceiling": self.ceiling}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.ceiling = state.get("ceiling")
