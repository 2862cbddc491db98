"""Where a run is: the counters every part reads and a checkpoint saves; what a fit did.

Owns the counters and every change to them: the parts that move them (the optimizer step, OOM
recovery, the Tuner, its host) call `Progress`'s methods, and nothing else writes a field
(tests/test_faces.py reads the package for it). Touches nothing.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any


@dataclasses.dataclass
class Progress:
    """The run's counters. The optimizer step advances `step` and `samples_seen` (when a step
    completes); OOM recovery `ooms` and `nonfinite_steps` (the skipped steps it journals); the
    host the position in the epoch."""

    step: int = 0  # optimizer steps, across fit() calls
    epoch: int = 0  # epochs completed
    position: int = 0  # samples of the current epoch already trained (where a resume restarts)
    batches_done: int = 0  # batches of the current epoch already trained
    samples_seen: int = 0  # each sample counted once per epoch, when its optimizer step completed
    ooms: int = 0  # out-of-memory errors survived
    nonfinite_steps: int = 0  # optimizer steps skipped on NaN or inf gradients
    world: int = 1  # ranks of the job these counters are of (`position` is each rank's: the job's is position x world)
    epoch_world: int = 1  # ranks the current epoch began on: its order is padded for them (data/sampler.py)

    def stepped(self, samples: int) -> None:
        """An optimizer step completed, over `samples` samples (every rank's)."""
        self.step += 1
        self.samples_seen += samples

    def unstepped(self, samples: int) -> None:
        """The last step was found not taken after all (its non-finite check, read late)."""
        self.step -= 1
        self.samples_seen -= samples

    def accumulated(self, samples: int) -> None:
        """Samples whose gradients went into a framework's step (`Tuner.accumulate`)."""
        self.samples_seen += samples

    def survived_oom(self) -> None:
        self.ooms += 1

    def skipped_nonfinite(self) -> None:
        """An optimizer step was not taken: its gradients held a NaN or an inf."""
        self.nonfinite_steps += 1

    def on_ranks(self, world: int, epoch_too: bool = False) -> None:
        """The counters are of a job of `world` ranks from here (`epoch_too`: the epoch begins on them)."""
        self.world = world
        if epoch_too:
            self.epoch_world = world

    def batch_trained(self, n: int) -> None:
        """A batch of `n` samples of the epoch trained (the host's)."""
        self.position += n
        self.batches_done += 1

    def epoch_ended(self) -> None:
        self.epoch += 1
        self.position = self.batches_done = 0

    def regroup(self, saved_world: int, world: int) -> None:
        """The epoch's position of a job of `saved_world` ranks, on `world` (world_change.py)."""
        self.position = self.position * saved_world // world  # a whole number of global batches

    def follow(self, step: int, epoch: int | None = None) -> None:
        """A framework's own step (and epoch) count, for the records of a Tuner it drives."""
        self.step = step
        if epoch is not None:
            self.epoch = epoch

    def restore_totals(self, samples_seen: int | None = None, ooms: int | None = None) -> None:
        """What a run had done before an integration's checkpoint (`Tuner.tuning_state`), where saved."""
        if samples_seen is not None:
            self.samples_seen = samples_seen
        if ooms is not None:
            self.ooms = ooms

    def fit_result(self, knobs: Any, keep_effective_batch: bool, **fit: Any) -> "FitResult":
        """What a fit did, by these counters and the sizes it ended at (`knobs`); `fit`: the
        loss, wall time, run folder, metrics and stop reason, as `FitResult` names them."""
        step_size = knobs.batch_size if keep_effective_batch else min(knobs.micro_batch_size, knobs.batch_size)
        return FitResult(samples_seen=self.samples_seen, steps=self.step, epochs=self.epoch, batch_size=step_size,
                         micro_batch_size=knobs.micro_batch_size, ooms=self.ooms,
                         nonfinite_steps=self.nonfinite_steps, **fit)

    def state_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for field in dataclasses.fields(self):
            setattr(self, field.name, state[field.name])


@dataclasses.dataclass(frozen=True)
class FitResult:
    """What `AutoTrainer.fit` did."""

    samples_seen: int  # each sample counted once per epoch, when its optimizer step completed
    steps: int  # optimizer steps
    epochs: int  # epochs completed
    batch_size: int  # samples per optimizer step at the end
    micro_batch_size: int  # samples per forward/backward at the end
    ooms: int  # out-of-memory errors survived
    loss: float | None  # mean training loss over the last epoch's completed steps
    wall_seconds: float
    run_dir: Path
    metrics: dict[str, float] = dataclasses.field(default_factory=dict)  # the last evaluation's ("loss", ...)
    stopped: str | None = None  # why a callback's request_stop ended the fit early
    nonfinite_steps: int = 0  # optimizer steps skipped on NaN or inf gradients (the run's, as `ooms`)

    @property
    def samples_per_second(self) -> float:
        return self.samples_seen / self.wall_seconds if self.wall_seconds > 0 else 0.0
