"""`AutoTuneTrainer`: the Hugging Face `Trainer`, with training steps that survive out-of-memory errors.

    from autotune.integrations.transformers import AutoTuneTrainer
    trainer = AutoTuneTrainer(model=model, args=args, train_dataset=train, data_collator=collator)
    trainer.train()                       # same arguments, same optimizer steps

Each batch HF hands to `training_step` (`per_device_train_batch_size` samples) goes through
`Tuner.accumulate`: forward/backward in micro-batches, and on OOM the same batch again at a
smaller micro-batch; nothing is skipped and HF's optimizer step, schedule, clipping, logging
and checkpoints are untouched. A micro-batch's loss is HF's `compute_loss` on it with the
step's `num_items_in_batch` (the label tokens of all `gradient_accumulation_steps` batches),
so the micro-batches' losses add up to the batch's exactly; for a model whose loss is a mean
over its own input, each is weighted by its share of the samples and by
1/gradient_accumulation_steps, as HF does.

How it composes with `gradient_accumulation_steps=k`: HF still runs k training steps per
optimizer step; autotune splits each of them further only when it has to. Gradients that
earlier training steps of the same optimizer step accumulated are set aside during a retry
and added back after it, so a retry neither loses nor doubles them.

Under torchrun or `accelerate launch` (DDP, one process a device), the ranks agree after every
attempt (one small all-reduce, as in `AutoTrainer`), so an OOM on one rank is retried by all at
the same new micro-batch. DDP's own gradient sync inside backward is never used: the
micro-batches run on the module inside HF's DDP wrapper (a collective inside an attempt could
wait for a rank that has failed), and on the batch after which HF steps its optimizer, the
gradients are averaged in one flat all-reduce, before HF's clipping and optimizer step. Where
DDP broadcasts buffers in forward, rank 0's are broadcast once a batch instead. FSDP, DeepSpeed
and tensor parallelism are refused with a clear error.

The micro-batch (and the policies' state) is saved as `autotune.pt` in each HF checkpoint
folder and restored by `train(resume_from_checkpoint=...)`. The journal (`events.jsonl`) goes
to `args.output_dir`, so `autotune report OUTPUT_DIR` works. Pruning and the other reliefs
are off (HF owns the optimizer and the precision).

Owns: HF's side (the training and prediction steps, `autotune.pt`). Touches the Tuner only through
its host face, and HF's checkpoints (it asks HF to write one before an OOM error).
"""

from __future__ import annotations

import os
import weakref
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn
from transformers import Trainer, TrainerCallback
from transformers.trainer_pt_utils import nested_concat
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint

from autotune.common.batching import batch_len, tensor_bytes
from autotune.common.notices import warn
from autotune.common.progress import Progress
from autotune.common.units import format_bytes
from autotune.monitor.host import room_bytes
from autotune.observe.records import Kind
from autotune.ranks.distributed import Ranks, Solo
from autotune.ranks.process import Process
from autotune.training.evaluation import Evaluator
from autotune.tuner import Tuner
from autotune.tuning.host_face import Wiring

STATE_FILE = "autotune.pt"
SAVE_MARGIN_BYTES = 16 * 2**20  # beside the weights' copy: HF's metadata, the optimizer's file buffers


class AutoTuneTrainer(Trainer):
    """`transformers.Trainer` (same arguments) whose training step splits the batch and retries
    it at a smaller micro-batch on OOM.

    Args:
        tuner_options: passed to `Tuner`: `policies`, `memory_cap`, `micro_batch_size`,
            `monitor`, `monitor_interval`, `inject_oom`, `seed`, `split_fn`.
        *args: `transformers.Trainer`'s.
        **kwargs: `transformers.Trainer`'s.
    """

    def __init__(self, *args: Any, tuner_options: dict[str, Any] | None = None, **kwargs: Any):
        super().__init__(*args, **kwargs)
        ranks = self._job()
        self._counters = Progress()  # HF's step, shared with the Tuner (its journal and report count in HF's steps)
        self.tuner = Tuner(self.model, device=self.args.device, run_dir=self.args.output_dir,
                           reliefs=False, **(tuner_options or {}),
                           _wiring=Wiring(host=self, ranks=ranks, counters=self._counters, owns_optimizer=False,
                                          backward_fn=_accelerators_backward(self)))
        self.add_callback(_SaveTuning(self))
        # Evaluation's own micro-batch (`evaluate`, `predict` and the evaluation inside `train`).
        self.evaluator = Evaluator(self.tuner.core, batch_size=self.args.per_device_eval_batch_size, collate_fn=None,
                                   metrics=None, journal=self.tuner.journal)
        self._whole_batch_items: Any = None  # the evaluated batch's label items, while its pieces run

    def _job(self) -> Process:
        """This process alone, or its place among DDP's ranks (the process group HF's Accelerate joined)."""
        if self.args.world_size <= 1:
            return Solo()
        kind = str(getattr(self.accelerator.distributed_type, "value", self.accelerator.distributed_type))
        if not kind.startswith("MULTI_") or getattr(self.args, "tp_size", 1) > 1 or self.is_fsdp_enabled or \
                self.is_deepspeed_enabled:
            raise NotImplementedError(f"AutoTuneTrainer under {kind} (world size {self.args.world_size}): only DDP "
                                      "(torchrun or `accelerate launch` without FSDP, DeepSpeed or tensor "
                                      "parallelism) has its OOM retries agreed across ranks; for FSDP2 use "
                                      "autotune.AutoTrainer(shard=True)")
        ranks = Ranks(self.args.process_index, self.args.world_size, self.args.local_process_index)
        # The gradients' one flat all-reduce, on the batch before HF's optimizer step (never inside backward).
        ranks.bucket_gradients(self.model.parameters())
        return ranks

    @property
    def micro_batch_size(self) -> int:
        """Samples per forward/backward now (HF's batch is `per_device_train_batch_size`)."""
        return self.tuner.micro_batch_size

    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any) -> Any:
        """`Trainer.train`; a resumed run also restores the micro-batch it had settled on."""
        folder = resume_from_checkpoint
        if folder is True:
            folder = get_last_checkpoint(self.args.output_dir)
        if isinstance(folder, (str, os.PathLike)) and (Path(folder) / STATE_FILE).is_file():
            self.tuner.load_tuning_state(torch.load(Path(folder) / STATE_FILE, weights_only=True))
            self.tuner.journal.write(Kind.RESUME, 0, 0, found=True, path=str(Path(folder) / STATE_FILE),
                                     micro_batch_size=self.tuner.micro_batch_size)
        try:
            result = super().train(resume_from_checkpoint, *args, **kwargs)
            self.tuner.agree_on_micro_batch()  # one size on every rank at the end, as AutoTrainer's fits
            return result
        finally:
            self._counters.follow(self.state.global_step)
            self.tuner.end()

    def training_step(self, model: torch.nn.Module, inputs: dict[str, Any],
                      num_items_in_batch: torch.Tensor | int | None = None) -> torch.Tensor:
        """HF's training step, on micro-batches of `inputs` with OOM retries (see the module docstring)."""
        model.train()
        if hasattr(self.optimizer, "train") and callable(self.optimizer.train):
            self.optimizer.train()
        model = _inside_ddp(model)  # no collective inside an attempt: a rank may fail in it
        inputs = self._prepare_inputs(inputs)
        n = batch_len(inputs)
        scaled = self.loss_is_scaled_for_ga if self.loss_is_scaled_for_ga is not None else (
            (self.model_accepts_loss_kwargs and num_items_in_batch is not None) or self.compute_loss_func is not None)
        accumulation = self.current_gradient_accumulation_steps

        def micro_loss(_: torch.nn.Module, micro: dict[str, Any]) -> torch.Tensor:
            with self.compute_loss_context_manager():
                loss = self.compute_loss(model, micro, num_items_in_batch=num_items_in_batch)
            if self.args.n_gpu > 1:
                loss = loss.mean()
            if not scaled:  # a mean over this micro-batch: its share of the batch, and HF's 1/k
                share = (n if micro is inputs else batch_len(micro)) / n / accumulation
                if share != 1:
                    loss = loss * share
            return loss

        self._counters.follow(self.state.global_step)
        outcome = self.tuner.accumulate(inputs, micro_loss, n=n)
        if self.accelerator.sync_gradients:
            self.tuner.average_gradients()  # HF clips and steps its optimizer after this batch (alone: nothing)
        return outcome.loss_sum.detach()

    def prediction_step(self, model: torch.nn.Module, inputs: dict[str, Any], prediction_loss_only: bool,
                        ignore_keys: list[str] | None = None) -> tuple[Any, Any, Any]:
        """HF's prediction step, on pieces of `inputs` that survive OOMs (the evaluation's own
        micro-batch, halved on OOM, the same samples again), put back together as HF's on the
        whole batch: logits and labels concatenated; the loss HF's `compute_loss` of each piece
        with the whole batch's `num_items_in_batch` (their sum is the batch's loss, where HF's
        eval loss is not the mean of each piece's token mean), or each piece's mean weighted
        by its share of the samples where the loss does not count items."""
        model = _inside_ddp(model)  # pieces may differ between ranks: no collective inside them
        n = batch_len(inputs)
        has_labels = bool(self.label_names) and all(inputs.get(k) is not None for k in self.label_names)
        items = super()._get_num_items_in_batch([inputs], self.args.device) if has_labels else None
        additive = items is not None and (self.model_accepts_loss_kwargs or self.compute_loss_func is not None)

        def piece(micro: dict[str, Any], m: int) -> tuple[Any, Any, Any]:
            return super(AutoTuneTrainer, self).prediction_step(model, micro, prediction_loss_only, ignore_keys)

        self._whole_batch_items = items
        try:
            pieces = self.evaluator.in_pieces(inputs, piece, self.state.global_step, int(self.state.epoch or 0), n=n)
        finally:
            self._whole_batch_items = None
        if len(pieces) == 1:
            return pieces[0][0]
        losses = [(loss, m) for (loss, _, _), m in pieces if loss is not None]
        loss = None
        if losses:
            loss = sum(l for l, _ in losses) if additive else sum(l * (m / n) for l, m in losses)
        logits = labels = None
        for (_, piece_logits, piece_labels), _ in pieces:
            logits = piece_logits if logits is None else nested_concat(logits, piece_logits, padding_index=-100)
            labels = piece_labels if labels is None else nested_concat(labels, piece_labels, padding_index=-100)
        return loss, logits, labels

    def _get_num_items_in_batch(self, batch_samples: Any, device: Any) -> Any:
        # While an evaluated batch's pieces run: the whole batch's label items (prediction_step).
        if self._whole_batch_items is not None:
            return self._whole_batch_items
        return super()._get_num_items_in_batch(batch_samples, device)

    def checkpoint_now(self, reason: str, report_failure: bool = True) -> Path | None:
        """HF's own checkpoint at the last completed optimizer step, with the tuner's state beside
        it (`autotune.tuning.host_face.Host`: the Tuner asks before an OOM error, once the failed attempt's
        memory is freed); a resume redoes the accumulation in progress from its first batch."""
        # HF's save serializes the weights in native code (safetensors), which aborts the process
        # where an allocation fails: under memory that is still too short for that copy, it is
        # skipped with a word, and the OutOfMemory error is raised all the same.
        need = tensor_bytes(self.model.state_dict()) + SAVE_MARGIN_BYTES
        room = room_bytes(self.tuner.knobs.host_cap_bytes)
        # Every rank decides alike: HF's save has collectives of its own.
        if self.tuner.ranks.any(room is not None and room < need, self.tuner.device):
            newest = get_last_checkpoint(self.args.output_dir) if Path(self.args.output_dir).is_dir() else None
            self.tuner.journal.write(Kind.CHECKPOINT_SKIPPED, self.state.global_step, int(self.state.epoch or 0),
                                     reason=reason, need_bytes=need, room_bytes=room)
            left = f"{format_bytes(room)} are left" if room is not None else "another rank has less left"
            warn(f"not writing HF's checkpoint before the out-of-memory error: its save needs about "
                 f"{format_bytes(need)} and {left} under the memory limit, where HF's "
                 f"save can abort the process; the newest checkpoint is {newest or 'none'}", error=True)
            return None
        self._save_checkpoint(self.model, trial=None)
        return save_tuning(self.tuner, self.args, self.state, reason)

    def input_state(self) -> None:
        """HF's loader is its own: nothing known of it (`autotune.tuning.host_face.Host`)."""
        return None


def _accelerators_backward(trainer: Trainer) -> Callable[[torch.Tensor], Any]:
    """`trainer.accelerator.backward`, looked up at each call (a hyperparameter search builds a new
    accelerator), through a weak reference (the Tuner it goes into is the trainer's: no cycle)."""
    held = weakref.ref(trainer)
    return lambda loss: held().accelerator.backward(loss)


def _inside_ddp(model: nn.Module) -> nn.Module:
    """The module inside HF's DDP wrapper, whose forward and backward make no collective; DDP's
    forward-time buffer broadcast is made here instead, once a batch, on every rank."""
    if not isinstance(model, nn.parallel.DistributedDataParallel):
        return model
    will_sync = getattr(model, "will_sync_module_buffers", None)
    if will_sync is not None and will_sync():
        with torch.no_grad():
            for buffer in model.module.buffers():
                dist.broadcast(buffer, src=0)
    return model.module


def save_tuning(tuner: Tuner, args: Any, state: Any, reason: str) -> Path | None:
    """The tuner's state into HF's checkpoint folder of this step, once HF has written it."""
    folder = Path(args.output_dir) / f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}"
    if not (state.is_world_process_zero and folder.is_dir()):
        return None
    torch.save(tuner.tuning_state(), folder / STATE_FILE)
    tuner.journal.write(Kind.CHECKPOINT, state.global_step, int(state.epoch or 0), reason=reason, path=str(folder),
                        micro_batch_size=tuner.micro_batch_size)
    return folder


class _SaveTuning(TrainerCallback):
    """Writes the tuner's state into each HF checkpoint folder, after HF has written its own."""

    def __init__(self, trainer: AutoTuneTrainer):
        self.tuner = trainer.tuner

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        save_tuning(self.tuner, args, state, "hf")
