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
`log_dir`. Notes: `training_step` and the backward hooks (`on_before_backward`,
`on_after_backward`) run once per micro-batch; a value you `self.log` in `training_step` is the
last micro-batch's for the step. Reliefs are off (Lightning owns the optimizer).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, Callable

import torch
from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy

from autotune.batching import batch_len
from autotune.distributed import GradientBucket, Ranks, Solo
from autotune.tuner import Tuner, add_gradients, set_aside_gradients

STATE_KEY = "autotune"


class _TunedSteps:
    """What both strategies add: the training step through a Tuner, and its state in checkpoints."""

    tuner: Tuner | None = None

    def _autotune_init(self, tuner_options: dict[str, Any] | None) -> None:
        self.tuner_options = dict(tuner_options or {})
        self.tuner = None
        self._pending_state: dict[str, Any] | None = None
        self._computed: list[tuple[torch.nn.Parameter, torch.Tensor]] = []  # training_step's gradients

    @property
    def micro_batch_size(self) -> int | None:
        """Samples per forward/backward now (None before the first step)."""
        return self.tuner.micro_batch_size if self.tuner is not None else None

    def _ranks(self) -> Solo | Ranks:
        return Solo()

    def _make_tuner(self) -> Tuner:
        module = self.lightning_module
        trainer = module.trainer
        if not module.automatic_optimization:
            raise ValueError("autotune's Lightning strategies need automatic optimisation: with manual "
                             "optimisation, call Tuner.accumulate in your own training_step")
        ranks = self._ranks()
        run_dir = ranks.broadcast_object(str(trainer.log_dir or trainer.default_root_dir))
        tuner = Tuner(module, device=self.root_device, run_dir=Path(run_dir), owns_optimizer=False, reliefs=False,
                      ranks=ranks, **self.tuner_options)
        if self._pending_state is not None:
            tuner.load_tuning_state(self._pending_state)
            tuner.journal.write("resume", trainer.global_step, trainer.current_epoch, found=True,
                                micro_batch_size=tuner.micro_batch_size)
            self._pending_state = None
        tuner.core.backward_fn = self._micro_backward
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

        def micro_loss(_: torch.nn.Module, micro: Any) -> torch.Tensor:
            out = module.training_step(micro, *rest, **kwargs)
            loss = out["loss"] if isinstance(out, Mapping) else out
            if not isinstance(loss, torch.Tensor):
                raise TypeError(f"training_step returned {type(out).__name__}: autotune needs the loss "
                                "(a tensor, or a dict with 'loss')")
            if isinstance(out, Mapping):
                extras.update((k, v) for k, v in out.items() if k != "loss")
            return loss * (batch_len(micro) / n * scale)

        self.tuner.progress.step = trainer.global_step
        self.tuner.progress.epoch = trainer.current_epoch
        # Lightning zeroes gradients after training_step, before backward (on an optimizer step's
        # first batch): the batch's gradients are computed apart from those already there, and
        # added to them where Lightning then calls backward (below), as a plain backward would.
        earlier = set_aside_gradients(module)
        with self.precision_plugin.train_step_context():
            outcome = self.tuner.accumulate(batch, micro_loss, n=n)
        self._computed = set_aside_gradients(module)
        add_gradients(earlier)
        loss = outcome.loss_sum.detach() / scale  # the batch's mean loss, as training_step would return it
        return {"loss": loss, **extras} if extras else loss

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
            self.tuner.progress.step = self.lightning_module.trainer.global_step if self.lightning_module else 0
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

    def _ranks(self) -> Solo | Ranks:
        ranks = Ranks(self.global_rank, self.world_size, self.local_rank)
        # The gradients' one flat all-reduce, before each optimizer step (never inside backward).
        ranks.bucket = GradientBucket(self.lightning_module.parameters())
        return ranks

    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        def closure_then_average() -> Any:
            result = closure()  # the last training step of this optimizer step
            if self.tuner is not None:
                self.tuner.ranks.average_gradients()  # before Lightning's hooks, clipping and step
            return result

        return super().optimizer_step(optimizer, closure_then_average, model, **kwargs)
