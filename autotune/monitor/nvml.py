"""NVML, behind one small module: the only place that imports `pynvml` (dist nvidia-ml-py).

Every failure (library missing, driver gone, GPU lost, call not supported) turns into
"not available" (None or an empty list) for that figure, logged once, never an exception.
NVML needs no CUDA context, so the monitor process can use it without touching CUDA.

Devices are named by UUID ("GPU-..." or "MIG-..."), never by index: CUDA_VISIBLE_DEVICES
and CUDA_DEVICE_ORDER renumber devices for CUDA but not for NVML.

Owns: the NVML session (init, shutdown). Touches nothing else.
"""

from __future__ import annotations

import atexit
import dataclasses
import importlib
from typing import Any

from loguru import logger


@dataclasses.dataclass(frozen=True)
class GpuInfo:
    """One NVML device: a whole GPU, or a MIG instance of one (then `parent_uuid` is set)."""

    index: int  # NVML index of the GPU (of the parent GPU for a MIG instance)
    uuid: str
    name: str
    total_bytes: int | None
    parent_uuid: str | None = None
    mig_index: int | None = None


@dataclasses.dataclass(frozen=True)
class GpuMemory:
    """Device memory. With the v2 call, `reserved_bytes` is what the driver keeps back."""

    total_bytes: int
    used_bytes: int
    free_bytes: int
    reserved_bytes: int | None = None


def normalize_uuid(uuid: str) -> str:
    """Lower-case hex without the 'GPU-'/'MIG-' prefix, so torch's and NVML's spellings compare."""
    text = str(uuid).strip().lower()
    for prefix in ("mig-gpu-", "gpu-", "mig-"):
        if text.startswith(prefix):
            text = text[len(prefix):]
            break
    return text


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class NVML:
    """A lazily initialised NVML session; `NVML().devices()` is safe on any machine."""

    def __init__(self) -> None:
        self._lib: Any = None
        self._state = "new"  # new -> ready | unavailable
        self._handles: dict[str, Any] = {}
        self._memory_version: str | None = None  # "v2" or "v1" once known
        self._process_calls: list[str] | None = None
        self._logged: set[str] = set()

    # -- plumbing
    def _log_once(self, key: str, message: str) -> None:
        if key not in self._logged:
            self._logged.add(key)
            logger.warning(message)

    def _ready(self) -> bool:
        if self._state == "new":
            try:
                self._lib = importlib.import_module("pynvml")
                self._lib.nvmlInit()
            except Exception as exc:  # ImportError, NVMLError (no driver / library), OSError
                self._state = "unavailable"
                self._log_once("init", f"NVML not available ({type(exc).__name__}: {exc}); GPU figures off")
                return False
            self._state = "ready"
            atexit.register(self.shutdown)
        return self._state == "ready"

    def _call(self, figure: str, fn: str, *args: Any, **kwargs: Any) -> Any:
        """Call `pynvml.fn`; None (logged once per figure and error) on any NVML failure."""
        try:
            return getattr(self._lib, fn)(*args, **kwargs)
        except Exception as exc:  # NVMLError subclasses, AttributeError for an old pynvml
            self._log_once(f"{figure}:{type(exc).__name__}", f"NVML {figure} not available: {type(exc).__name__}: {exc}")
            return None

    @property
    def available(self) -> bool:
        return self._ready()

    def shutdown(self) -> None:
        if self._state == "ready":
            self._call("shutdown", "nvmlShutdown")
        self._state = "new"
        self._handles.clear()

    # -- devices
    def devices(self) -> list[GpuInfo]:
        """Every GPU NVML sees, followed by its MIG instances when MIG is enabled."""
        if not self._ready():
            return []
        count = self._call("device count", "nvmlDeviceGetCount") or 0
        found: list[GpuInfo] = []
        for index in range(count):
            handle = self._call("device handle", "nvmlDeviceGetHandleByIndex", index)
            if handle is None:
                continue
            uuid = self._call("uuid", "nvmlDeviceGetUUID", handle)
            if uuid is None:
                continue
            uuid = _text(uuid)
            self._handles[normalize_uuid(uuid)] = handle
            name = _text(self._call("name", "nvmlDeviceGetName", handle) or "GPU")
            memory = self._memory_of(handle)
            found.append(GpuInfo(index, uuid, name, memory.total_bytes if memory else None))
            found.extend(self._mig_instances(index, uuid, name, handle))
        return found

    def _mig_instances(self, index: int, uuid: str, name: str, handle: Any) -> list[GpuInfo]:
        try:
            mode = self._lib.nvmlDeviceGetMigMode(handle)
        except Exception:  # GPUs without MIG answer NOT_SUPPORTED: expected, not worth a log line
            return []
        if not mode or not mode[0]:  # (current, pending); 0 = disabled
            return []
        instances = []
        for mig_index in range(self._call("MIG count", "nvmlDeviceGetMaxMigDeviceCount", handle) or 0):
            try:  # empty slots answer NOT_FOUND: expected, not worth a log line
                mig = self._lib.nvmlDeviceGetMigDeviceHandleByIndex(handle, mig_index)
            except Exception:
                continue
            mig_uuid = self._call("MIG uuid", "nvmlDeviceGetUUID", mig)
            if mig_uuid is None:
                continue
            mig_uuid = _text(mig_uuid)
            self._handles[normalize_uuid(mig_uuid)] = mig
            memory = self._memory_of(mig)
            instances.append(GpuInfo(index, mig_uuid, f"{name} MIG {mig_index}",
                                     memory.total_bytes if memory else None, parent_uuid=uuid, mig_index=mig_index))
        return instances

    def handle(self, uuid: str) -> Any:
        """The NVML handle of the device with this UUID (either spelling), or None."""
        if not self._ready():
            return None
        key = normalize_uuid(uuid)
        if key not in self._handles:
            self.devices()
        return self._handles.get(key)

    # -- figures
    def _memory_of(self, handle: Any) -> GpuMemory | None:
        if self._memory_version != "v1":
            version = getattr(self._lib, "nvmlMemory_v2", None)
            try:
                info = self._lib.nvmlDeviceGetMemoryInfo(handle, version=version) if version else None
            except Exception as exc:
                if not self._is_unsupported(exc):  # e.g. GPU lost: not a reason to change calls
                    self._log_once(f"memory:{type(exc).__name__}", f"NVML memory not available: {type(exc).__name__}: {exc}")
                    return None
                info = None  # v2 not in this driver: use v1 from now on
                self._log_once("memory v2", f"NVML memory info v2 not supported ({type(exc).__name__}); using v1")
            if info is not None:
                self._memory_version = "v2"
                return GpuMemory(int(info.total), int(info.used), int(info.free), int(info.reserved))
            self._memory_version = "v1"
        info = self._call("memory", "nvmlDeviceGetMemoryInfo", handle)
        if info is None:
            return None
        return GpuMemory(int(info.total), int(info.used), int(info.free))

    def _is_unsupported(self, exc: Exception) -> bool:
        codes = {getattr(self._lib, name, None) for name in (
            "NVML_ERROR_NOT_SUPPORTED", "NVML_ERROR_FUNCTION_NOT_FOUND", "NVML_ERROR_ARGUMENT_VERSION_MISMATCH")}
        return isinstance(exc, (AttributeError, TypeError)) or getattr(exc, "value", None) in codes - {None}

    def memory(self, uuid: str) -> GpuMemory | None:
        """Memory of the device with this UUID; None when not available (GPU lost, ...)."""
        handle = self.handle(uuid)
        return None if handle is None else self._memory_of(handle)

    def processes(self, uuid: str) -> dict[int, int | None] | None:
        """GPU memory used by each compute process on the device, {pid: bytes}; None if unknown.
        PIDs are as NVML sees them: in a container, the host's (not this namespace's). A process
        whose bytes NVML cannot say (no permission, some containers) maps to None, not 0."""
        handle = self.handle(uuid)
        if handle is None:
            return None
        calls = self._process_calls or ["nvmlDeviceGetComputeRunningProcesses_v3",
                                         "nvmlDeviceGetComputeRunningProcesses_v2",
                                         "nvmlDeviceGetComputeRunningProcesses"]
        for fn in calls:
            try:
                procs = getattr(self._lib, fn)(handle)
            except Exception:
                continue  # newest first; an older driver lacks the newer calls
            self._process_calls = [fn]  # remember what works
            return {int(p.pid): _bytes_or_none(p.usedGpuMemory) for p in procs}
        self._process_calls = None
        self._log_once("processes", "NVML per-process GPU memory not available")
        return None


# What NVML puts where it cannot say a process's bytes (NVML_VALUE_NOT_AVAILABLE, an unsigned -1).
_NOT_AVAILABLE = (1 << 64) - 1


def _bytes_or_none(value: Any) -> int | None:
    return None if value is None or int(value) == _NOT_AVAILABLE else int(value)


_session: NVML | None = None


def session() -> NVML:
    """The process-wide NVML session."""
    global _session
    if _session is None:
        _session = NVML()
    return _session
