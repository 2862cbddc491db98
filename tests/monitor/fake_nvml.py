"""A scripted stand-in for the `pynvml` module (NVML cannot run on a machine without a GPU).

Only what autotune.monitor.nvml calls is here. Each scenario in test_nvml.py is named
after the failure it reproduces; the fake raises the same error codes real NVML does.
"""

from __future__ import annotations

import dataclasses
import types

NVML_ERROR_UNINITIALIZED = 1
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_NOT_FOUND = 6
NVML_ERROR_LIBRARY_NOT_FOUND = 12
NVML_ERROR_FUNCTION_NOT_FOUND = 13
NVML_ERROR_GPU_IS_LOST = 15
NVML_ERROR_ARGUMENT_VERSION_MISMATCH = 25
nvmlMemory_v2 = 0x02000028


class NVMLError(Exception):
    def __init__(self, value: int):
        super().__init__(value)
        self.value = value

    def __str__(self) -> str:
        return {12: "NVML Shared Library Not Found", 13: "Function Not Found", 15: "GPU is lost",
                3: "Not Supported", 6: "Not Found"}.get(self.value, f"error {self.value}")


@dataclasses.dataclass
class FakeGpu:
    uuid: str
    name: str = "Fake H200"
    total: int = 140 * 2**30
    used: int = 2**30
    reserved: int = 512 * 2**20
    processes: dict = dataclasses.field(default_factory=dict)  # pid -> bytes
    mig: list = dataclasses.field(default_factory=list)  # FakeGpu instances
    lost_after: int | None = None  # memory calls that work before the GPU falls off the bus
    memory_calls: int = 0


def make(gpus: list[FakeGpu], library_missing: bool = False, v2_supported: bool = True,
         process_versions: tuple[str, ...] = ("v3", "v2", "v1")) -> types.ModuleType:
    """A module object that behaves like pynvml for these GPUs."""
    m = types.ModuleType("pynvml")
    for name, value in globals().items():
        if name.startswith("NVML_ERROR_") or name in ("nvmlMemory_v2", "NVMLError"):
            setattr(m, name, value)
    m.calls = []

    def log(name):
        m.calls.append(name)

    def nvmlInit():
        log("init")
        if library_missing:
            raise NVMLError(NVML_ERROR_LIBRARY_NOT_FOUND)

    def nvmlShutdown():
        log("shutdown")

    def nvmlDeviceGetCount():
        return len(gpus)

    def nvmlDeviceGetHandleByIndex(i):
        if i >= len(gpus):
            raise NVMLError(NVML_ERROR_NOT_FOUND)
        return gpus[i]

    def nvmlDeviceGetUUID(h):
        return h.uuid

    def nvmlDeviceGetName(h):
        return h.name.encode()  # older pynvml returns bytes

    def nvmlDeviceGetMemoryInfo(h, version=None):
        log(f"memory {'v2' if version else 'v1'}")
        if version and not v2_supported:
            raise NVMLError(NVML_ERROR_FUNCTION_NOT_FOUND)
        h.memory_calls += 1
        if h.lost_after is not None and h.memory_calls > h.lost_after:
            raise NVMLError(NVML_ERROR_GPU_IS_LOST)
        free = h.total - h.used - (h.reserved if version else 0)
        info = types.SimpleNamespace(total=h.total, used=h.used, free=free)
        if version:
            info.reserved = h.reserved
        return info

    def processes(version):
        def call(h):
            log(f"processes {version}")
            if version not in process_versions:
                raise NVMLError(NVML_ERROR_FUNCTION_NOT_FOUND)
            return [types.SimpleNamespace(pid=pid, usedGpuMemory=b) for pid, b in h.processes.items()]
        return call

    def nvmlDeviceGetMigMode(h):
        if not h.mig:
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        return (1, 1)

    def nvmlDeviceGetMaxMigDeviceCount(h):
        return 7

    def nvmlDeviceGetMigDeviceHandleByIndex(h, i):
        if i >= len(h.mig):
            raise NVMLError(NVML_ERROR_NOT_FOUND)
        return h.mig[i]

    for fn in (nvmlInit, nvmlShutdown, nvmlDeviceGetCount, nvmlDeviceGetHandleByIndex, nvmlDeviceGetUUID,
               nvmlDeviceGetName, nvmlDeviceGetMemoryInfo, nvmlDeviceGetMigMode, nvmlDeviceGetMaxMigDeviceCount,
               nvmlDeviceGetMigDeviceHandleByIndex):
        setattr(m, fn.__name__, fn)
    m.nvmlDeviceGetComputeRunningProcesses_v3 = processes("v3")
    m.nvmlDeviceGetComputeRunningProcesses_v2 = processes("v2")
    m.nvmlDeviceGetComputeRunningProcesses = processes("v1")
    return m
