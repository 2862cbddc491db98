"""AutoTrainer: a training loop that survives out-of-memory errors and loses nothing.

The loop, and where each `Event` fires (see events.py for the full picture)::

    fit():                                          FIT_START
      for epoch:                                    EPOCH_START
        for batch in loader:                        (time blocked in next() = data wait)
          while the batch is not done:              # retry the same batch until it fits
            try:
              for micro in split(batch, micro_batch_size):
                loss = step(model, micro) * len(micro) / len(batch)
                loss.backward()
            except OOM: note the size that failed (keep no reference to the exception)
            torchrun: every rank joins one small all-reduce here, failed or not
            no failure: average gradients (torchrun); optimizer.step(); zero_grad()
            failure: clean up outside `except`: zero_grad(set_to_none), gc, empty_cache
                                                    OOM -> policies -> e.g. SetMicroBatch(n // 2)
              at the smallest size, a relief if a policy asked (checkpoint first), else
              raise autotune.OutOfMemory with the figures (checkpoint first)
                                                    BATCH_END
          a relief a policy asked for: autocast, checkpointing or pruning (journaled)
          monitor samples, step timing -> detectors MEMORY_HIGH | MEMORY_PRESSURE | IO_BOUND
          a policy changed workers or caching: rebuild the loader at this position
          a signal or a due checkpoint (agreed by all ranks): checkpoint (and stop)
                                                    EPOCH_END
                                                    FIT_END

With `keep_effective_batch=True` the micro-batches of a batch are accumulated with loss
weights len(micro)/len(batch), so the optimizer step equals the one without an OOM. With
False, every micro-batch is its own optimizer step, and a retry resumes at the first
sample not yet stepped on. Either way no sample is skipped or repeated.

Under torchrun the ranks stay one model: the micro-batch size and any relief are rank 0's,
carried in that all-reduce (or a broadcast after an OOM), so every rank changes at the same step.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import dataclasses
import datetime
import gc
import inspect
import os
import random
import signal
import time
import weakref
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Sequence

import psutil
import torch
from loguru import logger
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, Dataset, IterableDataset
from tqdm.auto import tqdm

from autotune.batching import SplitFn, batch_len, map_tensors, micro_batches
from autotune.dispatch import Dispatcher
from autotune.events import Event
from autotune.journal import Journal, StepLog
from autotune.tensorboard_log import TensorBoardLog
from autotune.knobs import Knobs
from autotune.checkpoint import Checkpoints, rng_state, set_rng_state
from autotune.detectors import MemoryDetector
from autotune.distributed import GradientBucket, agree, from_environment, from_rank0, gather, init_process_group
from autotune.memory import (StepPeak, allocator_stats, cuda_uuid, describe_memory, device_sample, free_memory,
                             load_libc, load_mkl)
from autotune.monitor.process import MAX_INTERVAL, MIN_INTERVAL, MonitorProcess
from autotune.oom import OutOfMemory, is_oom
from autotune.actions import RELIEF_NAMES, Relief, relief_from_ints, relief_to_ints
from autotune.policy import Policy
from autotune.preemption import Preempted, StopRequests
from autotune.relief.autocast import AutocastPlan, autocast_plan
from autotune.relief.checkpointing import checkpoint_blocks
from autotune.relief.pruning import (UnsafePruning, adopt_unrecorded, prune_channels, rebind_scheduler,
                                     rebuild_optimizer, replay_pruning)
from autotune.presets import resolve_policies
from autotune.snapshot import AllocatorStats, DeviceSample, Snapshot, StepTiming
from autotune.data.pipeline import InputPipeline
from autotune.units import format_bytes, parse_bytes

class _ProgressBar(tqdm):
    # tqdm's monitor thread is started on the first bar; under a hard memory cap a thread
    # whose stack cannot be mapped makes Thread.start() wait forever. The bar refreshes on
    # every update anyway, so the monitor is not needed.
    monitor_interval = 0


LossFn = Callable[[Any, Any], torch.Tensor]
StepFn = Callable[[nn.Module, Any], torch.Tensor]
OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]


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

    @property
    def samples_per_second(self) -> float:
        return self.samples_seen / self.wall_seconds if self.wall_seconds > 0 else 0.0


def _drop_ddp_wrapper(trainer_ref: weakref.ref) -> None:
    # At exit, while the interpreter is whole: a DDP wrapper destroyed during interpreter
    # teardown can abort the process in C++ ("terminate called without an active exception";
    # about one two-rank gloo run in twelve) after training has finished and everything is saved.
    trainer = trainer_ref()
    if trainer is not None:
        trainer._ddp = None
        trainer._forward_model = trainer.model
        gc.collect()


def resolve_device(device: str | torch.device | None) -> torch.device:
    """The device to train on: the given one, checked, or CUDA when available, else CPU."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"unknown device {device!r}: use 'cpu', 'cuda' or 'cuda:N'") from exc
    if resolved.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {device!r} asked for, but CUDA is not available on this machine")
        if resolved.index is not None and resolved.index >= torch.cuda.device_count():
            raise ValueError(f"device {device!r}: only {torch.cuda.device_count()} CUDA device(s) visible")
    elif resolved.type not in ("cpu", "mps", "xpu"):
        raise ValueError(f"unsupported device {device!r}: use 'cpu', 'cuda' or 'cuda:N'")
    return resolved


def resolve_memory_cap(cap: float | int | str | None, device: torch.device) -> int | None:
    """`memory_cap` in bytes (None: no cap of our own). On CUDA the cap is also set as the
    allocator's per-process fraction, so going past it is an OOM rather than a slow-down."""
    if cap is None:
        return None
    total = (torch.cuda.get_device_properties(device).total_memory if device.type == "cuda"
             else psutil.virtual_memory().total)
    if isinstance(cap, bool):
        raise TypeError(f"memory_cap={cap!r}: pass a fraction, a number of bytes, or a size like '12GiB'")
    if isinstance(cap, float):
        if not 0 < cap <= 1:
            raise ValueError(f"memory_cap={cap!r}: a fraction must be in (0, 1]; for bytes pass an int or '12GiB'")
        cap_bytes = int(cap * total)
    elif isinstance(cap, int):
        if cap <= 0:
            raise ValueError(f"memory_cap={cap!r} must be positive")
        cap_bytes = cap
    elif isinstance(cap, str):
        try:
            cap_bytes = parse_bytes(cap)
        except ValueError as exc:
            raise ValueError(f"memory_cap: {exc}") from None
    else:
        raise TypeError(f"memory_cap={cap!r}: pass a fraction, a number of bytes, or a size like '12GiB'")
    if cap_bytes > total:
        raise ValueError(f"memory_cap={cap!r} ({format_bytes(cap_bytes)}) is more than the {device} has "
                         f"({format_bytes(total)})")
    if device.type == "cuda":
        torch.cuda.set_per_process_memory_fraction(cap_bytes / total, device)
    return cap_bytes


def to_device(obj: Any, device: torch.device) -> Any:
    """Move every tensor in a (nested) batch to `device`."""
    return map_tensors(lambda t: t.to(device, non_blocking=True), obj)


def _first_rows_copied(obj: Any, rows: int = 2) -> Any:
    # Copied: a view would keep the whole batch alive.
    return map_tensors(lambda t: (t[:rows] if t.dim() else t).detach().clone(), obj)


class _InputCatcher:
    """A forward pre-hook keeping the model's first inputs (two samples, copied: a view would
    keep the whole batch alive), for tracing the model if it is ever pruned. Copies of the
    model (Torch-Pruning's, the meta dry run) share it rather than copy what holds it."""

    def __init__(self) -> None:
        self.example: tuple[tuple, dict] | None = None

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if self.example is None and not _on_meta(args):
            self.example = (_first_rows_copied(args), _first_rows_copied(kwargs))

    def __deepcopy__(self, memo: dict) -> "_InputCatcher":
        return self


def _on_meta(obj: Any) -> bool:
    found: list[bool] = []
    map_tensors(lambda t: found.append(t.device.type == "meta"), obj)
    return any(found)


def _call_with(model: nn.Module, example: tuple[tuple, dict]) -> Any:
    args, kwargs = example
    return model(*args, **kwargs)


class AutoTrainer:
    """Train `model` on `dataset`, adapting to memory limits instead of crashing.

    Args:
        model: the `nn.Module` to train; moved to `device`.
        dataset: a map-style `Dataset` (batched here, with `batch_size`), or a `DataLoader`
            (its `batch_size` is the batch).
        loss_fn: `loss_fn(outputs, targets) -> mean loss`; batches are `(inputs, targets)`.
        step_fn: instead of `loss_fn`, `step_fn(model, micro_batch) -> mean loss` for any layout.
        optimizer: an optimizer over the model's parameters, or a factory `params -> Optimizer`;
            default AdamW(lr=1e-3).
        batch_size: samples per optimizer step.
        micro_batch_size: samples per forward/backward at the start; default `batch_size`.
            "auto" starts at `batch_size` and lets the policies find the largest that fits.
        keep_effective_batch: on OOM, accumulate smaller micro-batches into the same step
            (True) or make each smaller chunk its own optimizer step (False).
        device: "cpu", "cuda", "cuda:1" or a `torch.device`; default CUDA when available.
        policies: a preset name ("default", "conservative"), a path to a TOML preset, or a
            list of policy objects.
        run_dir: where the journal (events.jsonl) goes; default `runs/<timestamp>`.
        shuffle, seed: the sample order of each epoch is a function of (seed, epoch).
        num_workers, collate_fn: passed to the DataLoader built for a map-style dataset (the
            `tune_workers` policy may raise num_workers when the loop waits on its data).
        split_fn: `split_fn(batch, size) -> list of micro-batches` for batch types the
            built-in splitter does not know.
        progress: show a tqdm bar with loss, micro-batch and memory.
        monitor: sample memory in a background process (run_dir/samples.jsonl) and turn
            it into MEMORY_HIGH / MEMORY_PRESSURE events; False turns it off.
        monitor_interval: seconds between memory samples (0.05 to 10).
        scheduler: an LR scheduler over `optimizer` (or a factory optimizer -> scheduler),
            stepped once per optimizer step and saved in checkpoints.
        checkpoint_every: write a checkpoint every this many optimizer steps.
        checkpoint_interval: and/or every this many seconds (default 900; None: off). A
            checkpoint is also written at the end of `fit`, on SIGTERM/SIGINT, and before
            giving up on an OOM. `run_dir/checkpoints/`, the last `keep_checkpoints` kept.
        memory_cap: keep memory under this: a fraction of the device (0 < f <= 1), bytes (an
            int), or a size such as "12GiB". On CUDA it is enforced with
            `torch.cuda.set_per_process_memory_fraction`; on CPU it is a soft cap on the
            resident memory of the process and its workers that the policies keep under (the
            effective cap is the tightest of it, the cgroup limit and RLIMIT_AS). It is the
            denominator of memory pressure.
        inject_oom: probability per micro-batch of a fake `torch.OutOfMemoryError`, raised
            through the same path as a real one, to test a setup (default: the
            AUTOTUNE_INJECT_OOM environment variable, else off).
        tensorboard: write loss, throughput, memory, micro-batch and every action to
            TensorBoard in `run_dir/tb` (True) or in the folder given; needs the optional
            `tensorboard` package.
    """

    def __init__(
        self,
        model: nn.Module,
        dataset: Dataset | DataLoader,
        *,
        loss_fn: LossFn | None = None,
        step_fn: StepFn | None = None,
        optimizer: torch.optim.Optimizer | OptimizerFactory | None = None,
        batch_size: int = 32,
        micro_batch_size: int | str | None = None,
        keep_effective_batch: bool = True,
        device: str | torch.device | None = None,
        policies: str | Path | Sequence[Policy] = "default",
        run_dir: str | Path | None = None,
        shuffle: bool = True,
        seed: int = 0,
        num_workers: int = 0,
        collate_fn: Callable[[list], Any] | None = None,
        split_fn: SplitFn | None = None,
        progress: bool = True,
        monitor: bool = True,
        monitor_interval: float = 0.5,
        scheduler: Any = None,
        checkpoint_every: int | None = None,
        checkpoint_interval: float | None = 900.0,
        keep_checkpoints: int = 3,
        inject_oom: float | None = None,
        memory_cap: float | int | str | None = None,
        tensorboard: bool | str | Path = False,
    ):
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if (loss_fn is None) == (step_fn is None):
            raise ValueError("pass exactly one of loss_fn(outputs, targets) or step_fn(model, micro_batch)")
        self.ranks = from_environment()
        if self.ranks is not None:
            if not keep_effective_batch:
                raise ValueError("keep_effective_batch=False is not supported under torchrun yet")
            # One GPU per rank: "cuda" (or no device on a CUDA machine) means cuda:LOCAL_RANK.
            if (device is None and torch.cuda.is_available()) or str(device) == "cuda":
                device = f"cuda:{self.ranks.local_rank}"
        self.device = resolve_device(device)
        if self.ranks is not None:
            if self.device.type == "cuda":
                torch.cuda.set_device(self.device)
            init_process_group(self.device)
        self.model = model.to(self.device)
        self._ddp: DistributedDataParallel | None = None
        self._forward_model: nn.Module = self.model
        self._bucket: GradientBucket | None = None
        self._wrap_for_ranks()
        if self.ranks is not None:
            atexit.register(_drop_ddp_wrapper, weakref.ref(self))
        self.loss_fn = loss_fn
        self.step_fn = step_fn
        self.split_fn = split_fn
        self.keep_effective_batch = keep_effective_batch
        self.progress = progress
        if monitor and not MIN_INTERVAL <= monitor_interval <= MAX_INTERVAL:
            raise ValueError(f"monitor_interval must be between {MIN_INTERVAL} and {MAX_INTERVAL} s, got {monitor_interval!r}")
        self.monitor_enabled = monitor
        self.monitor_interval = monitor_interval
        self.monitor: MonitorProcess | None = None
        self.detector = MemoryDetector()
        self._window: collections.deque[DeviceSample] = collections.deque(maxlen=20)
        self._allocator: AllocatorStats | None = None

        self.input = InputPipeline(dataset, batch_size=batch_size, shuffle=shuffle, seed=seed,
                                   num_workers=num_workers, collate_fn=collate_fn, device=self.device,
                                   ranks=self.ranks)
        batch_size = self.input.loader.batch_size  # validated by InputPipeline, or the DataLoader's own
        # "auto": start at the whole batch; OOMs halve it and grow_back's binary search finds
        # the largest size that fits, on real batches, nothing skipped.
        micro = batch_size if micro_batch_size in (None, "auto") else micro_batch_size
        if isinstance(micro, bool) or not isinstance(micro, int) or micro < 1:
            raise ValueError(f"micro_batch_size must be an integer >= 1, got {micro_batch_size!r}")
        if micro > batch_size:
            raise ValueError(f"micro_batch_size ({micro}) cannot exceed batch_size ({batch_size})")
        if loss_fn is not None and isinstance(dataset, Dataset) and not isinstance(dataset, IterableDataset):
            self._check_sample_layout(dataset[0])

        self.optimizer = self._make_optimizer(optimizer)
        if run_dir is None:
            run_dir = Path("runs") / datetime.datetime.now().strftime("%Y%m%d-%H%M%S-%f")
            if self.ranks is not None:
                run_dir = gather(str(run_dir), self.ranks)[0]  # every rank uses rank 0's
        self.run_dir = Path(run_dir)
        self.is_main = self.ranks is None or self.ranks.is_main
        if self.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
        self.journal = Journal(self.run_dir / "events.jsonl" if self.is_main else None)  # rank 0 writes
        self.step_log = StepLog(self.run_dir / "steps.jsonl" if self.is_main else None)
        if not isinstance(tensorboard, (bool, str, Path)):
            raise TypeError(f"tensorboard must be True/False or a folder, got {tensorboard!r}")
        self.tensorboard: TensorBoardLog | None = None
        if tensorboard is not False and self.is_main:
            self.tensorboard = TensorBoardLog(self.run_dir / "tb" if tensorboard is True else tensorboard)
            self.journal.listeners.append(self.tensorboard.record)
        self.knobs = Knobs(batch_size=batch_size, micro_batch_size=micro, device=self.device,
                           memory_cap_bytes=resolve_memory_cap(memory_cap, self.device),
                           num_workers=self.input.num_workers)
        self.dispatcher = Dispatcher(resolve_policies(policies), self.knobs, self.journal)

        self.scheduler = self._make_scheduler(scheduler)
        for name, value in (("checkpoint_every", checkpoint_every), ("checkpoint_interval", checkpoint_interval)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0):
                raise ValueError(f"{name} must be a positive number or None, got {value!r}")
        self.checkpoint_every = checkpoint_every
        self.checkpoint_interval = checkpoint_interval
        self.checkpoints = Checkpoints(self.run_dir / "checkpoints", keep=keep_checkpoints)
        self.inject_oom = self._injection_rate(inject_oom)
        self._injector = random.Random(seed + 0x5EED + (self.ranks.rank if self.ranks else 0))  # own stream per rank

        self._last_oom_message = ""
        self._work_since = 0.0
        self._last_oom_injected = False
        # [stop signal, checkpoint due, relief code, relief ratio in millionths], agreed by all
        # ranks under torchrun (the relief is rank 0's: see _offer_relief)
        self._flags = [0, 0, 0, 0]
        self._agreed_relief: Relief | None = None  # under torchrun: what every rank applies next
        self._last_good_micro: int | None = None
        self._step_demand: float | None = None
        self._peak = StepPeak(self.device)
        self._room: tuple[int, int] | None = None
        self._loader_version = self.knobs.loader_version
        self.reliefs: list[str] = []  # memory reliefs applied, in order ("autocast", "checkpointing", "pruning")
        self._last_relief_step: int | None = None
        self._pruned_fraction = 0.0
        self._autocast: AutocastPlan | None = None
        self._scaler: torch.amp.GradScaler | None = None
        self._inputs = _InputCatcher()
        self.model.register_forward_pre_hook(self._inputs, with_kwargs=True)
        self._relief_watch: dict[str, Any] | None = None
        self._pruning_history: list[dict[str, Any]] = []  # each prune: the traced example and Torch-Pruning's history

        self.step = 0  # optimizer steps, across fit() calls
        self.epoch = 0  # epochs completed
        self.position = 0  # samples of the current epoch already trained (where a resume restarts)
        self.batches_done = 0  # batches of the current epoch already trained
        self.ooms = 0
        self.samples_seen = 0

    # ----------------------------------------------------------------------------- set-up
    def _wrap_for_ranks(self) -> None:
        """Under torchrun, wrap the model in DDP and bind its gradients to one flat buffer; again
        after pruning replaced its parameters (every rank prunes alike, at the same step)."""
        if self.ranks is None:
            return
        # DDP broadcasts rank 0's weights and buffers now; its own gradient sync is never
        # used (always no_sync): gradients are averaged after the ranks agree.
        # Buffers are synced once at init, never in forward (a forward-time broadcast is a
        # collective a failing rank could miss). torch >= 2.14 spells it forward_sync_buffers.
        no_forward_sync = ({"forward_sync_buffers": False}
                           if "forward_sync_buffers" in inspect.signature(DistributedDataParallel).parameters
                           else {"broadcast_buffers": False})
        self._ddp = DistributedDataParallel(self.model, **no_forward_sync,
                                            device_ids=[self.device.index] if self.device.type == "cuda" else None)
        self._forward_model = self._ddp
        self._bucket = GradientBucket(self.model.parameters())

    @property
    def loader(self) -> DataLoader:
        """The DataLoader in use now (rebuilt when a policy changes workers or caching)."""
        return self.input.loader

    def _check_sample_layout(self, sample: Any) -> None:
        if not (isinstance(sample, (tuple, list)) and len(sample) == 2):
            raise TypeError(
                f"with loss_fn, each sample must be (inputs, targets); got {type(sample).__name__}"
                f"{' of length ' + str(len(sample)) if isinstance(sample, (tuple, list)) else ''}: "
                "pass step_fn(model, micro_batch) for other layouts"
            )

    def _make_scheduler(self, scheduler: Any) -> Any:
        if scheduler is None:
            return None
        if not hasattr(scheduler, "state_dict"):
            if not callable(scheduler):
                raise TypeError(f"scheduler must be an LR scheduler or a factory optimizer -> scheduler, got {type(scheduler).__name__}")
            scheduler = scheduler(self.optimizer)
        if getattr(scheduler, "optimizer", self.optimizer) is not self.optimizer:
            raise ValueError("the scheduler is bound to another optimizer; build it over the trainer's optimizer")
        return scheduler

    @staticmethod
    def _injection_rate(rate: float | None) -> float:
        given: Any = rate
        source = "inject_oom"
        if rate is None:
            given = os.environ.get("AUTOTUNE_INJECT_OOM", "").strip()
            if not given:
                return 0.0
            source = "AUTOTUNE_INJECT_OOM"
            try:
                rate = float(given)
            except ValueError:
                rate = None
        if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0 <= rate < 1:
            raise ValueError(f"{source}={given!r} is not a probability in [0, 1)")
        return float(rate)

    def _make_optimizer(self, optimizer) -> torch.optim.Optimizer:
        if optimizer is None:
            return torch.optim.AdamW(self.model.parameters(), lr=1e-3)
        if not isinstance(optimizer, torch.optim.Optimizer):
            if not callable(optimizer):
                raise TypeError(f"optimizer must be a torch.optim.Optimizer or a factory params -> Optimizer, got {type(optimizer).__name__}")
            optimizer = optimizer(self.model.parameters())
            if not isinstance(optimizer, torch.optim.Optimizer):
                raise TypeError(f"the optimizer factory returned {type(optimizer).__name__}, not a torch.optim.Optimizer")
        own = {id(p) for p in self.model.parameters()}
        foreign = sum(1 for g in optimizer.param_groups for p in g["params"] if id(p) not in own)
        if foreign:
            raise ValueError(f"the optimizer holds {foreign} parameter(s) that are not the model's; build it over model.parameters()")
        return optimizer

    # ----------------------------------------------------------------------------- the loop
    def fit(self, epochs: int = 1, max_steps: int | None = None, resume: bool = False) -> FitResult:
        """Train until `epochs` epochs (or `max_steps` optimizer steps) are done in all.

        With `resume=True`, first continue from the newest valid checkpoint in `run_dir`
        (none: start fresh, and say so). A deterministic run that is killed and resumed
        ends with the same weights and `samples_seen` as one that was not.
        """
        if isinstance(epochs, bool) or not isinstance(epochs, int) or epochs < 1:
            raise ValueError(f"epochs must be an integer >= 1, got {epochs!r}")
        if max_steps is not None and (not isinstance(max_steps, int) or max_steps < 1):
            raise ValueError(f"max_steps must be an integer >= 1 or None, got {max_steps!r}")
        if resume:
            self._resume()
        self._warm_up_oom_path()
        self._room = self._measure_room()
        started = time.perf_counter()
        self._last_checkpoint = (self.step, time.monotonic())
        self.journal.write("fit_start", self.step, self.epoch, device=str(self.device),
                           batch_size=self.knobs.batch_size, micro_batch_size=self.knobs.micro_batch_size,
                           keep_effective_batch=self.keep_effective_batch, epochs=epochs, max_steps=max_steps,
                           memory_cap=self.knobs.memory_cap_bytes,
                           policies=[p.name for p in self.dispatcher.policies])
        logger.info(f"training on {self.device}: batch {self.knobs.batch_size}, micro-batch "
                    f"{self.knobs.micro_batch_size}, run dir {self.run_dir}")
        self._start_monitor()
        self._fire(Event.FIT_START)
        bar = _ProgressBar(total=self._planned_batches(epochs, max_steps), disable=not (self.progress and self.is_main),
                   unit="batch", dynamic_ncols=True)
        # A full gc.collect() after an OOM walks every object torch and the user's code
        # created (~0.2 s). Freezing what exists now leaves it only the objects made
        # during training, the failed attempt's among them. Skipped if the caller froze.
        freeze = gc.get_freeze_count() == 0
        if freeze:
            gc.freeze()
        epoch_loss = None
        try:
            with StopRequests() as self._stop:
                while self.epoch < epochs and (max_steps is None or self.step < max_steps):
                    epoch_loss = self._train_epoch(bar, max_steps)
            self._checkpoint("end")
        except BaseException as exc:
            # On the record before it propagates, so a crashed run's journal says why it ended.
            self.journal.write("fit_failed", self.step, self.epoch, error=f"{type(exc).__name__}: {exc}"[:500],
                               samples_seen=self.samples_seen)
            raise
        finally:
            bar.close()
            if self.tensorboard is not None:
                self.tensorboard.flush()
            if freeze:
                gc.unfreeze()
            self._stop_monitor()
        wall = time.perf_counter() - started
        result = FitResult(
            samples_seen=self.samples_seen, steps=self.step, epochs=self.epoch,
            batch_size=self._step_size(), micro_batch_size=self.knobs.micro_batch_size, ooms=self.ooms,
            loss=epoch_loss, wall_seconds=wall, run_dir=self.run_dir,
        )
        self.journal.write("fit_end", self.step, self.epoch, samples_seen=result.samples_seen, ooms=self.ooms,
                           batch_size=result.batch_size, micro_batch_size=result.micro_batch_size,
                           wall_seconds=wall, loss=epoch_loss)
        if self.tensorboard is not None:
            self.tensorboard.flush()
        self._fire(Event.FIT_END)
        return result

    def _train_epoch(self, bar: _ProgressBar, max_steps: int | None) -> float | None:
        self._fire(Event.EPOCH_START)
        self.model.train()
        loss_sum = torch.zeros((), device=self.device)  # summed on the device: no sync per step
        loss_samples = 0
        last_shown = 0.0
        batches = self.input.batches(self.epoch, self.position, self.batches_done)
        finished_epoch = True
        while True:
            wait_start = time.perf_counter()
            try:
                batch = next(batches)
            except StopIteration:
                break
            step_start = time.perf_counter()
            n = batch_len(batch)
            self._peak.start()
            retries, batch_loss = self._train_batch(batch, n)
            self._last_good_micro = self.knobs.micro_batch_size
            self._step_demand = self._demand()
            step_end = time.perf_counter()
            loss_sum += batch_loss
            loss_samples += n
            self.position += n
            self.batches_done += 1
            # One memory_stats() call a step (CUDA); its peak was reset by self._peak.start().
            self._allocator = allocator_stats(self.device, reset_peak=False)
            timing = StepTiming(step_seconds=step_end - wait_start, data_wait_seconds=step_start - wait_start,
                                retries=retries)
            self._log_step(timing, n, batch_loss)
            self._fire(Event.BATCH_END, timing=timing)
            self._relief_effect()
            self._apply_relief()
            self._watch_memory()
            for event in self.input.on_step(timing, n):
                self._fire(event, timing=timing)
            if self.knobs.loader_version != self._loader_version:  # a policy changed workers or caching
                del batches  # its workers exit before the new loader's start
                batches = self._rebuild_loader()
            bar.update(1)
            if self.progress and step_end - last_shown > 0.5:
                last_shown = step_end
                bar.set_postfix(loss=f"{loss_sum.item() / max(loss_samples, 1):.4f}",
                                micro=self.knobs.micro_batch_size, mem=self._memory_text(), refresh=False)
            signum, checkpoint_due = self._flags[:2]  # agreed by all ranks under torchrun
            if signum:
                self._preempt(signum)
            if checkpoint_due:
                self._checkpoint("every" if checkpoint_due == 2 else "interval")
            if max_steps is not None and self.step >= max_steps:
                finished_epoch = False
                break
        epoch_loss = loss_sum.item() / loss_samples if loss_samples else None
        if finished_epoch:
            self.epoch += 1
            self.position = self.batches_done = 0
            self.journal.write("epoch_end", self.step, self.epoch - 1, samples_seen=self.samples_seen,
                               loss=epoch_loss, micro_batch_size=self.knobs.micro_batch_size)
            self.input.epoch_end(self.journal, self.step, self.epoch - 1)
            self._fire(Event.EPOCH_END)
        return epoch_loss

    def _train_batch(self, batch: Any, n: int) -> tuple[int, torch.Tensor]:
        """Train on one batch until every sample of it is in a completed optimizer step.

        Returns the number of OOMs survived on it and its summed (not mean) loss.
        """
        done = 0  # samples whose optimizer step has completed
        retries = 0
        tried: list[int] = []
        loss_sum = torch.zeros((), device=self.device)
        while done < n:
            failed_size, done, attempt_loss = self._attempt(batch, n, done)
            self._flags = [self._stop.signum or 0, self._checkpoint_due(), *self._offer_relief()]
            if self.ranks is not None:
                # Every rank joins here, failed or not: nobody waits in a gradient all-reduce
                # for a rank that ran out of memory (see distributed.py).
                failed_size, self.knobs.micro_batch_size, self._flags = agree(
                    failed_size, self.knobs.micro_batch_size, self._flags, self.ranks, self.device)
                self._take_agreed_relief(*self._flags[2:])
            if failed_size is None:
                if self.keep_effective_batch:
                    if self._bucket is not None:
                        self._bucket.average(self.ranks.world)
                    self._optimizer_step(n)
                    done = n
                loss_sum += attempt_loss
                break
            # Out of the `except` block now, so the exception and its frames are gone and
            # the tensors they pinned (activations, partial gradients) can be freed.
            loss_sum += attempt_loss  # chunks already stepped (keep_effective_batch=False)
            retries += 1
            tried.append(failed_size)
            self._recover_from_oom(failed_size, tried)
        return retries, loss_sum

    def _attempt(self, batch: Any, n: int, done: int) -> tuple[int | None, int, torch.Tensor]:
        """Forward and backward over the batch from sample `done` on.

        Returns (the micro-batch size that hit OOM or None, samples done, summed loss). With
        `keep_effective_batch` the gradients are only accumulated; the caller steps.
        """
        size = self.knobs.micro_batch_size if self.keep_effective_batch else min(self.knobs.micro_batch_size, n)
        loss_sum = torch.zeros((), device=self.device)
        self._work_since = time.perf_counter()  # what an OOM now would throw away started here
        try:
            with self._no_sync():
                for micro, m in micro_batches(batch, size, start=done, split_fn=self.split_fn):
                    inject = self._draw_injection(size)
                    if inject == "forward":
                        raise torch.OutOfMemoryError(f"CUDA out of memory (injected by autotune in forward, p={self.inject_oom})")
                    loss = self._loss(to_device(micro, self.device))
                    if inject == "backward":
                        raise torch.OutOfMemoryError(f"CUDA out of memory (injected by autotune before backward, p={self.inject_oom})")
                    if self.keep_effective_batch:
                        # Weight by the micro-batch's share so the accumulated gradient is the
                        # gradient of the mean loss over the whole batch.
                        self._backward(loss * (m / n))
                    else:
                        self._backward(loss)
                        self._optimizer_step(m)
                        done += m
                        self._work_since = time.perf_counter()  # this chunk is stepped: kept
                    loss_sum += loss.detach() * m
                    del loss
        except Exception as exc:
            if not is_oom(exc):
                raise
            self._last_oom_message = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else type(exc).__name__
            self._last_oom_injected = "injected by autotune" in self._last_oom_message
            return size, done, loss_sum if not self.keep_effective_batch else loss_sum.zero_()
        return None, done, loss_sum

    def _zero_grad(self) -> None:
        if self._bucket is not None:
            self._bucket.zero()  # in place: the gradients stay views of the all-reduce buffer
        else:
            self.optimizer.zero_grad(set_to_none=True)

    def _no_sync(self) -> Any:
        # Under torchrun DDP must not all-reduce inside backward: a rank may still fail.
        return self._ddp.no_sync() if self._ddp is not None else contextlib.nullcontext()

    def _draw_injection(self, size: int) -> str | None:
        # Never at micro-batch 1: an OOM there ends the run, and injected faults are meant
        # to exercise recovery. The phase decides whether a forward graph is left to free.
        if not self.inject_oom or size <= 1 or self._injector.random() >= self.inject_oom:
            return None
        return "forward" if self._injector.random() < 0.5 else "backward"

    def _backward(self, loss: torch.Tensor) -> None:
        (self._scaler.scale(loss) if self._scaler is not None else loss).backward()

    def _loss(self, micro: Any) -> torch.Tensor:
        if self._autocast is not None:
            with self._autocast.context():
                return self._forward(micro)
        return self._forward(micro)

    def _forward(self, micro: Any) -> torch.Tensor:
        if self.step_fn is not None:
            return self.step_fn(self._forward_model, micro)
        if not (isinstance(micro, (tuple, list)) and len(micro) == 2):
            raise TypeError(f"with loss_fn, each batch must be (inputs, targets); got {type(micro).__name__}: "
                            "pass step_fn(model, micro_batch) for other layouts")
        inputs, targets = micro
        return self.loss_fn(self._forward_model(inputs), targets)

    def _optimizer_step(self, n_samples: int) -> None:
        # An OOM inside optimizer.step() may leave some parameters updated and others not,
        # and a smaller micro-batch cannot help it: it is not retried.
        try:
            if self._scaler is not None:
                self._scaler.step(self.optimizer)  # unscales; skips the step on inf/nan gradients
                self._scaler.update()
            else:
                self.optimizer.step()
        except Exception as exc:
            if not is_oom(exc):
                raise
            failure = str(exc).strip().splitlines()[0][:300]
        else:
            failure = None
        if failure is not None:
            memory = describe_memory(self.device)
            self.journal.write("out_of_memory", self.step, self.epoch, phase="optimizer_step",
                               device=str(self.device), memory=memory)
            self._checkpoint("out_of_memory")
            raise OutOfMemory(f"out of memory on {self.device} in optimizer.step(): the optimizer state does "
                              f"not fit, whatever the micro-batch. Memory: {memory}. Last error: {failure}")
        self._zero_grad()
        if self.scheduler is not None:
            self.scheduler.step()
        self.step += 1
        self.samples_seen += n_samples * (self.ranks.world if self.ranks is not None else 1)

    def _recover_from_oom(self, failed_size: int, tried: list[int]) -> None:
        """Free what the failed attempt held, tell the policies, and give up if none helped."""
        # Partial gradients of the failed batch must not leak into the retry.
        self._zero_grad()
        free_memory(self.device)
        self.ooms += 1
        # The failed attempt's forward/backward work and the clean-up: time the OOM cost.
        lost = time.perf_counter() - self._work_since
        self.journal.write("oom", self.step, self.epoch, micro_batch_size=failed_size, device=str(self.device),
                           message=self._last_oom_message, injected=self._last_oom_injected,
                           lost_seconds=round(lost, 4), ooms=self.ooms)
        logger.warning(f"out of memory at micro-batch {failed_size} on {self.device}; retrying the same batch")
        self._fire(Event.OOM, failed_micro_batch=failed_size, force=True)
        if self.ranks is not None:
            # Every rank's next move is rank 0's: the size to retry at, and any relief first.
            micro, *relief = from_rank0([self.knobs.micro_batch_size, *self._offer_relief()], self.ranks, self.device)
            self.knobs.micro_batch_size = micro
            self._take_agreed_relief(*relief)
        if self.knobs.micro_batch_size < failed_size:
            self.knobs.relief = self._agreed_relief = None  # a smaller micro-batch first: reliefs are the last resort
            return
        if self._pending_relief() is not None:
            # Without the relief the run would stop here; a relief changes the model or the
            # kernels it runs, under memory that is already exhausted: save the progress first.
            self._checkpoint("before_relief")
        if self._apply_relief():
            return  # the same batch again, with the relief
        memory = describe_memory(self.device)
        self.journal.write("out_of_memory", self.step, self.epoch, micro_batch_size=failed_size,
                           device=str(self.device), tried=tried, memory=memory)
        self._checkpoint("out_of_memory")  # the progress so far survives the error
        raise OutOfMemory(
            f"out of memory on {self.device} even at micro-batch {failed_size} "
            f"(sizes tried on this batch: {', '.join(map(str, tried))}); no policy could make more room. "
            f"Memory: {memory}. Last error: {self._last_oom_message}"
        )

    # ----------------------------------------------------------------------------- reliefs
    def _pending_relief(self) -> Relief | None:
        # Alone: what a policy asked for. Under torchrun: what rank 0's policies asked for, once
        # every rank has agreed to it, so all change their models at the same step.
        return self.knobs.relief if self.ranks is None else self._agreed_relief

    def _offer_relief(self) -> list[int]:
        """Rank 0's pending relief as [code, ratio in millionths] for the next agreement; [0, 0]
        alone, on other ranks (only rank 0's policies decide reliefs) or when none is pending."""
        if self.ranks is None or not self.ranks.is_main:
            return [0, 0]
        return relief_to_ints(self.knobs.relief)

    def _take_agreed_relief(self, code: int, ratio: int) -> None:
        """Under torchrun, after an agreement: the relief rank 0 offered becomes every rank's next."""
        action = self.knobs.relief if self.ranks.is_main else None
        self.knobs.relief = None  # taken (rank 0), or not this rank's to decide (the others)
        if not code:
            return
        self._agreed_relief = action or relief_from_ints(code, ratio, reason="rank 0's policies asked for it")

    def _apply_relief(self) -> bool:
        """Carry out the memory relief a policy asked for, between attempts; True if one was applied."""
        action = self._pending_relief()
        if self.ranks is None:
            self.knobs.relief = None
        else:
            self._agreed_relief = None  # rank 0's knobs.relief may hold the next one, still to be agreed
        if action is None:
            return False
        kind = RELIEF_NAMES[type(action)]
        demand = self._step_demand
        if kind == "autocast":
            self._enable_autocast()
            if self._autocast is None:
                details: dict[str, Any] = {"note": f"no autocast on {self.device.type}"}
            else:
                details = {"dtype": str(self._autocast.dtype).replace("torch.", ""),
                           "grad_scaler": self._autocast.needs_scaler}
        elif kind == "checkpointing":
            details = {"blocks": checkpoint_blocks(self.model)}
        else:
            try:
                details = self._prune(action.ratio)
            except UnsafePruning as exc:
                self.reliefs.append("pruning_unsafe")  # the ladder ends here; the model is as it was
                self.journal.write("relief_failed", self.step, self.epoch, relief=kind, reason=str(exc))
                logger.warning(f"not pruning: {exc}")
                return False
        self.reliefs.append(kind)
        self._last_relief_step = self.step
        self._relief_watch = {"relief": kind, "from_step": self.step, "demands": []}
        self.journal.write("relief", self.step, self.epoch, relief=kind, demand_before=demand, **details)
        logger.warning(f"memory relief: {kind} ({action.reason})")
        free_memory(self.device)
        # What stays resident changed (pruning shrinks weights and optimizer state): demand is
        # measured from here on against the room there is now.
        self._room = self._measure_room()
        return True

    def _enable_autocast(self) -> None:
        self._autocast = autocast_plan(self.device)
        if self._autocast is not None and self._autocast.needs_scaler:
            self._scaler = torch.amp.GradScaler(self.device.type)

    def _prune(self, ratio: float) -> dict[str, Any]:
        if self._inputs.example is None:
            raise UnsafePruning("the model has not run yet: there is no input to trace it with")
        self._checkpoint("before_pruning")  # the unpruned model can be restored from here
        # Traced with the model's own captured inputs, called as the training step called it.
        example = to_device(self._inputs.example, self.device)
        result = prune_channels(self.model, example, ratio, forward_fn=_call_with)
        self._pruning_history.append({"example": map_tensors(torch.clone, example), "history": result.history})
        self._wrap_for_ranks()  # new parameters: a new DDP wrapper and gradient buffer
        self.optimizer = rebuild_optimizer(self.optimizer, result)
        adopted = adopt_unrecorded(self.optimizer, self.model)
        if adopted:
            logger.warning(f"{adopted} pruned parameter(s) start with fresh optimizer state (not carried over)")
        rebind_scheduler(self.scheduler, self.optimizer)
        self._pruned_fraction = 1 - (1 - self._pruned_fraction) * (1 - result.removed_fraction)
        return {"channel_ratio": ratio, "parameters_before": result.parameters_before,
                "parameters_after": result.parameters_after, "kept_whole": result.ignored,
                "parameters_removed_in_all": round(self._pruned_fraction, 4)}

    def _restore_reliefs(self, saved: dict[str, Any]) -> None:
        """Make this (fresh) trainer's model and forward what they were when the checkpoint was
        written: the reliefs again, in order, and a pruned model pruned the same way."""
        applied = list(saved.get("applied", []))
        if self.reliefs == applied:
            return  # this trainer is in that state already (resumed in the same process)
        if self.reliefs:
            raise ValueError(f"this trainer's model already has the reliefs {self.reliefs}, the checkpoint "
                             f"{applied}: resume into a fresh trainer built like the original one")
        prunes = iter(saved.get("pruning", []))
        for kind in applied:
            if kind == "autocast":
                self._enable_autocast()
            elif kind == "checkpointing":
                checkpoint_blocks(self.model)
            elif kind == "pruning":
                entry = next(prunes)
                example = to_device(entry["example"], self.device)
                result = replay_pruning(self.model, example, entry["history"], forward_fn=_call_with)
                self._wrap_for_ranks()
                self.optimizer = rebuild_optimizer(self.optimizer, result)  # its state is loaded after
                rebind_scheduler(self.scheduler, self.optimizer)
                self._pruning_history.append(entry)
            self.reliefs.append(kind)  # "pruning_unsafe" too: the ladder stays where it ended
        self._pruned_fraction = saved.get("pruned_fraction", 0.0)
        if self._scaler is not None and saved.get("grad_scaler"):
            self._scaler.load_state_dict(saved["grad_scaler"])  # fp16: the loss scale it had reached

    def _relief_effect(self) -> None:
        """A few steps after a relief, journal what the steps demand now."""
        watch = self._relief_watch
        if watch is None or self._step_demand is None:
            return
        watch["demands"].append(self._step_demand)
        if len(watch["demands"]) >= 3:
            self.journal.write("relief_effect", self.step, self.epoch, relief=watch["relief"],
                               applied_at_step=watch["from_step"], demand_after=max(watch["demands"]))
            self._relief_watch = None

    # ----------------------------------------------------------------------------- helpers
    def _fire(self, event: Event, failed_micro_batch: int | None = None, timing: StepTiming | None = None,
              force: bool = False) -> None:
        # Building a snapshot reads memory figures; skip it when nobody listens.
        if not force and not any(event in p.events for p in self.dispatcher.policies):
            return
        snap = Snapshot(
            step=self.step, epoch=self.epoch, batch_size=self.knobs.batch_size,
            micro_batch_size=self.knobs.micro_batch_size, device=str(self.device),
            keep_effective_batch=self.keep_effective_batch, failed_micro_batch=failed_micro_batch,
            last_good_micro_batch=self._last_good_micro, step_demand=self._step_demand,
            ooms=self.ooms, sample=self._latest_sample(fresh=event is Event.OOM), window=tuple(self._window),
            allocator=self._allocator, timing=timing,
            input=self.input.state(self.journal, self.step, self.epoch, profile=event is Event.IO_BOUND),
            reliefs=tuple(self.reliefs), last_relief_step=self._last_relief_step,
            pruned_fraction=self._pruned_fraction,
        )
        self.dispatcher.fire(event, snap)

    def _log_step(self, timing: StepTiming, samples: int, batch_loss: torch.Tensor) -> None:
        if not self.step_log.due():  # thinned: a two-day run writes megabytes, and syncs for the loss rarely
            return
        allocator = self._allocator
        allocated = allocator.allocated_bytes if allocator else None
        reserved = allocator.reserved_bytes if allocator else None
        self.step_log.write(self.step, self.epoch, micro_batch_size=self.knobs.micro_batch_size, samples=samples,
                            samples_seen=self.samples_seen,
                            step_seconds=round(timing.step_seconds, 6),
                            data_wait_fraction=round(timing.data_wait_fraction, 4),
                            demand=None if self._step_demand is None else round(self._step_demand, 4),
                            allocated_bytes=allocated, reserved_bytes=reserved)
        if self.tensorboard is not None:
            sample = self._latest_sample()
            self.tensorboard.step(
                self.step, loss=batch_loss.item() / max(samples, 1), samples_seen=self.samples_seen,
                step_samples=samples, step_seconds=timing.step_seconds, micro_batch_size=self.knobs.micro_batch_size,
                data_wait_fraction=timing.data_wait_fraction, used_bytes=sample.used_bytes,
                cap_bytes=sample.cap_bytes, allocated_bytes=allocated, reserved_bytes=reserved,
                demand=self._step_demand)

    def _rebuild_loader(self) -> Iterator[Any]:
        self._loader_version = self.knobs.loader_version
        host_cap = self.knobs.memory_cap_bytes if self.device.type == "cpu" else None
        return self.input.rebuild(self.knobs.num_workers, self.knobs.sample_cache, self.journal, self.step,
                                  self.epoch, self.position, host_cap_bytes=host_cap)

    # ----------------------------------------------------------------------------- checkpoints
    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue exactly: weights, optimizer, scheduler, counters,
        position in the epoch, sizes, policy states and random states."""
        version, keys, gauss = self._injector.getstate()
        return {
            "format": 1,
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
            "step": self.step, "epoch": self.epoch, "position": self.position, "batches_done": self.batches_done,
            "samples_seen": self.samples_seen, "ooms": self.ooms,
            "batch_size": self.knobs.batch_size, "micro_batch_size": self.knobs.micro_batch_size,
            "num_workers": self.knobs.num_workers,
            "reliefs": {"applied": list(self.reliefs), "pruning": self._pruning_history,
                        "pruned_fraction": self._pruned_fraction,
                        "grad_scaler": self._scaler.state_dict() if self._scaler is not None else None},
            "policies": self.dispatcher.state_dict(),
            "rng": rng_state(),
            "injector": [version, list(keys), gauss],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `state_dict` returned."""
        if state.get("reliefs"):
            self._restore_reliefs(state["reliefs"])  # a pruned model's weights fit only a pruned model
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        if self.scheduler is not None and state.get("scheduler") is not None:
            self.scheduler.load_state_dict(state["scheduler"])
        for name in ("step", "epoch", "position", "batches_done", "samples_seen", "ooms"):
            setattr(self, name, state[name])
        if state["batch_size"] != self.knobs.batch_size:
            raise ValueError(f"the checkpoint was made with batch_size {state['batch_size']}, this trainer has "
                             f"{self.knobs.batch_size}: the position in the epoch would not line up")
        self.knobs.micro_batch_size = state["micro_batch_size"]
        workers = state.get("num_workers", self.knobs.num_workers)
        if workers != self.knobs.num_workers and self.input.owned:  # as tuned before the stop
            self.knobs.num_workers = workers
            self.input.set_workers(workers)
        self.dispatcher.load_state_dict(state["policies"])
        if self.ranks is not None and "rng_ranks" in state:
            if len(state["rng_ranks"]) != self.ranks.world:
                raise ValueError(f"the checkpoint was made by {len(state['rng_ranks'])} ranks, this job has {self.ranks.world}")
            set_rng_state(state["rng_ranks"][self.ranks.rank])
        else:
            set_rng_state(state["rng"])
        version, keys, gauss = state["injector"]
        self._injector.setstate((version, tuple(keys), gauss))

    def _checkpoint(self, reason: str) -> Path | None:
        """Write a checkpoint now. Failing to write one is journaled, not raised: it must not
        turn an orderly stop (or the error being reported) into a different error."""
        try:
            state = self.state_dict()
            if self.ranks is not None:  # every rank's random state; the rest is the same everywhere
                state["rng_ranks"] = gather(state["rng"], self.ranks)
                if not self.is_main:
                    self._last_checkpoint = (self.step, time.monotonic())
                    return None
            path, seconds = self.checkpoints.save(state, self.step)
        except Exception as exc:
            self.journal.write("checkpoint_failed", self.step, self.epoch, reason=reason, error=repr(exc)[:300])
            logger.error(f"could not write a checkpoint ({reason}): {exc}")
            return None
        self._last_checkpoint = (self.step, time.monotonic())
        self.journal.write("checkpoint", self.step, self.epoch, reason=reason, path=str(path),
                           seconds=round(seconds, 4), position=self.position, samples_seen=self.samples_seen)
        return path

    def _checkpoint_due(self) -> int:
        """2: due by steps, 1: due by time, 0: not due."""
        last_step, last_time = self._last_checkpoint
        if self.checkpoint_every is not None and self.step - last_step >= self.checkpoint_every:
            return 2
        if self.checkpoint_interval is not None and time.monotonic() - last_time >= self.checkpoint_interval:
            return 1
        return 0

    def _resume(self) -> None:
        found = self.checkpoints.load_latest(map_location=self.device)
        if found is None:
            logger.info(f"no checkpoint in {self.checkpoints.folder}: starting fresh")
            self.journal.write("resume", self.step, self.epoch, found=False)
            return
        state, path = found
        self.load_state_dict(state)
        logger.info(f"resumed from {path}: step {self.step}, epoch {self.epoch}, {self.position} samples into it")
        self.journal.write("resume", self.step, self.epoch, found=True, path=str(path), position=self.position,
                           samples_seen=self.samples_seen)

    def _preempt(self, signum: int) -> None:
        name = signal.Signals(signum).name
        path = self._checkpoint(f"signal {name}")
        message = (f"stopped by {name} at step {self.step} (epoch {self.epoch}, {self.position} samples into it); "
                   f"checkpoint {path}; continue with fit(..., resume=True)")
        self.journal.write("preempted", self.step, self.epoch, signal=name, checkpoint=str(path))
        logger.warning(message)
        raise Preempted(signum, message)

    # ----------------------------------------------------------------------------- the monitor
    def _start_monitor(self) -> None:
        if not self.monitor_enabled or self.monitor is not None or not self.is_main:
            return
        self.monitor = MonitorProcess(self.run_dir, interval=self.monitor_interval,
                                      gpu_uuid=cuda_uuid(self.device), cap_bytes=self.knobs.memory_cap_bytes)
        self.monitor.start()
        self.journal.write("monitor_start", self.step, self.epoch, pid=self.monitor.pid, interval=self.monitor_interval)

    def _stop_monitor(self) -> None:
        if self.monitor is not None:
            self.monitor.stop()
            self.monitor = None

    def _watch_memory(self) -> None:
        """Between steps: take the monitor's newest sample (microseconds, never blocks), keep
        the monitor alive, and fire what the detectors see."""
        events = []
        if self.monitor is not None:
            got = self.monitor.latest()
            if got is not None:
                sample = got[0]
                if sample.used_bytes is None and self.device.type == "cuda":
                    # NVML not available here: CUDA's own figure, read in-process, stands in.
                    sample = device_sample(self.device, self.knobs.memory_cap_bytes)
                self._window.append(sample)
                events += self.detector.on_sample(sample)
            elif not self.monitor.alive():
                self._monitor_died()
        events += self.detector.on_step(self._allocator, self._window[-1] if self._window else None)
        for event in events:
            self._fire(event, force=True)

    def _monitor_died(self) -> None:
        # Training goes on without it; the journal and the log say so.
        code = self.monitor.returncode
        restarted = self.monitor.restart()
        self.journal.write("monitor_restart" if restarted else "monitor_gave_up", self.step, self.epoch,
                           returncode=code, restarts=self.monitor.restarts, pid=self.monitor.pid)
        if restarted:
            logger.warning(f"the monitor process exited (code {code}); restarted it ({self.monitor.restarts}/"
                           f"{self.monitor.max_restarts})")
        else:
            logger.error(f"the monitor process exited (code {code}) and its restarts are spent; training "
                         "goes on without memory samples")
            self._stop_monitor()

    def _latest_sample(self, fresh: bool = False) -> DeviceSample | None:
        # A fresh in-process reading where the moment matters (an OOM) or when no monitor runs.
        if fresh or not self._window:
            return device_sample(self.device, self.knobs.memory_cap_bytes)
        return self._window[-1]

    def _warm_up_oom_path(self) -> None:
        # Under a hard memory cap anything may fail to allocate, including a lazy import
        # or a first-time library lookup. Run the OOM path's helpers once now, while
        # there is memory, so the path itself needs next to nothing later.
        is_oom(RuntimeError("warm-up"))
        load_libc()
        load_mkl()
        describe_memory(self.device)
        self._memory_text()
        self._zero_grad()

    def _measure_room(self) -> tuple[int, int] | None:
        """(memory in use, room left under the cap) before training: weights, libraries and
        the cap as they are when fit() starts. A step's demand is measured against it."""
        sample = device_sample(self.device, self.knobs.memory_cap_bytes)
        in_use = self._peak.current()
        if sample.cap_bytes is None or sample.used_bytes is None or in_use is None:
            return None
        return in_use, sample.cap_bytes - sample.used_bytes

    def _demand(self) -> float | None:
        peak = self._peak.peak()
        if peak is None or self._room is None or self._room[1] <= 0:
            return None
        return max(0, peak - self._room[0]) / self._room[1]

    def _memory_text(self) -> str:
        sample = device_sample(self.device, self.knobs.memory_cap_bytes)
        if sample.cap_bytes and sample.used_bytes is not None:
            return f"{format_bytes(sample.used_bytes)} ({format_bytes(sample.cap_bytes - sample.used_bytes)} free)"
        return format_bytes(sample.used_bytes)

    def _step_size(self) -> int:
        if self.keep_effective_batch:
            return self.knobs.batch_size
        return min(self.knobs.micro_batch_size, self.knobs.batch_size)

    def _planned_batches(self, epochs: int, max_steps: int | None) -> int | None:
        try:
            total = (epochs - self.epoch) * len(self.input.loader) - self.batches_done
        except TypeError:
            return None if max_steps is None else max_steps - self.step
        if max_steps is not None and self.keep_effective_batch:
            total = min(total, max_steps - self.step)
        return max(total, 0)
