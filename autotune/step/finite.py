"""Whether gradients are finite: the check before every optimizer step autotune takes.

`all_finite` reads every gradient once with one fused op per device (the gradient scaler's own
check, at a scale of 1); `nonfinite` names which tensors hold a NaN or an inf (a checkpoint's
check). On CUDA a fused optimizer's check is handed to its kernel and read a step late
(`LateRead`): the host never waits for it.

Owns: the found-inf flags (one per device, made once) and the late read's. Touches nothing else:
the step core (step/core.py) asks, and decides what a non-finite step means.
"""

from __future__ import annotations

import ctypes

import torch


def nonfinite(tensors: list[torch.Tensor]) -> list[int]:
    """The positions of the tensors holding a NaN or an inf. Each tensor's L2 norm, accumulated in
    float32 (one fused kernel on CUDA, ~0.2 ms for 7 MiB on one CPU core; a max-abs is 40 times
    slower there, a per-tensor isfinite() 20 times and one byte an element), is read once; a
    norm that is not finite is then confirmed exactly, since squares of finite values beyond
    1.8e19 overflow too."""
    tensors = [t for t in tensors if t.numel()]  # an empty shard has nothing to say
    bad: list[int] = []
    by_device: dict[torch.device, list[int]] = {}
    for i, t in enumerate(tensors):
        by_device.setdefault(t.device, []).append(i)
    for positions in by_device.values():
        norms = torch._foreach_norm([tensors[i] for i in positions], 2, dtype=torch.float32)
        finite = torch.isfinite(torch.stack(norms))
        if bool(finite.all()):
            continue
        bad += [i for i, ok in zip(positions, finite.tolist()) if not ok and not bool(torch.isfinite(tensors[i]).all())]
    return bad


def all_finite(tensors: list[torch.Tensor]) -> bool:
    """Whether every element of every tensor is finite, read once: one fused op per device (the
    gradient scaler's own check, with a scale of 1, which leaves every value as it is), exact at
    any magnitude. In the middle of a training step each torch op costs a ~1 ms step 10-25 us
    (cold caches), so one op, not the four a norm and its reduction take."""
    if not tensors:
        return True
    try:
        return finite_on(flag_for(tensors[0].device), tensors)  # one device: the common case
    except (NotImplementedError, RuntimeError):
        pass
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for t in tensors:
        by_device.setdefault(t.device, []).append(t)
    for device, group in by_device.items():
        try:
            if not finite_on(flag_for(device), group):
                return False
        except (NotImplementedError, RuntimeError):  # sparse or complex tensors: one by one
            if not all(bool(torch.isfinite(t.coalesce().values() if t.is_sparse else t).all()) for t in group):
                return False
    return True


def finite_on(flag: "FoundFlag", tensors: list[torch.Tensor]) -> bool:
    """The fused check of `tensors`, all on `flag`'s device (else it raises, the flag cleared)."""
    try:
        torch._amp_foreach_non_finite_check_and_unscale_(tensors, flag.tensor, flag.one)
    except (NotImplementedError, RuntimeError):
        flag.clear()  # what it looked at before it refused may have set it
        raise
    if not flag.found():
        return True
    flag.clear()  # the check only ever sets it: cleared after a find, not before each check
    return False


class FoundFlag:
    """The fused check's found-inf flag and its scale of 1 on one device, made once. On CPU the
    flag is read through a ctypes view of its memory: no torch op, no sync to wait for. 0-d, as
    the gradient scaler's: a fused optimizer takes it as `found_inf` (see `LateRead`)."""

    def __init__(self, device: torch.device):
        self.tensor, self.one = torch.zeros((), device=device), torch.ones((), device=device)
        self.cell = ctypes.c_float.from_address(self.tensor.data_ptr()) if device.type == "cpu" else None

    def clear(self) -> None:
        self.tensor.zero_()

    def found(self) -> bool:
        return bool(self.cell.value) if self.cell is not None else bool(self.tensor.item())


_FLAGS: dict[torch.device, FoundFlag] = {}

# Devices where the non-finite check of a fused optimizer's step is read a step late (see
# `LateRead`). On CPU reading the flag costs nothing, so it is read at once; tests add "cpu"
# to drive the late path for real.
READ_LATE_ON = frozenset({"cuda"})


class LateRead:
    """The non-finite check of an optimizer step, taken without the host waiting for it.

    Reading the check's flag right away is a host-device sync: on CUDA the host then waits for
    the backward to finish and the device idles while the host enqueues the optimizer step and
    the next forward (measured on an H200: +21% on a 2 ms step, +3.7% on a 20 ms one). A fused
    optimizer (`fused=True`: Adam, AdamW, SGD, Adagrad) takes the flag as the gradient scaler
    passes it, `found_inf`, and skips its update on the device (weights, moments and step count
    stay as they were). So the step is enqueued with the flag, the flag is copied to the host
    behind it, and the host reads it when it next needs to know (the next optimizer step, a
    checkpoint, the end): long done by then. Until that read the step counts as taken and the
    scheduler's step for it is held back; a skipped step is uncounted then, as if read at once.
    One per StepCore, made at its first such step; its flag is its own (all_finite's is shared)."""

    __slots__ = ("flag", "host", "event", "pending", "step", "samples", "scheduler_owed")

    def __init__(self, device: torch.device):
        self.flag = FoundFlag(device)
        on_cpu = self.flag.cell is not None  # the flag's own memory is the host's copy
        self.host = None if on_cpu else torch.empty((), pin_memory=True)
        self.event = None if on_cpu else torch.cuda.Event()
        self.pending, self.step, self.samples, self.scheduler_owed = False, 0, 0, False

    def taken(self, step: int, samples: int, scheduler_owed: bool) -> None:
        """The step was enqueued with `flag` as its found_inf: copy the flag behind it."""
        if self.host is not None:
            self.host.copy_(self.flag.tensor, non_blocking=True)
            self.event.record()
        self.pending, self.step, self.samples, self.scheduler_owed = True, step, samples, scheduler_owed

    def found(self) -> bool:
        """Whether the pending step's gradients were not finite (it is then no longer pending).
        The check only ever sets the flag: it is cleared here after a find, not before each step
        (one kernel launch fewer a step, where launches are the step's cost)."""
        self.pending = False
        if self.host is None:
            found = self.flag.found()
        else:
            self.event.synchronize()  # recorded a step ago: done, unless the host runs far ahead of the device
            found = bool(self.host)
        if found:
            self.flag.clear()
        return found


def flag_for(device: torch.device) -> FoundFlag:
    if device not in _FLAGS:
        _FLAGS[device] = FoundFlag(device)
    return _FLAGS[device]
