"""Caps a process can put on itself: RLIMIT_AS on CPU, the allocator fraction on CUDA.

Used by the demo, the examples, the tests and the benchmarks to make real out-of-memory errors
happen on purpose. RLIMIT_AS counts virtual address space, which grows the first time threads
and libraries warm up (each glibc malloc arena reserves 64 MiB of it), so the cap is set
relative to the virtual size *after* a warm-up step.

What a step needs differs from CPU to CPU (AVX2, AVX-512, native bf16, AMX): oneDNN and MKL pick
other kernels, and on a CPU with native bf16 each new micro-batch size compiles ~30 MiB of them.
So no cap is a constant: `calibrate_headroom` finds, with real OOMs on this machine, the least
headroom under which a size that must fit fits and the one under which a size that must fail
fits, and returns a cap between them with a margin on both sides, or why it cannot.

Owns: the RLIMIT_AS cap of this process (set and lifted) and its calibration. Touches nothing else.
"""

from __future__ import annotations

import dataclasses
import gc
import resource
from typing import Any, Callable

import torch

from autotune.memory.figures import M_ARENA_MAX, load_libc, with_cuda_index
from autotune.monitor.host import virtual_bytes

_M_MMAP_THRESHOLD = -3  # glibc mallopt parameters


def single_malloc_arena() -> None:
    """Make every thread allocate from glibc's main arena. Call it before threads start
    allocating (before the first parallel torch op), or set MALLOC_ARENA_MAX=1.

    When an allocation is refused under RLIMIT_AS, glibc may fall back to reserving a new
    64 MiB heap for a thread's arena; such reservations count against the cap, and
    malloc_trim cannot release them. With one arena the failed attempt leaves nothing
    behind, so the micro-batch that fits is the same on every run.
    """
    libc = load_libc()
    if libc is not None and hasattr(libc, "mallopt"):
        libc.mallopt(M_ARENA_MAX, 1)


def fix_mmap_threshold(threshold: int = 128 * 1024) -> None:
    """Send every block over `threshold` to mmap (returned to the OS on free): call it before a
    warm-up, so the memory the warm-up frees does not stay mapped and widen a cap set after it."""
    # glibc raises its mmap threshold after big blocks are freed, after which big tensors
    # come from the heap and freed ones may stay mapped: virtual size then drifts up with
    # fragmentation and the same batch fails later in the run. A fixed threshold sends
    # every big block to mmap and back to the OS on free, so virtual size follows live memory.
    libc = load_libc()
    if libc is not None and hasattr(libc, "mallopt"):
        libc.mallopt(_M_MMAP_THRESHOLD, threshold)


cap_changes = 0  # caps set or lifted here: a step's CapReader reads the cap again at once (kernel_room.py)


def cap_address_space(headroom_bytes: int) -> int:
    """Set the soft RLIMIT_AS to the current virtual size plus `headroom_bytes`; return the cap.

    Only the soft limit changes, so `lift_address_space_cap()` can undo it. Also fixes
    glibc's mmap threshold so the cap measures live memory rather than heap drift.
    """
    fix_mmap_threshold()
    current = virtual_bytes()
    if current is None:
        raise RuntimeError("cannot read this process's virtual size to set RLIMIT_AS")
    cap = current + int(headroom_bytes)
    _soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    if hard != resource.RLIM_INFINITY and cap > hard:
        cap = hard
    resource.setrlimit(resource.RLIMIT_AS, (cap, hard))
    _changed()
    return cap


def _changed() -> None:
    global cap_changes
    cap_changes += 1


def lift_address_space_cap() -> None:
    """Raise the soft RLIMIT_AS back to the hard limit."""
    _soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (hard, hard))
    _changed()


def cap_cuda_memory(device: torch.device, cap_bytes: int) -> float:
    """Limit the CUDA caching allocator on `device` to `cap_bytes`; return the fraction set."""
    total = torch.cuda.get_device_properties(device).total_memory
    fraction = min(1.0, cap_bytes / total)
    torch.cuda.set_per_process_memory_fraction(fraction, with_cuda_index(device))
    return fraction


MiB = 2**20


@dataclasses.dataclass(frozen=True)
class Calibration:
    """The headroom `calibrate_headroom` chose (None: none could be), from what it measured."""

    headroom_bytes: int | None
    fits_bytes: int | None  # the least headroom under which the size that must fit fits
    fails_bytes: int | None  # the same for the size that must fail
    reason: str  # what was measured and chosen, or why nothing could be

    def __str__(self) -> str:
        return self.reason


def runs_under(headroom_bytes: int, probe: Callable[[], Any]) -> bool:
    """Whether `probe()` runs without running out of memory under a cap of `headroom_bytes`
    above the current virtual size (a real OOM, caught). Caches are emptied first, so a probe
    pays what a new micro-batch size pays in a run (oneDNN's kernels compiled afresh)."""
    from autotune.common.oom import is_oom
    from autotune.memory.figures import free_cpu_caches

    gc.collect()
    free_cpu_caches()
    cap_address_space(headroom_bytes)
    try:
        probe()
        return True
    except Exception as exc:
        if not is_oom(exc):
            raise
        return False
    finally:
        lift_address_space_cap()
        free_cpu_caches()  # the failed attempt's leftovers (and oneDNN's JIT error) go now


def least_headroom(probe: Callable[[], Any], high_bytes: int = 2**30, resolution_bytes: int = 2 * MiB, *,
                   near: int | None = None) -> int | None:
    """The least headroom under which `probe()` runs (bisection, about 9 probes); None when it
    does not even under `high_bytes`. `near`: a need measured before, checked first with two probes
    (it runs there, and not `resolution_bytes` below: the answer), the bisection's bounds where not.
    (Steps up from `near` were tried: each probe that fails there leaves the heap otherwise, and the
    demo's quarter batch then needed more than a margin above `near`: its quick calibration fell
    through to bisecting both sizes, 128 s where 61.)"""
    if not (isinstance(resolution_bytes, int) and 0 < resolution_bytes <= high_bytes):
        raise ValueError(f"least_headroom: resolution_bytes must be an integer between 1 and high_bytes "
                         f"({high_bytes}), got {resolution_bytes!r}")
    low, high = 0, high_bytes
    if near is not None and resolution_bytes < near < high_bytes:
        if runs_under(near, probe):  # then under `high_bytes` too: no probe there (seconds, for the demo's)
            if not runs_under(near - resolution_bytes, probe):
                return near
            high = near - resolution_bytes
        else:
            low = near
            if not runs_under(high_bytes, probe):
                return None
    elif not runs_under(high_bytes, probe):
        return None
    while high - low > resolution_bytes:
        middle = (low + high) // 2
        if runs_under(middle, probe):
            high = middle
        else:
            low = middle
    return high


def calibrate_headroom(probe: Callable[[int], Any], fits: int, fails: int, *, margin_bytes: int = 12 * MiB,
                       extra_bytes: int = 0, fails_extra_bytes: int | None = None,
                       high_bytes: int = 2**30, quick: bool = False) -> Calibration:
    """A cap headroom under which `probe(fits)` runs and `probe(fails)` does not, with
    `margin_bytes` on both sides, measured on this machine with real OOMs (`least_headroom`
    of each, then their middle). `probe(size)`: one forward and backward at micro-batch `size`
    (`StepCore.forward_backward`); `extra_bytes`: what the run adds that the probe does not
    (an optimizer's state, allocated at its first step; with gradient accumulation, the
    gradients held through every micro-batch after the first, where a probe allocates its own
    as backward frees the activations: the demo's ResNet-18 failed at its calibrated size
    until they were counted). `fails_extra_bytes` (default `extra_bytes`): the same for the size
    that must fail, where it differs (a first attempt at the whole batch holds neither: the
    optimizer's state comes at its first step, after backward). Call it after the warm-up the run
    itself makes, and set the cap right after (`cap_address_space(result.headroom_bytes)`).

    `quick`: the size that must fail is probed once, not bisected: it is checked not to run four
    margins above what `fits` needs; `fits` is measured again after that failure, and where it
    needs at most a margin more, the headroom is two margins above that (so at least a margin
    below where `fails` did not run). The demo's whole batch of ResNet-18 takes seconds a probe,
    ten of them to bisect. Where `fails` runs there, or `fits` grew more, both are bisected and
    the headroom is their middle, as without `quick`."""
    fails_extra = extra_bytes if fails_extra_bytes is None else fails_extra_bytes
    if quick:
        first = least_headroom(lambda: probe(fits), high_bytes)
        if first is not None:
            above = first + extra_bytes + 4 * margin_bytes
            if not runs_under(above - fails_extra, lambda: probe(fails)):
                # Measured again after the failure, as the run will need it after its first OOM
                # (a failed probe leaves the heap otherwise: the demo's 128 then needed 24 MiB more).
                # Two bisections of the same need end a step of their grid apart (2 MiB): a quick
                # path that asked for no growth at all fell through to the slow one half the time.
                need_fits = least_headroom(lambda: probe(fits), above, near=first)
                if need_fits is not None and need_fits <= first + margin_bytes:
                    need_fits += extra_bytes
                    headroom = need_fits + 2 * margin_bytes
                    return Calibration(headroom, need_fits, None, f"micro-batch {fits} needs {need_fits / MiB:.0f} "
                                       f"MiB of headroom, {fails} does not run under {above / MiB:.0f} MiB on this "
                                       f"machine: headroom {headroom / MiB:.0f} MiB")
    need_fails = least_headroom(lambda: probe(fails), high_bytes)
    need_fits = least_headroom(lambda: probe(fits), need_fails or high_bytes)
    if need_fits is None:
        return Calibration(None, None, need_fails, f"micro-batch {fits} does not run even under "
                           f"{high_bytes / MiB:.0f} MiB of headroom on this machine")
    if need_fails is None:
        return Calibration(None, need_fits, None, f"micro-batch {fails} runs under any headroom measured "
                           f"({high_bytes / MiB:.0f} MiB): nothing would run out of memory")
    need_fits += extra_bytes
    need_fails += fails_extra
    measured = (f"micro-batch {fits} needs {need_fits / MiB:.0f} MiB of headroom, {fails} needs "
                f"{need_fails / MiB:.0f} MiB on this machine")
    if need_fails - need_fits < 2 * margin_bytes:
        return Calibration(None, need_fits, need_fails, f"{measured}: less apart than twice the margin "
                           f"({2 * margin_bytes / MiB:.0f} MiB), so no cap tells them apart reliably")
    headroom = (need_fits + need_fails) // 2
    return Calibration(headroom, need_fits, need_fails, f"{measured}: headroom {headroom / MiB:.0f} MiB")


def adam_state_bytes(model: torch.nn.Module) -> int:
    """What Adam(W) allocates at its first step: two tensors the size of each parameter (what a
    forward-and-backward probe does not see: `calibrate_headroom`'s `extra_bytes`)."""
    return 2 * sum(p.numel() * p.element_size() for p in model.parameters())


def example_headroom(probe: Callable[[int], Any], batch_size: int, extra_bytes: int = 0) -> int | None:
    """The examples' and the demo's cap: a headroom under which a quarter of the batch fits and
    the whole batch does not, measured on this machine (`calibrate_headroom`). Says what it
    measured on stdout; None (run uncapped) where the two cannot be told apart here."""
    calibration = calibrate_headroom(probe, fits=max(1, batch_size // 4), fails=batch_size, extra_bytes=extra_bytes,
                                     quick=True)
    print(f"memory cap: {calibration}" if calibration.headroom_bytes else f"no memory cap: {calibration}", flush=True)
    return calibration.headroom_bytes
