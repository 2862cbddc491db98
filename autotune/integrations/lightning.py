"""Lightning: a `LightningModule`'s `training_step` that survives out-of-memory errors.

    from autotune.integrations.lightning import AutoTuneStrategy, AutoTuneDDPStrategy
    trainer = L.Trainer(strategy=AutoTuneStrategy(), ...)            # one device
    trainer = L.Trainer(strategy=AutoTuneDDPStrategy(), devices=2)   # DDP (torchrun or Lightning's launcher)

The strategy is where Lightning calls `training_step` and `backward`, and where DDP syncs
gradients, so that is where the retry goes (a callback cannot repeat a training step, and a
LightningModule mixin runs inside DDP's forward, whose backward would sync while another rank
may still be failing). Under automatic optimisation, each batch goes through
`Tuner.accumulate`: your `training_step` runs on micro-batches, each loss weighted by its share
of the batch and by 1/accumulate_grad_batches and backpropagated through Lightning's precision
plugin; on OOM the same batch runs again at a smaller micro-batch. Lightning then steps its own
optimizer (clipping, schedulers, `accumulate_grad_batches`, loggers unchanged).

Under DDP the ranks agree after every attempt (one small all-reduce, as in `AutoTrainer`), and
gradients are averaged once, just before the optimizer step, in one flat all-reduce: DDP's
own sync inside backward is never used. The micro-batch is saved in Lightning's checkpoints
(`checkpoint["autotune"]`) and restored with `ckpt_path=`. The journal goes to the trainer's
`log_dir`. Reliefs are off (Lightning owns the optimizer).

What runs per micro-batch, and what per batch: `training_step`, `validation_step`, `test_step`,
`predict_step` and the backward hooks (`on_before_backward`, `on_after_backward`) run once per
micro-batch (a failed attempt's included); what they `self.log` is put back together into one
call a name for the batch, each value weighted by its micro-batch's samples (or the
`batch_size=` it was logged with) and logged with the batch's size, a failed attempt's calls
dropped: `train_loss_epoch`, `val_loss` and what `ModelCheckpoint`/`EarlyStopping` watch are
those of a run without micro-batches. Validation, test, predict and the sanity check have an
evaluation micro-batch of their own (evaluation.py): halved on OOM, the same samples again;
a step's returned loss is the batch's, predictions are concatenated. Batch hooks
(`on_train_batch_start/end`, `on_validation_batch_end`) run once per batch.

Owns: Lightning's side (the strategies, their checkpoint key). Touches the Tuner only through its
host face, and the module's gradients (set aside and added back around Lightning's backward).
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Callable

import torch
from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy

from autotune.common.batching import batch_len
from autotune.common.progress import Progress
from autotune.observe.records import Kind
from autotune.ranks.distributed import Ranks, Solo
from autotune.ranks.process import Process
from autotune.training.evaluation import Evaluator
from autotune.tuner import Tuner
from autotune.tuning.batch import add_gradients, set_aside_gradients
from autotune.tuning.host_face import Wiring

STATE_KEY = "autotune"


class _TunedSteps:
    """What both strategies add: the training step through a Tuner, and its state in checkpoints."""

    tuner: Tuner | None = None

    def _autotune_init(self, tuner_options: dict[str, Any] | None) -> None:
        self.tuner_options = dict(tuner_options or {})
        self.tuner = None
        self._pending_state: dict[str, Any] | None = None
        self._counters = Progress()  # Lightning's step and epoch, shared with the Tuner
        self._computed: list[tuple[torch.nn.Parameter, torch.Tensor]] = []  # training_step's gradients
        self._evaluator: Evaluator | None = None  # validation/test/predict's own micro-batch

    @property
    def micro_batch_size(self) -> int | None:
        """Samples per forward/backward now (None before the first step)."""
        return self.tuner.micro_batch_size if self.tuner is not None else None

    def _ranks(self) -> Process:
        return Solo()

    def _make_tuner(self) -> Tuner:
        module = self.lightning_module
        trainer = module.trainer
        if not module.automatic_optimization:
            raise ValueError("autotune's Lightning strategies need automatic optimisation: with manual "
                             "optimisation, call Tuner.accumulate in your own training_step")
        ranks = self._ranks()
        run_dir = ranks.broadcast_object(str(trainer.log_dir or trainer.default_root_dir))
        tuner = Tuner(module, device=self.root_device, run_dir=Path(run_dir), reliefs=False,
                      _wiring=Wiring(ranks=ranks, counters=self._counters, backward_fn=self._micro_backward,
                                     owns_optimizer=False), **self.tuner_options)
        if self._pending_state is not None:
            tuner.load_tuning_state(self._pending_state)
            tuner.journal.write(Kind.RESUME, trainer.global_step, trainer.current_epoch, found=True,
                                micro_batch_size=tuner.micro_batch_size)
            self._pending_state = None
        return tuner

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        """The module's `training_step` over micro-batches of the batch, with OOM retries."""
        if self.tuner is None:
            self.tuner = self._make_tuner()
        module = self.lightning_module
        trainer = module.trainer
        batch, rest = args[0], args[1:]
        n = batch_len(batch)
        scale = 1.0 / trainer.accumulate_grad_batches
        extras: dict[str, Any] = {}

        logs = _Logs(module)

        def micro_loss(_: torch.nn.Module, micro: Any) -> torch.Tensor:
            # A failed attempt's logs are dropped: each call is tagged with the OOMs survived so far.
            with logs.piece(batch_len(micro), attempt=self._counters.ooms):
                out = module.training_step(micro, *rest, **kwargs)
            loss = out["loss"] if isinstance(out, Mapping) else out
            if not isinstance(loss, torch.Tensor):
                raise TypeError(f"training_step returned {type(out).__name__}: autotune needs the loss "
                                "(a tensor, or a dict with 'loss')")
            if isinstance(out, Mapping):
                extras.update((k, v) for k, v in out.items() if k != "loss")
            share = (n if micro is batch else batch_len(micro)) / n * scale
            return loss if share == 1 else loss * share  # the whole batch, no accumulation: as it is

        self._counters.follow(trainer.global_step, trainer.current_epoch)
        # Lightning zeroes gradients after training_step, before backward (on an optimizer step's
        # first batch): the batch's gradients are computed apart from those already there, and
        # added to them where Lightning then calls backward (below), as a plain backward would.
        parameters = self.tuner.core.parameters()  # the module's, walked once
        earlier = set_aside_gradients(parameters)
        with self.precision_plugin.train_step_context():
            outcome = self.tuner.accumulate(batch, micro_loss, n=n)
        logs.replay(n, attempt=self._counters.ooms)  # one value a name for the batch, as without pieces
        self._computed = set_aside_gradients(parameters)
        add_gradients(earlier)
        loss = outcome.loss_sum.detach()  # the batch's mean loss, as training_step would return it
        if scale != 1:
            loss = loss / scale
        return {"loss": loss, **extras} if extras else loss

    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        """The module's `validation_step` (the sanity check's too) on pieces of the batch that
        survive OOMs (the evaluation's own micro-batch: evaluation.py), logged as one batch."""
        return self._evaluation_step("validation_step", self.precision_plugin.val_step_context, args, kwargs)

    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        """The module's `test_step`, as `validation_step`."""
        return self._evaluation_step("test_step", self.precision_plugin.test_step_context, args, kwargs)

    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        """The module's `predict_step` on pieces of the batch; tensor predictions concatenated."""
        return self._evaluation_step("predict_step", self.precision_plugin.predict_step_context, args, kwargs)

    def _evaluation_step(self, hook: str, context: Callable[[], Any], args: tuple, kwargs: dict[str, Any]) -> Any:
        if self.tuner is None:
            self.tuner = self._make_tuner()
        module = self.lightning_module
        trainer = module.trainer
        batch, rest = args[0], args[1:]
        n = batch_len(batch)
        if self._evaluator is None:
            self._evaluator = Evaluator(self.tuner.core, batch_size=n, collate_fn=None, metrics=None,
                                        journal=self.tuner.journal)
        self._evaluator.batch_size = max(self._evaluator.batch_size, n)  # the micro-batch may grow to the largest
        logs = _Logs(module)
        step = getattr(module, hook)  # the module's own, not through DDP's forward (no collective inside)

        def piece(micro: Any, m: int) -> Any:
            with logs.piece(m, attempt=0), context():
                return step(micro, *rest, **kwargs)

        pieces = self._evaluator.in_pieces(batch, piece, trainer.global_step, trainer.current_epoch, n=n)
        logs.replay(n, attempt=0)
        return _combined([out for out, _ in pieces], [m for _, m in pieces], n, concatenate=hook == "predict_step")

    def _micro_backward(self, loss: torch.Tensor) -> None:
        # Lightning's backward (precision plugin: loss scaling, the backward hooks) on one micro-batch.
        super().backward(loss, None)  # type: ignore[misc]

    def backward(self, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        # Lightning's call after training_step: the micro-batches' backward already ran there.
        add_gradients(self._computed)
        self._computed = []
        return closure_loss

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        if self.tuner is not None:
            checkpoint[STATE_KEY] = self.tuner.tuning_state()
        super().save_checkpoint(checkpoint, filepath, storage_options)  # type: ignore[misc]

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only=weights_only)  # type: ignore[misc]
        if STATE_KEY in checkpoint:
            if self.tuner is not None:
                self.tuner.load_tuning_state(checkpoint[STATE_KEY])
            else:
                self._pending_state = checkpoint[STATE_KEY]
        return checkpoint

    def on_train_end(self) -> None:
        # Every rank, after a fit that completed: one micro-batch everywhere (a policy may have
        # moved one rank's after the last agreement), as AutoTrainer ends its fits.
        if self.tuner is not None:
            self.tuner.agree_on_micro_batch()
        super().on_train_end()  # type: ignore[misc]

    def teardown(self) -> None:
        if self.tuner is not None:
            self._counters.follow(self.lightning_module.trainer.global_step if self.lightning_module else 0)
            self.tuner.end()
        super().teardown()  # type: ignore[misc]


class AutoTuneStrategy(_TunedSteps, SingleDeviceStrategy):
    """One device (`SingleDeviceStrategy`) with OOM-resilient training steps.

    Args:
        device: default CUDA when available, else CPU.
        tuner_options: passed to `Tuner` (`policies`, `memory_cap`, `micro_batch_size`, `monitor`, ...).
        **kwargs: `SingleDeviceStrategy`'s.
    """

    def __init__(self, device: str | torch.device | None = None, *, tuner_options: dict[str, Any] | None = None,
                 **kwargs: Any):
        super().__init__(device=device or ("cuda:0" if torch.cuda.is_available() else "cpu"), **kwargs)
        self._autotune_init(tuner_options)


class AutoTuneDDPStrategy(_TunedSteps, DDPStrategy):
    """`DDPStrategy` with OOM-resilient training steps agreed by every rank.

    Args:
        tuner_options: passed to `Tuner`.
        **kwargs: `DDPStrategy`'s.
    """

    def __init__(self, *, tuner_options: dict[str, Any] | None = None, **kwargs: Any):
        super().__init__(**kwargs)
        self._autotune_init(tuner_options)

    def _ranks(self) -> Process:
        ranks = Ranks(self.global_rank, self.world_size, self.local_rank)
        # The gradients' one flat all-reduce, before each optimizer step (never inside backward).
        ranks.bucket_gradients(self.lightning_module.parameters())
        return ranks

    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        def closure_then_average() -> Any:
            result = closure()  # the last training step of this optimizer step
            if self.tuner is not None:
                self.tuner.average_gradients()  # before Lightning's hooks, clipping and step
            return result

        return super().optimizer_step(optimizer, closure_then_average, model, **kwargs)


class _Logs:
    """What a LightningModule logs (`self.log`, `self.log_dict`) while a batch runs in pieces,
    put back together as one call a name for the batch: each numeric value weighted by its
    piece's samples (or the `batch_size` it was logged with), logged with the batch's size,
    so epoch means and what `ModelCheckpoint`/`EarlyStopping` watch are those of a run without
    pieces. A failed piece's calls are dropped; a torchmetrics `Metric` is logged once, as is."""

    def __init__(self, module: Any):
        self.module = module
        self.calls: list[tuple[int, list[tuple[str, Any, dict[str, Any]]], int]] = []  # (attempt, calls, samples)

    @contextlib.contextmanager
    def piece(self, samples: int, attempt: int) -> Any:
        current: list[tuple[str, Any, dict[str, Any]]] = []
        original = self.module.log

        def record(name: str, value: Any, *args: Any, **kwargs: Any) -> None:
            if args:
                raise TypeError("autotune's Lightning strategies need self.log's options as keywords")
            current.append((name, value, kwargs))

        self.module.log = record  # log_dict calls self.log too
        try:
            yield
            self.calls.append((attempt, current, samples))  # only a piece that ran: a failed one's calls go
        finally:
            self.module.log = original

    def replay(self, n: int, attempt: int) -> None:
        merged: dict[str, list[Any]] = {}  # name -> [weighted sum, weight, kwargs, as-is value]
        for tag, calls, samples in self.calls:
            if tag != attempt:
                continue  # an attempt that ran out of memory: retried, its logs with it
            for name, value, kwargs in calls:
                entry = merged.setdefault(name, [0.0, 0.0, kwargs, None])
                entry[2] = kwargs
                if isinstance(value, (torch.Tensor, float, int)) and not isinstance(value, bool) and \
                        (not isinstance(value, torch.Tensor) or value.numel() == 1):
                    weight = kwargs.get("batch_size") or samples
                    entry[0] = entry[0] + value.detach().double() * weight if isinstance(value, torch.Tensor) \
                        else entry[0] + float(value) * weight
                    entry[1] += weight
                else:
                    entry[3] = value  # a Metric (or anything else): as it is, once
        self.calls.clear()
        for name, (total, weight, kwargs, as_is) in merged.items():
            if as_is is not None:
                self.module.log(name, as_is, **kwargs)
            elif weight:
                value = total / weight
                if isinstance(value, torch.Tensor):
                    value = value.float()
                options = {**kwargs, "batch_size": int(weight) if kwargs.get("batch_size") else n}
                self.module.log(name, value, **options)


def _combined(outputs: list[Any], samples: list[int], n: int, concatenate: bool) -> Any:
    """One step output from its pieces': a loss (0-d tensor) weighted by samples; predictions
    (tensors with a sample dimension) concatenated; anything else, the last piece's."""
    if len(outputs) == 1:
        return outputs[0]
    if all(isinstance(o, torch.Tensor) for o in outputs):
        if concatenate and all(o.ndim > 0 for o in outputs):
            return torch.cat(outputs)
        if all(o.numel() == 1 for o in outputs):
            return sum(o * (m / n) for o, m in zip(outputs, samples))
    if all(isinstance(o, Mapping) and isinstance(o.get("loss"), torch.Tensor) for o in outputs):
        return {**outputs[-1], "loss": sum(o["loss"] * (m / n) for o, m in zip(outputs, samples))}
    if concatenate and all(isinstance(o, list) for o in outputs):
        return [item for o in outputs for item in o]
    return outputs[-1]
