"""oneDNN on CPU after an OOM, behind one small module: its JIT's error cleared, its kernel cache emptied.

**The JIT's error.** oneDNN compiles its kernels with Xbyak, built without exceptions: a failed
allocation of a kernel's code (the cap refusing its mapping) sets an error code that Xbyak keeps
*per thread* until someone clears it, and torch 2.14's oneDNN never does (oneDNN fixed it in
pull request 5907, August 2026). From then on every kernel that thread compiles fails, "could not
create a primitive" at any micro-batch, uncapped too: the run ends "even at micro-batch 1".
`clear_jit_error()` clears it on the calling thread, the one that runs forward and backward.

**The kernel cache.** On a CPU with native bf16 (AVX512_BF16, AMX), oneDNN compiles kernels for every shape it meets
(bf16 matmuls, convolutions) and keeps them in its primitive cache, 1024 of them by default:
each new micro-batch size keeps ~20-35 MiB of compiled code and buffers mapped for good. Under a
memory cap (RLIMIT_AS, a cgroup) the sizes an OOM made autotune try add up until nothing fits,
not even a micro-batch of 1 ("could not create a primitive"; a failed mapping inside the JIT
can also crash the process). Emptying the cache when the micro-batch changes, as
`torch.cuda.empty_cache()` does for CUDA's cache, returns the kernels of the old sizes; the
ones still needed are compiled again at the next step (milliseconds).

torch exports neither `dnnl_set_primitive_cache_capacity` nor Xbyak's error, but libtorch_cpu.so
keeps its symbol table: their addresses are read from it once, on first use (~0.1 s, in 1 MiB
pieces). Anything unexpected (another layout, a stripped library, no oneDNN, a value that is no
error code) means "not available": nothing is called or written, and the functions return False.
Setting ONEDNN_PRIMITIVE_CACHE_CAPACITY before torch starts bounds the cache without this.

**Where torch sends bf16 and fp16.** `runs_on_onednn` is torch's own answer (which follows the ISA oneDNN
started with), not the CPU's native bf16: the autocast relief's skip and `kernel_room.py` ask it.

Owns: oneDNN's primitive cache capacity, where it can be set, and where torch sends a dtype to oneDNN.
Touches nothing else.
"""

from __future__ import annotations

import ctypes
import dataclasses
import os
import struct
from typing import Any, BinaryIO, Callable

from loguru import logger

_CHUNK = 1 << 20
_SET, _GET = b"dnnl_set_primitive_cache_capacity", b"dnnl_get_primitive_cache_capacity"
_JIT_ERROR = b"_ZZN5Xbyak5local11GetErrorRefEvE3err"  # Xbyak::local::GetErrorRef()::err, thread-local
_STT_FUNC, _STT_TLS = 2, 6
_RTLD_DI_TLS_DATA = 10  # dlinfo(): this thread's block of a library's thread-local variables


@dataclasses.dataclass
class _OneDNN:
    set_capacity: Callable[[int], int]
    get_capacity: Callable[[Any], int]
    library: ctypes.CDLL
    jit_error_offset: int | None  # in the library's thread-local block
    dlinfo: Callable[..., int] | None  # glibc's (in libc since 2.34, libdl before: both in the global scope)


_found: _OneDNN | None | bool = None  # None: not looked up yet; False: not available


def available() -> bool:
    """Whether oneDNN's functions were found in this torch (looked up once, ~0.1 s, on first use)."""
    return _load() is not None


def clear_jit_error() -> bool:
    """Clear Xbyak's error on this thread (module docstring); False where that is not available."""
    found = _load()
    if not found or found.jit_error_offset is None or found.dlinfo is None:
        return False
    block = ctypes.c_void_p()
    if found.dlinfo(ctypes.c_void_p(found.library._handle), _RTLD_DI_TLS_DATA, ctypes.byref(block)) != 0:
        return False
    if not block.value:
        return True  # this thread never touched the library's thread-locals: nothing is set
    error = ctypes.c_int.from_address(block.value + found.jit_error_offset)
    if not 0 <= error.value < 1000:  # Xbyak's codes are small: anything else is not it
        return False
    error.value = 0
    return True


def flush_kernel_cache() -> bool:
    """Empty oneDNN's primitive cache (its capacity is kept); False where that is not available."""
    found = _load()
    if not found:
        return False
    set_capacity, get_capacity = found.set_capacity, found.get_capacity
    capacity = ctypes.c_int(-1)
    if get_capacity(ctypes.byref(capacity)) != 0 or capacity.value < 0:
        return False
    # Setting a capacity evicts what is over it: 0 evicts everything, then the old one is back.
    return set_capacity(0) == 0 and set_capacity(capacity.value) == 0


# oneDNN ISAs below native bf16 (ONEDNN_MAX_CPU_ISA): with one of them no bf16 kernel is compiled per shape.
_BELOW_NATIVE_BF16 = ("SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2", "AVX512_CORE", "AVX512_CORE_VNNI")


def native_bf16(cpu_flags: set[str] | None = None) -> list[str]:
    """This CPU's native bf16 features (avx512_bf16, amx_bf16) that oneDNN may use: none where
    ONEDNN_MAX_CPU_ISA holds it below them. `cpu_flags`: /proc/cpuinfo's, read when None."""
    if os.environ.get("ONEDNN_MAX_CPU_ISA", "ALL").upper() in _BELOW_NATIVE_BF16:
        return []
    if cpu_flags is None:
        try:
            with open("/proc/cpuinfo") as f:
                cpu_flags = set(f.read().split())
        except OSError:
            return []
    return sorted(cpu_flags & {"avx512_bf16", "amx_bf16"})


_on_onednn: dict[Any, bool] = {}  # dtype: torch's answer, fixed once oneDNN has read its ISA


def runs_on_onednn(dtype: Any) -> bool:
    """Whether torch sends CPU matmuls and convolutions of `dtype` (bf16, fp16) to oneDNN here:
    oneDNN on, and torch's own test (`torch.ops.mkldnn._is_mkldnn_bf16_supported`), which follows
    the ISA oneDNN started with. That is not native bf16: an AVX-512 CPU without it, or
    ONEDNN_MAX_CPU_ISA=AVX512_CORE, sends bf16 there too, and oneDNN allocates the descriptor of its
    native-bf16 matmul before checking the ISA (a crash under a cap in `matmul_pd_t`, measured with
    AVX512_CORE). Where torch cannot say, assumed so."""
    import torch

    if not (torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled):
        return False
    if dtype not in _on_onednn:
        name = {torch.bfloat16: "_is_mkldnn_bf16_supported", torch.float16: "_is_mkldnn_fp16_supported"}.get(dtype)
        if name is None:
            return False
        try:
            _on_onednn[dtype] = bool(getattr(torch.ops.mkldnn, name)())
        except (AttributeError, RuntimeError):
            _on_onednn[dtype] = True
    return _on_onednn[dtype]


def under_an_address_space_cap() -> bool:
    """Whether RLIMIT_AS caps this process (its soft limit: what refuses a mapping)."""
    from autotune.monitor.host import rlimit_as_bytes

    return rlimit_as_bytes() is not None


def builds_bf16_kernels_under_a_hard_cap(cpu_flags: set[str] | None = None) -> str | None:
    """Why bf16 autocast on this CPU would build oneDNN kernels under an address-space cap, where
    an allocation oneDNN does not check can kill the process (a signal no Python catches:
    docs/memory-caps.md); None where it would not: no RLIMIT_AS, or torch keeps bf16 off oneDNN
    (`runs_on_onednn`). The autocast relief is skipped, with that word. `cpu_flags`: for the word
    (/proc/cpuinfo's, read when None)."""
    import torch

    if not under_an_address_space_cap() or not runs_on_onednn(torch.bfloat16):
        return None
    native = native_bf16(cpu_flags)
    why = (f"this CPU has native bf16 ({', '.join(native)}), so" if native
           else f"torch runs bf16 on oneDNN here (ONEDNN_MAX_CPU_ISA={os.environ.get('ONEDNN_MAX_CPU_ISA', 'ALL')}), so")
    return (f"{why} oneDNN would compile bf16 kernels under the RLIMIT_AS cap, where a refused allocation it "
            "does not check kills the process")


def _load() -> _OneDNN | None:
    global _found
    if _found is None:
        try:
            _found = _find() or False
        except MemoryError:
            return None  # under the cap right now: tried again next time
        except (OSError, ValueError, struct.error) as exc:
            logger.debug(f"oneDNN's state cannot be reset here: {exc}")
            _found = False
    return _found or None


def _find() -> _OneDNN | None:
    import torch  # the library is torch's own; importing torch first maps it

    path = os.path.realpath(os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so"))
    base, executable = _mapped(path)
    if base is None:
        return None
    with open(path, "rb") as f:
        values = _symbols(f, {_SET: _STT_FUNC, _GET: _STT_FUNC, _JIT_ERROR: _STT_TLS})
    if values is None or values[_SET] is None or values[_GET] is None:
        return None
    addresses = [base + values[name] for name in (_SET, _GET)]
    # Call only what lies in the library's own code, mapped executable.
    if not all(any(start <= a < end for start, end in executable) for a in addresses):
        return None
    set_capacity = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_int)(addresses[0])
    get_capacity = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_int))(addresses[1])
    dlinfo = getattr(ctypes.CDLL(None), "dlinfo", None)
    return _OneDNN(set_capacity, get_capacity, ctypes.CDLL(path), values[_JIT_ERROR], dlinfo)


def _mapped(path: str) -> tuple[int | None, list[tuple[int, int]]]:
    """Where `path` is loaded in this process (the address of file offset 0) and its executable ranges."""
    base, executable = None, []
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            if len(fields) < 6 or fields[5].strip() != path:
                continue
            start, end = (int(x, 16) for x in fields[0].split("-"))
            if int(fields[2], 16) == 0 and base is None:
                base = start
            if "x" in fields[1]:
                executable.append((start, end))
    return base, executable


def _symbols(f: BinaryIO, names: dict[bytes, int]) -> dict[bytes, int | None] | None:
    """The values in an ELF64 file's .symtab of `names` (name: symbol type): a function's is its
    offset from the load address, a thread-local's its offset in the thread-local block; None
    for a name not there, or of another type."""
    header = f.read(64)
    if header[:4] != b"\x7fELF" or header[4] != 2 or header[5] != 1:  # 64-bit, little-endian
        return None
    phoff, shoff = struct.unpack_from("<QQ", header, 32)
    phentsize, phnum, shentsize, shnum = struct.unpack_from("<HHHH", header, 54)
    f.seek(phoff)
    loads = [struct.unpack_from("<IIQQ", f.read(phentsize)) for _ in range(phnum)]
    # The lowest PT_LOAD holds file offset 0, which is where the library's mapping starts.
    first_load = min(((vaddr, vaddr - offset) for kind, _, offset, vaddr in loads if kind == 1), default=(0, None))[1]
    f.seek(shoff)
    sections = [struct.unpack_from("<IIQQQQI", f.read(shentsize)) for _ in range(shnum)]
    symtab = next((s for s in sections if s[1] == 2), None)  # SHT_SYMTAB
    if symtab is None or first_load is None:
        return None  # stripped
    strtab = sections[symtab[6]]
    values: dict[bytes, int | None] = dict.fromkeys(names)
    offsets = _find_each(f, strtab[4], strtab[5], {name: b"\0" + name + b"\0" for name in names}, 1)
    entries = _find_each(f, symtab[4], symtab[5], {name: struct.pack("<I", at + 1) for name, at in offsets.items()}, 24)
    for name, where in entries.items():
        f.seek(symtab[4] + where)
        _, info, _, _, value, _ = struct.unpack("<IBBHQQ", f.read(24))
        if info & 0xF == names[name] == _STT_FUNC and value:
            values[name] = value - first_load
        elif info & 0xF == names[name] == _STT_TLS:
            values[name] = value
    return values


def _find_each(f: BinaryIO, start: int, size: int, needles: dict[bytes, bytes], stride: int) -> dict[bytes, int]:
    """For each key, the first offset (from `start`, a multiple of `stride`) where its needle is in
    the file's range; keys whose needle is not there are left out. One read of the range for all."""
    found: dict[bytes, int] = {}
    longest = max((len(needle) for needle in needles.values()), default=0)
    position = 0
    while position < size and len(found) < len(needles):
        f.seek(start + position)
        piece = f.read(min(_CHUNK + longest, size - position))
        for key, needle in needles.items():
            at = -1 if key in found else piece.find(needle)
            while at != -1:
                if (position + at) % stride == 0:
                    found[key] = position + at
                    break
                at = piece.find(needle, at + 1)
        position += _CHUNK
    return found
