"""Callbacks: the user's code at fixed points of `fit`, without a new loop.

A callback is any object with some of these methods (each gets the trainer)::

    on_fit_start(trainer)                 after a resume, before the first batch
    on_step_end(trainer)                  after each optimizer step (trainer.step is its number)
    on_evaluate(trainer, metrics)         after each evaluation (metrics: name -> float)
    on_epoch_end(trainer)                 after each completed epoch
    on_fit_end(trainer, result)           after the end checkpoint, with the FitResult

and optionally `state_dict()` / `load_state_dict(state)`, kept in checkpoints (an EMA of the
weights, an early-stopping counter). `trainer.request_stop(reason)` ends the fit after the
current step, with a checkpoint. `Callback` is a base with every method a no-op.

Under torchrun every rank runs its callbacks; evaluation metrics are the same on every rank,
and a stop any rank requests stops every rank.

Owns: calling the user's callbacks and their checkpoint state, and a stop they ask for.
Touches: the job's collectives (a stop agreed by every rank), the journal.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Sequence

import torch
from loguru import logger

from autotune.observe.records import Kind

HOOKS = ("on_fit_start", "on_step_end", "on_evaluate", "on_epoch_end", "on_fit_end")


class Callback:
    """A base whose hooks do nothing: override the ones you need."""

    def on_fit_start(self, trainer: Any) -> None: ...

    def on_step_end(self, trainer: Any) -> None: ...

    def on_evaluate(self, trainer: Any, metrics: dict[str, float]) -> None: ...

    def on_epoch_end(self, trainer: Any) -> None: ...

    def on_fit_end(self, trainer: Any, result: Any) -> None: ...


class Callbacks:
    """The trainer's callbacks, in the order given."""

    def __init__(self, callbacks: Sequence[Any] | None):
        if callbacks is not None and (isinstance(callbacks, (str, bytes)) or not isinstance(callbacks, Iterable)):
            raise TypeError(f"callbacks={callbacks!r}: pass a list of callback objects (each with one of the hooks "
                            f"{', '.join(HOOKS)}), or None")
        self.items = list(callbacks or [])
        for i, callback in enumerate(self.items):
            if not any(callable(getattr(callback, hook, None)) for hook in HOOKS):
                raise TypeError(f"callbacks[{i}] ({type(callback).__name__}) has none of the hooks {', '.join(HOOKS)}")
        self._by_hook = {hook: [getattr(c, hook) for c in self.items if callable(getattr(c, hook, None))]
                         for hook in HOOKS}

    def __bool__(self) -> bool:
        return bool(self.items)

    def fire(self, hook: str, trainer: Any, *args: Any) -> None:
        for method in self._by_hook[hook]:
            method(trainer, *args)

    def _keys(self) -> list[tuple[str, Any]]:
        return [(f"{i}:{type(c).__name__}", c) for i, c in enumerate(self.items) if callable(getattr(c, "state_dict", None))]

    def state_dict(self) -> dict[str, Any]:
        return {key: callback.state_dict() for key, callback in self._keys()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key, callback in self._keys():
            if key not in state:
                raise ValueError(f"the checkpoint holds no state for callback {key} (it has {sorted(state)}): "
                                 "resume with the callbacks the run was started with")
            callback.load_state_dict(state[key])


class StopRequest:
    """A stop the user's code asked for (`AutoTrainer.request_stop`): the fit ends after the
    current step. Under torchrun a stop any rank asked for stops every rank at the same step
    (one small all-reduce a step, made only when there are callbacks to ask for it)."""

    def __init__(self, ranks: Any, device: torch.device, callbacks: Callbacks):
        self.reason: str | None = None
        self._ranks, self._device = ranks, device
        self._agree = bool(callbacks)  # alone, `ranks.any` is the flag itself: no collective

    def ask(self, reason: str) -> None:
        self.reason = str(reason)

    def clear(self) -> None:
        self.reason = None

    def agreed(self, journal: Any, step: int, epoch: int) -> bool:
        """Whether the fit stops here, on every rank alike; journaled when it does."""
        if self._agree and self._ranks.any(self.reason is not None, self._device) and self.reason is None:
            self.reason = "another rank's callback asked to stop"
        if self.reason is None:
            return False
        journal.write(Kind.STOP_REQUESTED, step, epoch, reason=self.reason)
        logger.info(f"stopping at step {step}: {self.reason}")
        return True
