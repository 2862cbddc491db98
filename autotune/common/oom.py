"""Recognise out-of-memory errors, and the error autotune raises when it cannot recover.

PyTorch reports running out of memory in several ways depending on the device and the
kernel that hit it. `torch.OutOfMemoryError` covers the CUDA caching allocator; the
rest arrive as plain `RuntimeError`s whose message is the only clue.

Owns: what counts as an out-of-memory error, and autotune's errors. Touches nothing.
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
    "std::bad_alloc",  # a C++ allocation that failed, passed on as a RuntimeError (or MemoryError)
    "could not create a primitive",  # oneDNN (mkldnn) convolution under memory pressure
    "could not execute a primitive",  # oneDNN, when its scratchpad cannot be allocated
    "hip out of memory",  # ROCm
    "mps backend out of memory",  # Apple
)


_CHAIN_DEPTH = 8  # wrapped errors seen in practice are one or two deep (torch.compile: InternalTorchDynamoError)
_NOT_SUPPORTED = "cudnn_status_not_supported"


def _chain(exc: BaseException) -> list[BaseException]:
    """`exc` and the errors it wraps (`__cause__`, else `__context__`), at most `_CHAIN_DEPTH`, no cycles."""
    found: list[BaseException] = []
    while exc is not None and len(found) < _CHAIN_DEPTH and all(exc is not seen for seen in found):
        found.append(exc)
        exc = exc.__cause__ or exc.__context__
    return found


def _is_oom_itself(exc: BaseException) -> bool:
    if isinstance(exc, (_TORCH_OOM, MemoryError)):
        return True
    if not isinstance(exc, RuntimeError):
        return False
    message = str(exc).lower()
    return any(fragment in message for fragment in OOM_MESSAGES)


def is_oom(exc: BaseException) -> bool:
    """True when `exc` means the device (or host) ran out of memory.

    `torch.OutOfMemoryError` and `MemoryError` count; then the known messages of CUDA,
    cuDNN, cuBLAS, the CPU allocator and oneDNN. An error that wraps one of these counts
    too (its `__cause__`/`__context__` chain is followed a few links deep): torch.compile
    reports a failed allocation as `InternalTorchDynamoError` caused by `MemoryError`.
    Anything else is not an OOM and must be re-raised untouched by the caller.
    """
    if isinstance(exc, (OutOfMemory, ExchangeFailed)):  # autotune already gave up: let it through
        return False
    return any(_is_oom_itself(link) for link in _chain(exc))


def maybe_not_memory(exc: BaseException) -> bool:
    """An OOM-like error that may not be about memory at all: cuDNN's NOT_SUPPORTED is raised
    both when no algorithm's workspace fits and for inputs it cannot handle at any size. Worth
    halving for; at the smallest size it is re-raised as it is, not answered with reliefs."""
    return any(_NOT_SUPPORTED in str(link).lower() for link in _chain(exc))


def oom_message(exc: BaseException) -> str:
    """The first line of the error (300 characters at most), or its type when it has no message
    (`MemoryError()` has none)."""
    text = str(exc).strip()
    return text.splitlines()[0][:300] if text else type(exc).__name__


class OutOfMemory(RuntimeError):
    """Training ran out of memory even at the smallest micro-batch the policies allow.

    The message names the device, the micro-batch sizes tried and the memory figures
    at the time, so a user can tell whether the model itself does not fit.
    """


class ExchangeFailed(RuntimeError):
    """An FSDP2 exchange or autotune's check failed or timed out after the ranks had met there
    (sharded.py): the ranks can no longer pair their exchanges, so the job stops on every rank
    with this error, naming the exchange and the step. Never retried, even when what failed
    inside the exchange was an allocation."""


class NonFiniteStep(RuntimeError):
    """A batch's gradients were not finite (NaN or inf) and `on_nonfinite="stop"`: the run stops
    before the optimizer step, with the weights of the last finite step (checkpointed first by
    AutoTrainer). The message names the step; AutoTrainer's note names the batch's samples."""


class TooManyNonFiniteSteps(NonFiniteStep):
    """`max_nonfinite_steps` optimizer steps in a row were skipped on NaN or inf gradients (a bad
    init, a broken data transform, a learning rate that diverged): the run trains nothing, so it
    stops, a permanent failure (a restart from the same state meets the same NaN). The weights are
    those of the last finite step (a skipped step never changes them), checkpointed first; the
    message names the count, the step and the checkpoint."""


class UnsafePruning(Exception):
    """Pruning would break the model (e.g. a residual stream that starts at the raw input), or
    cannot apply to it (a model sharded with FSDP2); nothing was pruned."""
