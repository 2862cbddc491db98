import torch

from autotune.common.oom import OutOfMemory, is_oom
from tests.conftest import run_python


def test_torch_oom_error_and_memory_error_are_oom():
    assert is_oom(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert is_oom(MemoryError())


def test_known_messages_are_oom():
    messages = [
        "CUDA out of memory. Tried to allocate 20.00 MiB",
        "CUDA error: out of memory\nCUDA kernel errors might be asynchronously reported",
        "cuDNN error: CUDNN_STATUS_NOT_SUPPORTED. This error may appear if you passed in a non-contiguous input.",
        "[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate memory: "
        "you tried to allocate 67108864 bytes. Error code 12 (Cannot allocate memory)",
        "posix_memalign failed:Cannot allocate memory (12)",
        "could not create a primitive",
    ]
    for message in messages:
        assert is_oom(RuntimeError(message)), message


def test_other_errors_are_not_oom():
    assert not is_oom(RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x3 and 5x6)"))
    assert not is_oom(ValueError("CUDA out of memory"))  # only RuntimeError carries these messages
    assert not is_oom(KeyError("x"))
    # autotune's own give-up error must never be caught as a recoverable OOM
    assert not is_oom(OutOfMemory("out of memory on cuda:0 even at micro-batch 1"))


def test_a_real_cpu_oom_is_recognised(tmp_path):
    proc, result = run_python("""
        import torch
        from autotune.memory.limits import cap_address_space
        from autotune.common.oom import is_oom
        cap_address_space(64 * 2**20)
        try:
            torch.empty(2**31, dtype=torch.uint8).fill_(1)
            save({"raised": False})
        except Exception as exc:
            save({"raised": True, "type": type(exc).__name__, "oom": is_oom(exc), "message": str(exc)})
    """, tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert result["raised"] and result["oom"], result
    assert "can't allocate memory" in result["message"]


def _raised(error: BaseException, cause: BaseException | None = None) -> BaseException:
    # A real raise, so __cause__ / __context__ are set by Python as they are in the wild.
    try:
        if cause is None:
            raise error
        try:
            raise cause
        except BaseException as inner:
            raise error from inner
    except BaseException as caught:
        return caught


def test_an_oom_wrapped_by_torch_compile_is_oom():
    from torch._dynamo.exc import InternalTorchDynamoError

    wrapped = _raised(InternalTorchDynamoError("MemoryError: std::bad_alloc"), MemoryError("std::bad_alloc"))
    assert is_oom(wrapped)
    # also when the wrapper only carries it as context (raised while handling it)
    try:
        try:
            raise torch.OutOfMemoryError("CUDA out of memory")
        except torch.OutOfMemoryError:
            raise RuntimeError("backend compiler failed")
    except RuntimeError as exc:
        assert is_oom(exc)
    assert not is_oom(_raised(InternalTorchDynamoError("guard failure"), KeyError("x")))


def test_the_chain_is_followed_a_bounded_way_and_cycles_end():
    error = MemoryError()
    for _ in range(20):  # deeper than anything real: not followed all the way
        error = _raised(ValueError("wrapped"), error)
    assert not is_oom(error)
    a, b = ValueError("a"), ValueError("b")
    a.__cause__, b.__cause__ = b, a
    assert not is_oom(a)  # a cycle ends the walk


def test_a_cpp_bad_alloc_is_oom_and_an_empty_message_has_a_name():
    from autotune.common.oom import oom_message

    assert is_oom(RuntimeError("std::bad_alloc"))
    assert oom_message(MemoryError()) == "MemoryError"
    assert oom_message(RuntimeError("CUDA out of memory.\nmore")) == "CUDA out of memory."


def test_cudnn_not_supported_may_not_be_memory():
    from autotune.common.oom import maybe_not_memory

    error = RuntimeError("cuDNN error: CUDNN_STATUS_NOT_SUPPORTED. This error may appear if you passed in a "
                         "non-contiguous input.")
    assert is_oom(error) and maybe_not_memory(error)
    assert not maybe_not_memory(RuntimeError("CUDA out of memory"))
