"""Recognise out-of-memory errors, and the error autotune raises when it cannot recover.

PyTorch reports running out of memory in several ways depending on the device and the
kernel that hit it. `torch.OutOfMemoryError` covers the CUDA caching allocator; the
rest arrive as plain `RuntimeError`s whose message is the only clue.
"""

from __future__ import annotations

import torch

# torch.OutOfMemoryError is the public name since torch 2.5; torch.cuda's is older.
_TORCH_OOM = getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)

# Lower-case fragments of the messages seen when memory runs out. Matching is done on
# the lower-cased message, so keep these lower-case.
OOM_MESSAGES: tuple[str, ...] = (
    "cuda out of memory",  # CUDA caching allocator (older torch raised RuntimeError)
    "cuda error: out of memory",  # a CUDA API call itself failed to allocate
    "cudnn_status_not_supported",  # cuDNN picks no algorithm when workspace cannot be had
    "cudnn error: cudnn_status_alloc_failed",
    "cublas_status_alloc_failed",
    "defaultcpuallocator: can't allocate memory",  # CPU allocator under RLIMIT_AS / cgroup
    "posix_memalign failed",  # CPU allocator, another code path
    "could not create a primitive",  # oneDNN (mkldnn) convolution under memory pressure
    "hip out of memory",  # ROCm
    "mps backend out of memory",  # Apple
)


def is_oom(exc: BaseException) -> bool:
    """True when `exc` means the device (or host) ran out of memory.

    `torch.OutOfMemoryError` is checked first; then the known messages of CUDA, cuDNN,
    cuBLAS, the CPU allocator and oneDNN. `MemoryError` (Python objects) counts too.
    Anything else is not an OOM and must be re-raised untouched by the caller.
    """
    if isinstance(exc, OutOfMemory):  # autotune already gave up: let it through
        return False
    if isinstance(exc, (_TORCH_OOM, MemoryError)):
        return True
    if not isinstance(exc, RuntimeError):
        return False
    message = str(exc).lower()
    return any(fragment in message for fragment in OOM_MESSAGES)


class OutOfMemory(RuntimeError):
    """Training ran out of memory even at the smallest micro-batch the policies allow.

    The message names the device, the micro-batch sizes tried and the memory figures
    at the time, so a user can tell whether the model itself does not fit.
    """
