import torch

from autotune.oom import OutOfMemory, is_oom
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
        from autotune.limits import cap_address_space
        from autotune.oom import is_oom
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
