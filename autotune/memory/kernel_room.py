"""Room for oneDNN's kernels under an address-space cap: an OOM raised where a crash would come.

oneDNN does not check every allocation it makes while it builds the kernels for a shape: the
descriptor of a bf16 matmul (252 KiB, one for each implementation it tries, allocated before that
implementation's ISA is checked) is written through when `malloc` returns NULL, a SIGSEGV in
`matmul_pd_t`'s constructor that no Python catches. Under RLIMIT_AS that happens when the cap's
last room goes to the op's output just before: after an OOM, the retry at a new micro-batch size
is a new shape for every matmul of the model, built near the cap (the HF example died so in 3 of
17 runs on an AMX Xeon, and in 3 of 44 on an AVX512_BF16 Xeon, each after OOMs at 32, 11, 8, 7, 6;
a bf16 Linear stack retried at 16, 12, 8, 7, 6, 5 with the cap stepped up 64 KiB at a time dies at
the first 5, every time, there and under ONEDNN_MAX_CPU_ISA=AVX512_CORE alike: tests/memory/test_kernel_room.py).

`KernelRoom`, a TorchDispatchMode the step core enters around forward and backward where a cap, a
low-precision dtype and oneDNN meet (`guard`; the dtypes: the autocast's, the parameters', and until
an attempt has run under the check every low-precision one, noting those the products run in, for a
step that autocasts on its own as HF's bf16=True and Lightning's bf16-mixed do), checks before each
op torch may send to oneDNN (matmuls, convolutions, CPU flash attention) on such a dtype that the
cap leaves room for what the op allocates: its output, a copy of an operand that no matrix product
can read in place, and `RESERVE_BYTES` for oneDNN's own (what a matmul of a new shape kept here:
1.0-2.0 MiB of descriptors and kernels). The check reads the virtual size (/proc/self/statm, what
RLIMIT_AS binds) against the cap; where the room is not there, the op does not run and a
`torch.OutOfMemoryError` says why; the retry catches it as any OOM. Nothing else allocates on the
thread in between, so what oneDNN allocates inside the op finds the room the check found. (A check
that maps the room and unmaps it, as a first version did, raises the process's lifetime peak,
VmPeak, which the step's demand is measured by: the policies then saw steps bigger than they were.)
With the check, the Linear stack stepped from 0 to 40 MiB ran out of memory in 3,326 attempts of
3,846 and crashed in none.

Cost: the mode sees every op of the step (12-19 us each, in Python): the HF example's model took
14.3 ms a micro-batch of 1 instead of 9.8, 51.6 ms one of 8 instead of 44.7 (366 ops;
benchmarks/bf16_under_cap.py). Nothing is entered without a cap or on another device; for an fp32
step, only its first attempt.

Owns: that check, and when it is made. Touches nothing: it raises before an op or lets it run.
"""

from __future__ import annotations

import contextlib
import math
import mmap
import os
import resource
import time
from typing import Any, Iterable

import torch
from loguru import logger
from torch.utils._python_dispatch import TorchDispatchMode

from autotune.common.units import format_bytes
from autotune.memory import limits
from autotune.memory.onednn import runs_on_onednn
from autotune.monitor.host import rlimit_as_bytes

RESERVE_BYTES = 4 * 2**20  # twice the most a matmul of a new shape kept here (2.0 MiB, its transposed backward)
LOW_PRECISION = (torch.bfloat16, torch.float16)
LOW_PRECISION_SET = frozenset(LOW_PRECISION)
_aten = torch.ops.aten
# Matrix products (cpublas::gemm, oneDNN for bf16/fp16): where their two matrices are in the arguments.
_PRODUCTS = {_aten.mm: (0, 1), _aten.bmm: (0, 1), _aten.addmm: (1, 2), _aten._addmm_activation: (1, 2),
             _aten.baddbmm: (1, 2), _aten.addbmm: (1, 2)}
# Others oneDNN runs for these dtypes (a linear is seen as its product where it is decomposed first).
_OTHERS = {_aten.linear, _aten.convolution, _aten.convolution_backward,
           _aten._scaled_dot_product_flash_attention_for_cpu,
           _aten._scaled_dot_product_flash_attention_for_cpu_backward}
NOTHING = contextlib.nullcontext()  # the context of a step with nothing to check
_said = False


def warm() -> None:
    """Before a cap is likely set: ask torch once which of the low-precision dtypes it sends to
    oneDNN (`guard` then only reads it), and where one is, open /proc/self/statm and run an op
    under the mode once (its lazy imports)."""
    global _statm
    answers = [runs_on_onednn(dtype) for dtype in LOW_PRECISION]  # each asked, none skipped
    if not any(answers):
        return  # no check will be made here
    if _statm is None:
        try:
            _statm = os.open("/proc/self/statm", os.O_RDONLY)
        except OSError:
            _statm = None
    # A dispatch mode's first op imports torch._dynamo (1.5 s, 263 MiB of address space here): under a
    # tight cap that import fails ("failed to map segment"), which no retry can take for an OOM.
    with KernelRoom(frozenset(LOW_PRECISION), resource.RLIM_INFINITY):
        torch.zeros(1).add_(1)


def address_space_cap(device: torch.device) -> int | None:
    """The soft RLIMIT_AS a step on `device` runs under: None on another device or without one. A
    system call: in this project's VM one cost a ~1 ms step about 10 us, where it takes 0.3 us in a
    loop of its own. A step reads it through `CapReader`."""
    return rlimit_as_bytes() if device.type == "cpu" else None


REREAD_SECONDS = 1.0  # how old a step's figure of a cap set by a bare resource.setrlimit may be


class CapReader:
    """`address_space_cap` for the step core: read again once `REREAD_SECONDS` have passed, and at
    once after autotune's own `cap_address_space` or `lift_address_space_cap` (memory/limits.py),
    never more than once a second otherwise. A cap rarely changes during a run and a steady step
    cannot afford the system call (once an attempt it was ~1% of a ~1 ms step: 1.107-1.115 of a plain
    step against 1.091-1.095 before the check, benchmarks/results/steady_step_issue57.md); the clock
    read instead is the vDSO's, no system call. A cap the user's own code sets with
    resource.setrlimit between steps is seen by the steps that start a second later."""

    def __init__(self, device: torch.device):
        self.device = device
        self._cap: int | None = None
        self._read_at = -math.inf
        self._changes = -1  # limits.cap_changes when it was read

    def cap(self) -> int | None:
        now = time.monotonic()
        if now - self._read_at >= REREAD_SECONDS or self._changes != limits.cap_changes:
            self._cap, self._read_at, self._changes = address_space_cap(self.device), now, limits.cap_changes
        return self._cap


def guard(dtypes: Iterable[torch.dtype], cap: int | None,
          noted: set[torch.dtype] | None = None) -> contextlib.AbstractContextManager[Any]:
    """`KernelRoom` where a step with `dtypes` (its autocast's, its parameters', or every low-precision
    one while it is not known) would have oneDNN build kernels under the address-space cap `cap`
    (`CapReader`'s); a context that does nothing elsewhere. `noted`: where the mode adds the
    dtypes it checks products in."""
    global _said
    if cap is None:
        return NOTHING
    guarded = frozenset(d for d in dtypes if d in LOW_PRECISION and runs_on_onednn(d))
    if not guarded:
        return NOTHING
    if not _said:
        _said = True
        logger.debug(f"kernel room: {', '.join(str(d) for d in sorted(guarded, key=str))} on oneDNN under RLIMIT_AS: "
                     f"each product checked for its output and {format_bytes(RESERVE_BYTES)} of room first")
    return KernelRoom(guarded, cap, noted)


class KernelRoom(TorchDispatchMode):
    """Before each op oneDNN may build kernels for, on a tensor of `dtypes`, the room under the cap
    for its output, its copies and oneDNN's allocations (`needed_bytes`), or a
    `torch.OutOfMemoryError` instead of the op (module docstring)."""

    def __init__(self, dtypes: frozenset[torch.dtype], cap: int, noted: set[torch.dtype] | None = None):
        super().__init__()
        self.dtypes, self.cap, self.noted = dtypes, cap, noted

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        packet = func.overloadpacket
        if packet in _PRODUCTS or packet in _OTHERS:
            tensors = [a for a in args if isinstance(a, torch.Tensor)]
            if any(t.dtype in self.dtypes and t.device.type == "cpu" for t in tensors):
                if self.noted is not None:
                    self.noted.update(t.dtype for t in tensors if t.dtype in self.dtypes)
                need = needed_bytes(packet, args, tensors)
                if not room_for(need, self.cap):
                    shapes = " x ".join(str(list(t.shape)) for t in tensors)
                    raise torch.OutOfMemoryError(
                        f"out of memory: less than {format_bytes(need)} of room under the RLIMIT_AS cap for {packet} "
                        f"on {shapes} ({tensors[0].dtype}): its output and the kernels oneDNN builds for it, some "
                        "of whose allocations oneDNN does not check (refused, they crash the process: "
                        "autotune/memory/kernel_room.py)")
        return func(*args, **(kwargs or {}))


def needed_bytes(packet: Any, args: tuple, tensors: list[torch.Tensor]) -> int:
    """What an op may allocate before and while oneDNN builds its kernels: its output, a copy of
    each operand a matrix product cannot read in place (neither of its last two dims of stride 1),
    and `RESERVE_BYTES`."""
    size = max(t.element_size() for t in tensors)
    if packet in _PRODUCTS:
        i, j = _PRODUCTS[packet]
        a, b = args[i], args[j]
        rows = a.shape[-2] if packet is _aten.addbmm else a.shape[:-1].numel()
        output = rows * b.shape[-1] * size
    elif packet is _aten.linear:
        output = args[0].shape[:-1].numel() * args[1].shape[0] * size
    elif packet is _aten.convolution:
        output = _convolution_output(*args[:9]) * size
    else:  # a convolution's or attention's gradients, attention's output: their operands' sizes
        output = sum(t.numel() for t in tensors) * size
    copies = sum(t.numel() * t.element_size() for t in tensors if t.dim() >= 2 and 1 not in t.stride()[-2:])
    return output + copies + RESERVE_BYTES


def _convolution_output(input: torch.Tensor, weight: torch.Tensor, bias: Any, stride: list[int], padding: list[int],
                        dilation: list[int], transposed: bool, output_padding: list[int], groups: int) -> int:
    # torch's own formula (aten/src/ATen/native/ConvUtils.h), in elements.
    elements = input.shape[0] * (weight.shape[1] * groups if transposed else weight.shape[0])
    for d, size in enumerate(input.shape[2:]):
        kernel = dilation[d] * (weight.shape[2 + d] - 1) + 1
        if transposed:
            elements *= (size - 1) * stride[d] - 2 * padding[d] + kernel + output_padding[d]
        else:
            elements *= (size + 2 * padding[d] - kernel) // stride[d] + 1
    return max(elements, 0)


_statm: int | None = None  # /proc/self/statm, opened once (`warm`); None: not there, mapped and unmapped instead


def room_for(nbytes: int, cap: int) -> bool:
    """Whether `nbytes` more of address space fit under `cap` (RLIMIT_AS's soft limit) now: the
    virtual size read from /proc/self/statm; where it cannot be, `nbytes` mapped unreadable and
    unmapped at once (False where the cap refuses it)."""
    if cap == resource.RLIM_INFINITY:
        return True
    if _statm is not None:
        try:  # the first field: the virtual size in pages, the total RLIMIT_AS is checked against
            return int(os.pread(_statm, 64, 0).split(b" ", 1)[0]) * _PAGE + nbytes <= cap
        except (OSError, ValueError, MemoryError):
            pass
    try:
        mapping = mmap.mmap(-1, max(int(nbytes), 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, prot=mmap.PROT_READ)
    except (OSError, MemoryError):  # ENOMEM: the cap refused it (MemoryError: not even the object)
        return False
    mapping.close()
    return True


_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
