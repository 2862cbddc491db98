"""Evaluation: the loss and metrics over a dataset, in eval mode, under `torch.no_grad()`,
with a micro-batch of its own that survives out-of-memory errors.

    for batch in loader (each rank its share of the samples, in order):
      for micro in split(batch, eval micro-batch):
        loss = step(model, micro); metrics(outputs, targets)   # outputs caught by a forward hook
        OOM: free, halve the eval micro-batch, the same micro-batch again (nothing is lost:
             a micro-batch's figures are kept only once it has run)
        calm: after `grow_after` micro-batches, double; to a size that failed only once
              `forget_after` micro-batches have run since (memory may have been freed since)
    sum the figures over ranks (one all-reduce), divide by their items

A sharded (FSDP2) model all-gathers in every forward, so its ranks go in lockstep instead:
one forward a round on every rank, the same micro-batch size everywhere, a rank whose share
is done running a spare forward (one sample, its figures dropped) until no rank has samples
left; an OOM on any rank fails the round on all (the checks of sharded.py), and every rank
halves and runs its micro-batch again.

The training micro-batch is never touched: evaluation holds no gradients or optimizer
state, so what fits here says little about training, and the other way round.
A metric is `fn(outputs, targets) -> value` (with `loss_fn`; targets: the batch's second
part) or `fn(outputs, micro_batch) -> value` (with `step_fn`), where `value` is the mean over
the micro-batch's samples, or `(mean, n_items)` to be weighted by items.

A loop's own evaluation (`Tuner.evaluate`: nanoGPT's `estimate_loss`, an HF eval loop) takes
the same pieces one batch at a time (`Evaluator.step`), with its own function of the model.

`EvaluationPlan` says when a fit evaluates (every N steps, or each epoch's end) and what a
ReduceLROnPlateau scheduler steps on.

Owns: the evaluation's micro-batch and its OOM state (saved in checkpoints), the evaluation
schedule. Touches: the model (eval mode and back, under no_grad), the journal, the job's
collectives, the scheduler (stepped through OptimizerStep.step_scheduler).
"""

from __future__ import annotations

import time
from typing import Any, Callable, Mapping

import torch
from torch.utils.data import DataLoader, Dataset

from autotune.common.batching import batch_len, is_namedtuple, micro_batches
from autotune.common.notices import warn
from autotune.common.oom import OutOfMemory, is_oom, oom_message
from autotune.memory.figures import describe_memory, free_memory
from autotune.observe.records import Kind
from autotune.ranks.sharded import PeerFailed
from autotune.step.core import StepCore, to_device
from autotune.step.losses import join_outputs, loss_and_items
from autotune.step.optimizer_step import OptimizerStep

Metric = Callable[[Any, Any], Any]


class EvaluationPlan:
    """When a fit evaluates, and what a ReduceLROnPlateau scheduler steps on: an evaluation's
    figure (`scheduler_metric`, default "loss"), or, without an eval_dataset, the epoch's
    training loss ("train_loss")."""

    def __init__(self, stepper: OptimizerStep, dataset: Dataset | DataLoader | None, every: int | str | None,
                 scheduler_metric: str | None):
        self.stepper, self.dataset = stepper, dataset
        self.every = every if every is not None or dataset is None else "epoch"
        self.scheduler_metric = scheduler_metric or ("loss" if dataset is not None else "train_loss")

    @property
    def schedule(self) -> int | str | None:
        """For the run log: every how many steps ("epoch": at each epoch's end), None: never."""
        return self.every if self.dataset is not None else None

    def due_after_step(self, step: int) -> bool:
        return isinstance(self.every, int) and step % self.every == 0

    def due_at_epoch_end(self) -> bool:
        return self.every == "epoch"

    def evaluated(self, metrics: dict[str, float]) -> None:
        """After an evaluation: a plateau scheduler that watches one of its figures steps on it."""
        if self.stepper.plateau and self.scheduler_metric != "train_loss":
            self.stepper.step_scheduler(metrics[self.scheduler_metric])

    def epoch_ended(self, epoch_loss: float | None) -> None:
        """After an epoch (and its evaluation): an epoch-interval scheduler steps, and a plateau
        scheduler that watches the training loss steps on it."""
        if self.stepper.scheduler_interval == "epoch" and not self.stepper.plateau:
            self.stepper.step_scheduler(None)
        elif self.stepper.plateau and self.scheduler_metric == "train_loss":
            self.stepper.step_scheduler(epoch_loss)


class Evaluator:
    """Runs evaluations for one trainer; remembers its micro-batch between them."""

    def __init__(self, core: StepCore, *, batch_size: int | None, collate_fn: Callable | None,
                 metrics: Mapping[str, Metric] | None, journal: Any, grow_after: int = 16, forget_after: int = 256):
        self.core, self.journal = core, journal
        self.batch_size = batch_size or 1  # the largest micro-batch it grows back to
        self.collate_fn = collate_fn
        self.metrics = dict(metrics or {})
        self.micro_batch_size = batch_size  # None: the first batch of `step` sizes it
        self.failed_micro_batch: int | None = None  # the last size that ran out of memory
        self.grow_after, self.forget_after = grow_after, forget_after
        self.calm = 0  # micro-batches run since the last OOM or growth, across batches and evaluations
        self.since_failure = 0  # micro-batches run since the last OOM
        self.ooms = 0

    def loader(self, dataset: Dataset | DataLoader) -> DataLoader:
        if isinstance(dataset, DataLoader):
            return dataset
        dataset = self.core.ranks.share(dataset)  # each rank its share, in order; the sums meet at the end
        return DataLoader(dataset, batch_size=self.batch_size, shuffle=False, collate_fn=self.collate_fn)

    def run(self, dataset: Dataset | DataLoader, step: int, epoch: int) -> dict[str, float]:
        """The mean loss (`"loss"`) and every metric over `dataset`."""
        model = self.core.model
        was_training = model.training
        started, ooms_before, samples = time.perf_counter(), self.ooms, 0
        outputs: list[Any] = [None]
        hook = model.register_forward_hook(lambda _m, _i, out: outputs.__setitem__(0, out)) if self.metrics else None
        names = ["loss", *self.metrics]
        sums = torch.zeros(2 * len(names), dtype=torch.float64, device=self.core.device)  # value, weight pairs
        model.eval()
        try:
            with torch.no_grad():
                # Batch by batch, or (sharded: every forward is collective) in rounds every rank joins.
                samples = self.core.ranks.job.evaluate(
                    self.loader(dataset), lambda batch: self._batch(batch, sums, outputs, step, epoch),
                    lambda batches: self._lockstep(batches, sums, outputs, step, epoch))
        finally:
            outputs[0] = None
            if hook is not None:
                hook.remove()
            model.train(was_training)
        sums = self.core.ranks.sum(sums)
        values = sums.tolist()
        result = {name: values[2 * i] / values[2 * i + 1] if values[2 * i + 1] else float("nan")
                  for i, name in enumerate(names)}
        self.journal.write(Kind.EVALUATE, step, epoch, metrics=result, samples=samples * self.core.ranks.world,
                           micro_batch_size=self.micro_batch_size, ooms=self.ooms - ooms_before,
                           seconds=round(time.perf_counter() - started, 4))
        return result

    def _batch(self, batch: Any, sums: torch.Tensor, outputs: list, step: int, epoch: int) -> int:
        n = batch_len(batch)

        def figures(micro: Any, m: int) -> list[tuple[Any, Any]]:
            return self._figures(to_device(micro, self.core.device), m, outputs)

        for pieces, _ in self.in_pieces(batch, figures, step, epoch, n=n, on_failure=lambda: outputs.__setitem__(0, None)):
            self._add(pieces, sums)
        return n

    def in_pieces(self, batch: Any, run: Callable[[Any, int], Any], step: int, epoch: int, *, n: int | None = None,
                  on_failure: Callable[[], None] | None = None) -> list[tuple[Any, int]]:
        """`run(micro, m)` over `batch` in micro-batches of the evaluation's own size, in order:
        an OOM frees the failed piece, halves the size and runs the same samples again, and
        calm pieces grow it back (module docstring). Returns each piece's result with its
        number of samples. The one OOM-resilient evaluation path: AutoTrainer's figures, and
        the integrations' (HF's `prediction_step` on each piece) go through it."""
        n = batch_len(batch) if n is None else n
        done, results = 0, []
        while done < n:
            size, failed = self.micro_batch_size, None
            try:
                for micro, m in micro_batches(batch, size, start=done, split_fn=self.core.split_fn, total=n):
                    results.append((run(micro, m), m))  # only once the piece ran: an OOM in it keeps nothing
                    done += m
                    self.calm += 1
                    self.since_failure += 1
                    if self.calm >= self.grow_after and self._grow():
                        self.calm = 0
                        break  # the rest of the batch at the larger size
            except Exception as exc:
                if not is_oom(exc):
                    raise
                failed = oom_message(exc)
            if failed is not None:  # outside `except`: the failed micro-batch's tensors can go
                if on_failure is not None:
                    on_failure()
                free_memory(self.core.device)
                self._shrink(size, failed, step, epoch)
                self.calm = self.since_failure = 0
        return results

    def step(self, batch: Any, fn: Callable[[Any, Any], Any], step: int, epoch: int) -> Any:
        """`fn(model, micro)` over one batch of a loop's own evaluation (`Tuner.evaluate`): in eval
        mode, under no_grad and the training's autocast, in pieces of the evaluation's own
        micro-batch (`in_pieces`). The pieces' results in sample order: numbers and 0-d tensors as
        their mean weighted by samples, tensors joined along their first dimension, tuples and
        dicts leaf by leaf."""
        core = self.core
        core.ranks.job.require_free_forwards("Tuner.evaluate", "evaluate with AutoTrainer.evaluate, or unsharded")
        n = batch_len(batch)
        if self.micro_batch_size is None:  # the first batch sizes it; a larger one raises the cap
            self.micro_batch_size = n
        self.batch_size = max(self.batch_size, n)

        def piece(micro: Any, m: int) -> Any:
            micro = to_device(micro, core.device)
            if core.autocast is None:
                return fn(core.model, micro)
            with core.autocast.context():
                return fn(core.model, micro)

        model = core.model
        was_training = model.training
        model.eval()
        try:
            with torch.no_grad():
                pieces = self.in_pieces(batch, piece, step, epoch, n=n)
        finally:
            model.train(was_training)
        return _combined([value for value, _ in pieces], [m for _, m in pieces])

    def _lockstep(self, loader: DataLoader, sums: torch.Tensor, outputs: list, step: int, epoch: int) -> int:
        # A sharded model's evaluation, in rounds of one forward on every rank (module docstring).
        # Every rank halves and grows alike (its counters move in the same rounds), so the
        # micro-batch is the same everywhere without being agreed.
        ranks, device = self.core.ranks, self.core.device
        batches, batch, n, done, samples, spare = iter(loader), None, 0, 0, 0, None
        started = False
        while True:
            if done >= n:  # this rank's next batch, if it has one
                batch = next(batches, None)
                n, done = (batch_len(batch), 0) if batch is not None else (0, 0)
                if batch is not None and spare is None:
                    spare = next(micro_batches(batch, 1, split_fn=self.core.split_fn))[0]
            if not started:  # the first round, on every rank: does every rank have a sample?
                if ranks.job.check(spare is None):
                    raise ValueError("evaluation of a sharded model needs a sample on every rank, and a rank's "
                                     f"share is empty: evaluate at least {ranks.world} samples")
                started = True
            if not ranks.job.check(done < n):  # no rank has samples left: one all-reduce, as the checks
                return samples
            size, failed, peer_failed = self.micro_batch_size, None, False
            try:
                if done < n:
                    micro, m = next(micro_batches(batch, size, start=done, split_fn=self.core.split_fn))
                    self._accumulate(to_device(micro, device), m, sums, outputs)
                else:  # only for the exchanges the other ranks' forwards make
                    m = 0
                    self.core.loss(to_device(spare, device), module=self.core.model)
            except PeerFailed:
                peer_failed = True
            except Exception as exc:
                if not is_oom(exc):
                    raise
                failed = oom_message(exc)
            outputs[0] = None
            if ranks.job.end_attempt(failed is not None, peer_failed) or failed is not None:
                free_memory(device)
                ranks.job.reset_after_failure()
                self._shrink(size, failed or "another rank ran out of memory in this round", step, epoch)
                self.calm = self.since_failure = 0
                continue
            done, samples = done + m, samples + m
            self.calm += 1
            self.since_failure += 1
            if self.calm >= self.grow_after and self._grow():
                self.calm = 0

    def _accumulate(self, micro: Any, m: int, sums: torch.Tensor, outputs: list) -> None:
        self._add(self._figures(micro, m, outputs), sums)

    def _figures(self, micro: Any, m: int, outputs: list) -> list[tuple[Any, Any]]:
        """The micro-batch's (value, weight) of the loss and each metric."""
        loss, items = loss_and_items(self.core.loss(micro, module=self.core.model), self.core.source)
        figures = [(loss, m if items is None else items)]
        targets = micro[1] if self.core.step_fn is None else micro
        for name, metric in self.metrics.items():
            value = metric(outputs[0], targets)
            if isinstance(value, tuple):
                value, weight = value
            else:
                weight = m
            figures.append((value, weight))
        outputs[0] = None
        return figures

    @staticmethod
    def _add(figures: list[tuple[Any, Any]], sums: torch.Tensor) -> None:
        # Only with every figure of the micro-batch in hand: an OOM in any of them loses nothing.
        for i, (value, weight) in enumerate(figures):
            value = torch.as_tensor(value, dtype=torch.float64, device=sums.device)
            weight = torch.as_tensor(weight, dtype=torch.float64, device=sums.device)
            sums[2 * i] += value.detach() * weight
            sums[2 * i + 1] += weight

    def _shrink(self, size: int, message: str, step: int, epoch: int) -> None:
        self.ooms += 1
        self.failed_micro_batch = size
        self.journal.write(Kind.EVAL_OOM, step, epoch, micro_batch_size=size, message=message)
        if size <= 1:
            memory = describe_memory(self.core.device)
            raise OutOfMemory(f"out of memory in evaluation on {self.core.device} even at micro-batch 1. "
                              f"Memory: {memory}. Last error: {message}")
        self.micro_batch_size = size // 2
        warn(f"out of memory in evaluation at micro-batch {size}; the same samples at {size // 2}",
             key=f"eval oom {size}")

    def _grow(self) -> bool:
        bigger = min(self.micro_batch_size * 2, self.batch_size)
        near_failure = self.failed_micro_batch is not None and bigger >= self.failed_micro_batch
        if bigger <= self.micro_batch_size or (near_failure and self.since_failure < self.forget_after):
            return False
        self.micro_batch_size = bigger
        return True

    def state_dict(self) -> dict[str, Any]:
        return {"micro_batch_size": self.micro_batch_size, "failed_micro_batch": self.failed_micro_batch,
                "ooms": self.ooms, "calm": self.calm, "since_failure": self.since_failure}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.micro_batch_size = min(state["micro_batch_size"], self.batch_size)
        self.failed_micro_batch, self.ooms = state["failed_micro_batch"], state["ooms"]
        self.calm, self.since_failure = state["calm"], state["since_failure"]


def _combined(values: list[Any], weights: list[int]) -> Any:
    # Pieces' results as one batch's: scalars averaged by their samples, the rest joined in order.
    first = values[0]
    if isinstance(first, (int, float)) or (isinstance(first, torch.Tensor) and first.ndim == 0):
        return sum(value * m for value, m in zip(values, weights)) / sum(weights)
    if isinstance(first, dict):
        return {key: _combined([value[key] for value in values], weights) for key in first}
    if is_namedtuple(first):
        return type(first)(*(_combined(list(leaves), weights) for leaves in zip(*values)))
    if isinstance(first, tuple):
        return tuple(_combined(list(leaves), weights) for leaves in zip(*values))
    return join_outputs(values)
