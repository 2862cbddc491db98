"""The real nvml.py code paths, driven by a scripted fake pynvml (tests/monitor/fake_nvml.py)."""

import sys

import pytest
from loguru import logger

from autotune.monitor.nvml import NVML, normalize_uuid
from tests.monitor import fake_nvml
from tests.monitor.fake_nvml import FakeGpu

A = "GPU-aaaaaaaa-0000-0000-0000-000000000001"
B = "GPU-bbbbbbbb-0000-0000-0000-000000000002"


@pytest.fixture
def warnings():
    seen = []
    handler = logger.add(lambda m: seen.append(m.record["message"]), level="WARNING")
    logger.enable("autotune")
    yield seen
    logger.remove(handler)
    logger.disable("autotune")


def install(monkeypatch, module):
    monkeypatch.setitem(sys.modules, "pynvml", module)
    return NVML()


def test_library_missing_is_not_available_and_logged_once(monkeypatch, warnings):
    nvml = install(monkeypatch, fake_nvml.make([FakeGpu(A)], library_missing=True))
    assert nvml.devices() == [] and nvml.memory(A) is None and nvml.processes(A) is None
    assert not nvml.available
    assert len([w for w in warnings if "NVML not available" in w]) == 1


def test_pynvml_not_installed_is_not_available(monkeypatch, warnings):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml -> ImportError
    nvml = NVML()
    assert nvml.devices() == [] and nvml.memory(A) is None
    assert any("ImportError" in w or "ModuleNotFoundError" in w for w in warnings)


def test_memory_v2_reports_reserved(monkeypatch):
    nvml = install(monkeypatch, fake_nvml.make([FakeGpu(A, used=3 * 2**30)]))
    memory = nvml.memory(A)
    assert memory.used_bytes == 3 * 2**30 and memory.reserved_bytes == 512 * 2**20
    assert memory.free_bytes == memory.total_bytes - memory.used_bytes - memory.reserved_bytes


def test_v2_not_supported_falls_back_to_v1_once(monkeypatch, warnings):
    module = fake_nvml.make([FakeGpu(A)], v2_supported=False)
    nvml = install(monkeypatch, module)
    for _ in range(3):
        memory = nvml.memory(A)
        assert memory is not None and memory.reserved_bytes is None
    assert module.calls.count("memory v2") == 1  # v2 is not retried every sample
    assert len([w for w in warnings if "v2 not supported" in w]) == 1


def test_gpu_lost_mid_run_becomes_not_available_logged_once(monkeypatch, warnings):
    gpu = FakeGpu(A, lost_after=3)  # one call lists the device, two samples work, then it is lost
    module = fake_nvml.make([gpu])
    nvml = install(monkeypatch, module)
    assert nvml.memory(A) is not None and nvml.memory(A) is not None
    assert nvml.memory(A) is None and nvml.memory(A) is None
    assert len([w for w in warnings if "GPU is lost" in w]) == 1
    assert "memory v1" not in module.calls  # a lost GPU is not a reason to give up on v2


def test_reordered_cuda_visible_devices_map_by_uuid_not_index(monkeypatch):
    # CUDA_VISIBLE_DEVICES=1,0: torch's cuda:0 is NVML's device 1. torch spells the UUID
    # without the "GPU-" prefix.
    nvml = install(monkeypatch, fake_nvml.make([FakeGpu(A, used=1 * 2**30), FakeGpu(B, used=7 * 2**30)]))
    torch_uuid_of_cuda0 = B[len("GPU-"):]
    assert nvml.memory(torch_uuid_of_cuda0).used_bytes == 7 * 2**30
    assert [d.index for d in nvml.devices()] == [0, 1]


def test_mig_instances_are_listed_and_measured(monkeypatch):
    mig = [FakeGpu("MIG-11111111-0000-0000-0000-000000000001", total=10 * 2**30, used=2**30),
           FakeGpu("MIG-11111111-0000-0000-0000-000000000002", total=20 * 2**30, used=2 * 2**30)]
    nvml = install(monkeypatch, fake_nvml.make([FakeGpu(A, mig=mig), FakeGpu(B)]))
    devices = nvml.devices()
    assert [(d.uuid, d.parent_uuid, d.mig_index) for d in devices] == [
        (A, None, None), (mig[0].uuid, A, 0), (mig[1].uuid, A, 1), (B, None, None)]
    assert nvml.memory(mig[1].uuid).total_bytes == 20 * 2**30


def test_processes_newest_call_first_then_fall_back(monkeypatch):
    module = fake_nvml.make([FakeGpu(A, processes={123: 5 * 2**30, 456: 2**30})], process_versions=("v1",))
    nvml = install(monkeypatch, module)
    assert nvml.processes(A) == {123: 5 * 2**30, 456: 2**30}
    assert module.calls[-3:] == ["processes v3", "processes v2", "processes v1"]
    nvml.processes(A)
    assert module.calls[-1] == "processes v1" and module.calls[-2] != "processes v2"  # remembered


def test_unknown_uuid_is_none(monkeypatch):
    nvml = install(monkeypatch, fake_nvml.make([FakeGpu(A)]))
    assert nvml.memory("GPU-ffffffff-0000-0000-0000-000000000000") is None


def test_uuid_spellings_compare_equal():
    assert normalize_uuid("GPU-ABCD") == normalize_uuid("abcd") == normalize_uuid("MIG-abcd")


def test_in_a_container_the_trainers_pid_is_not_listed_and_its_bytes_are_unknown_not_zero(monkeypatch, capsys):
    # NVML lists the host's PIDs; inside a container the trainer's own PID is not among them, and
    # some drivers give NVML_VALUE_NOT_AVAILABLE for a process's bytes.
    from autotune.monitor import nvml as nvml_module
    from autotune.monitor.process import MonitorConfig, Sampler

    host_pids = {48213: 3 * 2**30, 48999: (1 << 64) - 1}
    module = fake_nvml.make([FakeGpu(A, processes=host_pids)])
    monkeypatch.setitem(sys.modules, "pynvml", module)
    monkeypatch.setattr(nvml_module, "_session", None)
    assert nvml_module.session().processes(A) == {48213: 3 * 2**30, 48999: None}
    sampler = Sampler(MonitorConfig(pid=17, board="unused", samples_path=None, gpu_uuid=A))
    assert sampler.read_process() is None and sampler.read_process() is None
    said = capsys.readouterr().err
    assert said.count("NVML lists no process 17") == 1 and "host's PIDs" in said
    nvml_module.session().shutdown()
