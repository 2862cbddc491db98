"""oneDNN after an OOM (autotune/memory/onednn.py), with real caps in a subprocess.

On a CPU with native bf16 (AVX512_BF16, AMX) a bf16 matmul of a new shape compiles kernels;
under a cap too tight for their code, the JIT's allocation fails and torch 2.14's oneDNN keeps
that error on the thread: every later kernel fails to build, uncapped too, until it is cleared.
On other CPUs (or ONEDNN_MAX_CPU_ISA below AVX512_CORE_BF16) nothing is compiled per shape and
the tests that need it skip, saying so."""

import pytest

from autotune.memory import onednn
from tests.conftest import run_python

NATIVE_BF16 = bool(onednn.native_bf16())

SCRIPT = r'''
import json, torch
from autotune.memory import onednn
from autotune.memory.limits import cap_address_space, fix_mmap_threshold, lift_address_space_cap, single_malloc_arena
from autotune.monitor.host import virtual_bytes

single_malloc_arena()
fix_mmap_threshold()
weight = torch.randn(256, 256, dtype=torch.bfloat16)

def matmul(rows):
    try:
        (torch.randn(rows, 256, dtype=torch.bfloat16) @ weight).sum()
        return "ok"
    except RuntimeError as exc:
        return str(exc).splitlines()[0][:80]

said = {"warm": matmul(8)}
before = virtual_bytes()
for rows in range(9, 40):  # a new shape each: kernels compiled and kept in oneDNN's cache
    matmul(rows)
said["kept_mib"] = (virtual_bytes() - before) / 2**20
said["flushed"] = onednn.flush_kernel_cache()
said["after_flush_mib"] = (virtual_bytes() - before) / 2**20
capacity = __import__("ctypes").c_int(-1)
onednn._load().get_capacity(__import__("ctypes").byref(capacity))
said["capacity"] = capacity.value
import os
cap_address_space(int(os.environ["HEADROOM"]))  # room for the inputs, not for a new kernel's code
said["capped"] = matmul(41)
lift_address_space_cap()
said["uncapped_before_clearing"] = matmul(42)
said["cleared"] = onednn.clear_jit_error()
said["uncapped_after_clearing"] = matmul(43)
save(said)
'''


def test_the_functions_are_found_in_this_torch():
    # Not a CPU matter: the symbols are in libtorch_cpu.so wherever torch 2.14's oneDNN is.
    from autotune.memory import onednn

    assert onednn._load() is not None
    assert onednn.flush_kernel_cache() is True
    assert onednn.clear_jit_error() is True


@pytest.mark.skipif(not NATIVE_BF16, reason="oneDNN compiles per-shape kernels on CPUs with native bf16 only "
                                            "(avx512_bf16 or amx_bf16, ONEDNN_MAX_CPU_ISA not below it)")
def test_after_a_refused_kernel_the_thread_builds_kernels_again_once_cleared(tmp_path):
    # Where under the cap the refusal falls decides what it does: on the JIT's code (a clean error,
    # the case here), on an allocation oneDNN does not check (a crash: the README says so), or on
    # nothing (it fits). A few headrooms, each in its own interpreter, until the JIT's comes up.
    tried = {}
    for headroom in (64, 128, 192, 320, 448, 576, 768):
        proc, said = run_python(SCRIPT, tmp_path, timeout=120, env={"HEADROOM": str(headroom * 1024)})
        tried[headroom] = said["capped"] if said else f"exit {proc.returncode}"
        if said and said["capped"] == "could not create a primitive":
            break
    else:
        pytest.skip(f"no headroom refused only the JIT's code on this CPU/ISA (KiB: outcome): {tried}")
    assert said["warm"] == "ok"
    assert said["kept_mib"] > 8, said  # ~1 MiB of kernels a shape, kept
    assert said["flushed"] and said["after_flush_mib"] < said["kept_mib"] / 2, said  # 24 of 32 MiB back, here
    assert said["capacity"] == 1024  # oneDNN's default, put back after the flush
    # The bug worked around: the error outlives the cap on this thread, until cleared.
    assert said["uncapped_before_clearing"] == "could not create a primitive", said
    assert said["cleared"] and said["uncapped_after_clearing"] == "ok", said


def test_bf16_kernels_under_a_hard_cap_are_told_only_where_torch_sends_bf16_to_onednn(monkeypatch):
    # Issue 48: on an AMX Xeon under RLIMIT_AS the autocast relief's first step died of SIGSEGV inside
    # oneDNN; the relief is skipped where that can happen (tuning/relief_ladder.py), tried everywhere else.
    # Issue 56: "where" is where torch sends bf16 to oneDNN, not native bf16: under
    # ONEDNN_MAX_CPU_ISA=AVX512_CORE the native-bf16 matmul's descriptor is still allocated (before its
    # ISA is checked) and the same crash came (tests/memory/test_kernel_room.py's sweep, run with it).
    import resource

    from autotune.memory.onednn import builds_bf16_kernels_under_a_hard_cap as unsafe

    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    capped = (1 << 33, resource.RLIM_INFINITY)
    monkeypatch.setattr(resource, "getrlimit", lambda which: capped)
    monkeypatch.setattr(onednn, "runs_on_onednn", lambda dtype: True)
    assert "native bf16 (amx_bf16)" in unsafe({"avx2", "amx_bf16"})
    assert "avx512_bf16" in unsafe({"avx512f", "avx512_bf16"})
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX512_CORE")  # below native bf16, and bf16 still on oneDNN
    assert "torch runs bf16 on oneDNN here (ONEDNN_MAX_CPU_ISA=AVX512_CORE)" in unsafe({"avx512f", "avx512_bf16"})
    monkeypatch.setattr(onednn, "runs_on_onednn", lambda dtype: False)  # AVX2, SSE41, oneDNN off: torch's own
    assert unsafe({"amx_bf16"}) is None
    monkeypatch.setattr(onednn, "runs_on_onednn", lambda dtype: True)
    monkeypatch.setattr(resource, "getrlimit", lambda which: (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    assert unsafe({"amx_bf16"}) is None  # no cap to refuse a mapping


def test_where_torch_sends_bf16_is_its_own_answer_while_onednn_is_on(monkeypatch):
    import torch

    if not torch.backends.mkldnn.is_available():
        pytest.skip("this torch has no oneDNN")
    asked = onednn.runs_on_onednn(torch.bfloat16)
    assert asked == bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    monkeypatch.setattr(torch.backends.mkldnn, "enabled", False)
    assert onednn.runs_on_onednn(torch.bfloat16) is False  # torch's own kernels
    assert onednn.runs_on_onednn(torch.float32) is False  # fp32 products are MKL's
