"""What a host and its Tuner lend each other, as types: `HostFace`, the part of a `Tuner` a host
(AutoTrainer, the HF and Lightning integrations) may use, and `Host`, what a host lends the
Tuner it drives.

A host uses nothing of a Tuner outside `HostFace` and writes nothing into it, not even through a
part it holds (tests/test_faces.py reads the hosts' code for both); the Tuner satisfies the
Protocol (the same test holds its signatures to it). The user's face of a Tuner is the rest of
its public names (tuner.py's docstring).

And `Wiring`, how a host joins the Tuner it builds: the Tuner's one private argument, `_wiring=`
(a user's loop passes none).

Owns the two Protocols and `Wiring`. Touches nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, NoReturn, Protocol

import torch
from torch import nn

from autotune.common.actions import Relief
from autotune.common.events import Event
from autotune.common.progress import Progress
from autotune.common.snapshot import InputState, StepTiming
from autotune.decisions.knobs import Knobs
from autotune.memory.demand import StepDemand
from autotune.monitor.process import MonitorProcess
from autotune.observe.journal import Journal, RunLog
from autotune.ranks.process import Process
from autotune.step.core import StepCore, StepFn
from autotune.step.optimizer_step import OptimizerStep
from autotune.tuning.batch import BatchOutcome


class Host(Protocol):
    """What a host lends the Tuner it drives, held weakly (the host holds the Tuner, not the other
    way round). Without one, the Tuner checkpoints `state_dict()` into run_dir/checkpoints itself
    and knows nothing of the input."""

    def checkpoint_now(self, reason: str, report_failure: bool = True) -> Path | None:
        """Write a checkpoint now (before a relief, before an OOM error); its path, or None."""

    def input_state(self) -> InputState | None:
        """The input pipeline's figures, for the policies' snapshots (None: not known)."""


@dataclass(frozen=True)
class Wiring:
    """How a host (AutoTrainer, the HF and Lightning integrations) joins the Tuner it builds:
    `Tuner(..., _wiring=Wiring(...))`. Not a user's arguments, so not among the public ones."""

    host: Host | None = None  # what it lends (held weakly); None: the Tuner checkpoints itself
    ranks: Process | None = None  # the job it joined; None: from the environment, joined by the Tuner
    counters: Progress | None = None  # the counters it owns and shares with the Tuner
    backward_fn: Callable[[torch.Tensor], Any] | None = None  # its framework's backward; None: loss.backward()
    owns_optimizer: bool = True  # False: its framework steps the optimizer and wraps the model (no DDP here)


class HostFace(Protocol):
    """The Tuner a host drives: one run's lifecycle (`begin`, `train_batch`, `after_batch`, `end`),
    what it asks of the policies and the checkpoints, and the parts it reads."""

    # The parts a host reads (and calls), never replaces.
    core: StepCore
    stepper: OptimizerStep
    knobs: Knobs
    log: RunLog
    journal: Journal
    ranks: Process
    counters: Progress
    demand: StepDemand
    model: nn.Module
    device: torch.device
    run_dir: Path
    monitor_process: MonitorProcess | None
    micro_batch_size: int
    reliefs: list[Relief]
    outputs: Any  # the last batch's outputs its step function handed back (StepResult)

    def begin(self, *, keep_gradients: bool = False, **fit_start: Any) -> None: ...
    def train_batch(self, batch: Any, n: int, *, optimizer_step: bool = True,
                    proposal: Callable[[], dict[str, Any]] | None = None,
                    held: list[tuple[nn.Parameter, torch.Tensor]] | None = None) -> BatchOutcome: ...
    def accumulate(self, batch: Any, step_fn: StepFn, *, n: int | None = None) -> BatchOutcome: ...
    def after_batch(self, timing: StepTiming, n: int, outcome: BatchOutcome) -> None: ...
    def end(self, error: BaseException | None = None, **fit_end: Any) -> None: ...
    def fire(self, event: Event, failed_micro_batch: int | None = None, timing: StepTiming | None = None,
             force: bool = False) -> None: ...
    def listens(self, event: Event) -> bool: ...
    def carry_out(self, relief: Relief | None) -> bool: ...
    def checkpoint(self, reason: str, report_failure: bool = True) -> Path | None: ...
    def give_up_on_the_step(self, why: str) -> NoReturn: ...
    def average_gradients(self) -> None: ...
    def agree_on_micro_batch(self) -> int: ...
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state: dict[str, Any]) -> None: ...
    def tuning_state(self) -> dict[str, Any]: ...
    def load_tuning_state(self, tuning: dict[str, Any]) -> None: ...
    def close(self) -> None: ...
