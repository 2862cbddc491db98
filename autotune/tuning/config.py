"""Turning `AutoTrainer`'s arguments into what the parts need, checked before anything trains.

Every function here either returns a resolved value or raises an error that names the
argument and the value. Nothing here trains, and nothing here keeps state; the one side
effect is the CUDA allocator fraction that `resolve_memory_cap` sets (the cap must bind).
`tuner_options` builds the Tuner's options record (tuning/options.py) from its keywords, checked.

Owns: the rules for arguments. Touches: the CUDA allocator fraction (above), nothing else.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
from collections.abc import Mapping, Sequence
from typing import Any, Callable, Iterable

import psutil
import torch
from torch import nn

from autotune.common.options import build
from autotune.common.units import format_bytes, parse_bytes
from autotune.common.validate import (
    check_bool,
    check_callable,
    check_int,
    check_positive,
    check_range,
    is_bool,
    is_number,
)
from autotune.memory.figures import with_cuda_index
from autotune.monitor.process import MAX_INTERVAL, MIN_INTERVAL
from autotune.step.core import PRECISIONS
from autotune.step.options import StepOptions
from autotune.tuning.options import TunerOptions

OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]


def resolve_device(device: str | torch.device | None) -> torch.device:
    """The device to train on: the given one, checked, or CUDA when available, else CPU. A CUDA
    device always comes back with its index ("cuda" is the current one, "cuda:0" as a rule):
    `torch.cuda.set_per_process_memory_fraction` and friends refuse a device without one, and
    `torch.device("cuda") != torch.device("cuda:0")` where tensors' devices are compared."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"unknown device {device!r}: use 'cpu', 'cuda' or 'cuda:N'") from exc
    if resolved.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {device!r} asked for, but CUDA is not available on this machine")
        if resolved.index is not None and resolved.index >= torch.cuda.device_count():
            raise ValueError(f"device {device!r}: only {torch.cuda.device_count()} CUDA device(s) visible")
        return with_cuda_index(resolved)
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
        torch.cuda.set_per_process_memory_fraction(cap_bytes / total, with_cuda_index(device))
    return cap_bytes


def resolve_micro_batch(micro_batch_size: int | str | None, batch_size: int) -> int:
    """The micro-batch to start at. "auto" starts at the whole batch: OOMs halve it and
    fit_micro_batch finds the largest size that fits from what the steps need, on real batches."""
    micro = batch_size if micro_batch_size in (None, "auto") else micro_batch_size
    check_int("", "micro_batch_size", micro, 1)
    if micro > batch_size:
        raise ValueError(f"micro_batch_size ({micro}) cannot exceed batch_size ({batch_size})")
    return micro


def make_optimizer(optimizer: torch.optim.Optimizer | OptimizerFactory | None, model: nn.Module) -> torch.optim.Optimizer:
    """The optimizer over the model's parameters: given, built by a factory, or AdamW(lr=1e-3)."""
    if not any(p.requires_grad for p in model.parameters()):
        count = sum(1 for _ in model.parameters())
        raise ValueError(f"the model ({type(model).__name__}) has no trainable parameter "
                         f"({count} parameter(s), none with requires_grad=True): there is nothing to train")
    if optimizer is None:
        return torch.optim.AdamW(model.parameters(), lr=1e-3)
    if not isinstance(optimizer, torch.optim.Optimizer):
        if not callable(optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer or a factory params -> Optimizer, "
                            f"got {type(optimizer).__name__}")
        optimizer = optimizer(model.parameters())
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"the optimizer factory returned {type(optimizer).__name__}, not a torch.optim.Optimizer")
    own = {id(p) for p in model.parameters()}
    foreign = sum(1 for g in optimizer.param_groups for p in g["params"] if id(p) not in own)
    if foreign:
        raise ValueError(f"the optimizer holds {foreign} parameter(s) that are not the model's; "
                         "build it over model.parameters()")
    return optimizer


def make_scheduler(scheduler: Any, optimizer: torch.optim.Optimizer) -> Any:
    """The LR scheduler over `optimizer`: given, built by a factory `optimizer -> scheduler`, or None."""
    if scheduler is None:
        return None
    if not hasattr(scheduler, "state_dict"):
        if not callable(scheduler):
            raise TypeError(f"scheduler must be an LR scheduler or a factory optimizer -> scheduler, "
                            f"got {type(scheduler).__name__}")
        scheduler = scheduler(optimizer)
    if getattr(scheduler, "optimizer", optimizer) is not optimizer:
        raise ValueError("the scheduler is bound to another optimizer; build it over the trainer's optimizer")
    return scheduler


def injection_rate(rate: float | None) -> float:
    """The fault-injection probability: `inject_oom`, else AUTOTUNE_INJECT_OOM, else 0."""
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
    if not is_number(rate) or not 0 <= rate < 1:
        raise ValueError(f"{source}={given!r} is not a probability in [0, 1)")
    return float(rate)


def check_sample_layout(sample: Any) -> None:
    """With `loss_fn`, samples (and batches) must be (inputs, targets)."""
    if not (isinstance(sample, (tuple, list)) and len(sample) == 2):
        raise TypeError(
            f"with loss_fn, each sample must be (inputs, targets); got {type(sample).__name__}"
            f"{' of length ' + str(len(sample)) if isinstance(sample, (tuple, list)) else ''}: "
            "pass step_fn(model, micro_batch) for other layouts"
        )


def check_run_limits(*, checkpoint_every: Any, checkpoint_interval: Any, keep_checkpoints: Any, seed: Any,
                     monitor: bool, monitor_interval: Any, data_stall_seconds: Any = None) -> None:
    """The counts and durations of `AutoTrainer`'s arguments (batch sizes are checked with the data)."""
    check_int("", "checkpoint_every", checkpoint_every, 1, optional=True)
    check_positive("", "checkpoint_interval", checkpoint_interval, optional=True)
    check_positive("", "data_stall_seconds", data_stall_seconds, optional=True)
    check_int("", "keep_checkpoints", keep_checkpoints, 1)
    check_seed(seed)
    check_bool("", "monitor", monitor)
    # Checked with the monitor off too: the run's own memory readings keep its pace (a string failed at step 2).
    check_range("", "monitor_interval", monitor_interval, MIN_INTERVAL, MAX_INTERVAL, " s")


NONFINITE = ("skip", "stop")
# What torch.Generator.manual_seed takes is a 64-bit integer; any one, negative too, seeds it.
SEED_RANGE = (-2 ** 63, 2 ** 63 - 1)


def check_seed(seed: Any) -> None:
    """`seed`: an integer torch's generators take (64 bits), checked before a generator is seeded with it."""
    check_int("", "seed", seed, SEED_RANGE[0], maximum=SEED_RANGE[1])


def compile_keywords() -> frozenset[str]:
    """The keywords `torch.compile(model, **compile)` takes besides the model."""
    return frozenset(inspect.signature(torch.compile).parameters) - {"model"}


def tuner_options(given: Mapping[str, Any]) -> TunerOptions:
    """The Tuner's options record from its keywords (`locals()` at its first line), checked, with
    `inject_oom` resolved to the rate (the AUTOTUNE_INJECT_OOM environment variable read here, once)."""
    options = build(TunerOptions, given)
    check_tuner_options(options)
    return _python_bools(dataclasses.replace(options, step=_python_bools(dataclasses.replace(
        options.step, inject_oom=injection_rate(options.step.inject_oom)))))


def _python_bools(options: Any) -> Any:
    """`options` with numpy's bools as Python's: the parts ask `tensorboard is True`, `compile is not False`."""
    bools = {f.name: bool(value) for f in dataclasses.fields(options)
             if is_bool(value := getattr(options, f.name)) and not isinstance(value, bool)}
    return dataclasses.replace(options, **bools) if bools else options


def check_step_options(options: StepOptions) -> None:
    """Precision, clipping, the scheduler's interval, torch.compile's options, non-finite steps."""
    if options.on_nonfinite not in NONFINITE:
        raise ValueError(f"on_nonfinite={options.on_nonfinite!r}: pass one of {', '.join(map(repr, NONFINITE))}")
    check_int("", "max_nonfinite_steps", options.max_nonfinite_steps, 0, optional=True)
    if not (is_bool(options.compile) or isinstance(options.compile, dict)):
        raise TypeError(f"compile={options.compile!r}: pass True/False or a dict of torch.compile options")
    if isinstance(options.compile, dict):
        unknown = sorted(map(str, set(options.compile) - compile_keywords()))
        if unknown:
            raise ValueError(f"compile={options.compile!r}: torch.compile takes no {', '.join(map(repr, unknown))}; "
                             f"its keywords are {', '.join(sorted(compile_keywords()))}")
    check_bool("", "keep_effective_batch", options.keep_effective_batch)
    check_seed(options.seed)
    if options.precision not in PRECISIONS:
        raise ValueError(f"precision={options.precision!r}: pass one of {', '.join(map(repr, PRECISIONS))}")
    check_positive("", "clip_grad_norm", options.clip_grad_norm, optional=True)
    check_positive("", "clip_grad_value", options.clip_grad_value, optional=True)
    if options.scheduler_interval not in ("step", "epoch"):
        raise ValueError(f"scheduler_interval={options.scheduler_interval!r}: pass 'step' or 'epoch'")


def check_tuner_options(options: TunerOptions) -> None:
    """The options a Tuner (and so AutoTrainer, which builds one) takes: checked once, here."""
    micro_batch_size, batch_size = options.micro_batch_size, options.batch_size
    check_int("", "micro_batch_size", micro_batch_size, 1, optional=True)
    check_int("", "batch_size", batch_size, 1, optional=True)
    check_int("", "max_micro_batch_size", options.max_micro_batch_size, 1, optional=True)
    if not is_bool(options.memory_snapshot):
        check_int("", "memory_snapshot", options.memory_snapshot, 1)
    for name in ("monitor", "progress", "shard", "reliefs"):
        check_bool("", name, getattr(options, name))
    check_range("", "monitor_interval", options.monitor_interval, MIN_INTERVAL, MAX_INTERVAL, " s")
    tensorboard = options.tensorboard
    if not (is_bool(tensorboard) or isinstance(tensorboard, (str, os.PathLike))):
        raise TypeError(f"tensorboard must be True/False or a folder (a str or a Path), got {tensorboard!r}")
    policies = options.policies
    if not (policies is None or isinstance(policies, (str, os.PathLike, Sequence))):
        raise TypeError(f"policies={policies!r}: pass a preset name, a path to a TOML preset, a list of policy "
                        "objects, or None")
    if micro_batch_size is not None and batch_size is not None and micro_batch_size > batch_size:
        raise ValueError(f"micro_batch_size ({micro_batch_size}) cannot exceed batch_size ({batch_size})")
    check_callable("", "split_fn", options.step.split_fn, "split_fn(batch, size) -> micro-batches")
    check_step_options(options.step)


def check_what_is_trained(*, model: Any, loss_fn: Any, step_fn: Any) -> None:
    """The model and the functions a Tuner computes its loss with."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if loss_fn is not None and step_fn is not None:
        raise ValueError("pass one of loss_fn(outputs, targets) or step_fn(model, micro_batch), not both")
    check_callable("", "loss_fn", loss_fn, "loss_fn(outputs, targets)")
    check_callable("", "step_fn", step_fn, "step_fn(model, micro_batch)")


def check_evaluation(*, eval_dataset: Any, eval_every: Any, eval_batch_size: Any, metrics: Any,
                     scheduler_metric: Any, plateau: bool | None) -> None:
    """The evaluation arguments, and the metric a ReduceLROnPlateau watches (`plateau`: whether the scheduler
    is one; None: not known yet, a factory's scheduler, asked again once it is built)."""
    if eval_every is not None and eval_every != "epoch":
        check_int("", "eval_every", eval_every, 1)
    if eval_dataset is not None and not (hasattr(eval_dataset, "__getitem__") or hasattr(eval_dataset, "__iter__")):
        raise TypeError(f"eval_dataset must be a dataset (a torch Dataset, an iterable of batches), got {eval_dataset!r}")
    if eval_dataset is None and eval_every is not None:
        raise ValueError(f"eval_every={eval_every!r} needs eval_dataset=")
    check_int("", "eval_batch_size", eval_batch_size, 1, optional=True)
    if metrics is not None:
        if not isinstance(metrics, Mapping):
            raise TypeError(f"metrics must map names to functions, got {type(metrics).__name__}")
        for name, fn in metrics.items():
            if not isinstance(name, str) or not callable(fn) or name == "loss":
                raise ValueError(f"metrics[{name!r}]: each name must be a string other than 'loss' "
                                 "(always reported), each value a function")
    names = {"train_loss", *({"loss", *(metrics or {})} if eval_dataset is not None else ())}
    if scheduler_metric is not None and scheduler_metric not in names:
        raise ValueError(f"scheduler_metric={scheduler_metric!r} is not one of {sorted(names)}")
    if scheduler_metric is not None and plateau is False:
        raise ValueError("scheduler_metric= is for a ReduceLROnPlateau scheduler, which steps on a metric")
