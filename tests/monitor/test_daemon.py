"""`autotune monitor` end to end in a subprocess, and its GPU path with the scripted fake NVML."""

import io
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from autotune.monitor.daemon import Daemon, PrometheusExport, UsageError, parse_listen, select_devices
from autotune.monitor.nvml import NVML
from tests.monitor import fake_nvml
from tests.monitor.fake_nvml import FakeGpu

A = "GPU-aaaaaaaa-0000-0000-0000-000000000001"
B = "GPU-bbbbbbbb-0000-0000-0000-000000000002"


def autotune(*args, **kwargs):
    return subprocess.Popen([sys.executable, "-m", "autotune.cli", "monitor", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, **kwargs)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_watches_the_host_writes_jsonl_and_exits_0_on_sigterm(tmp_path):
    out = tmp_path / "samples.jsonl"
    proc = autotune("--interval", "0.1", "--out", str(out), "--pid", str(os.getpid()))
    first = proc.stdout.readline()  # it has started once it says what it watches
    deadline = time.monotonic() + 20  # the file is flushed every 2 s; a loaded machine samples slower
    while time.monotonic() < deadline and (not out.exists() or len(out.read_text().splitlines()) < 10):
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    try:
        stdout, stderr = proc.communicate(timeout=30)  # a loaded machine can take a while to exit
    except subprocess.TimeoutExpired:
        proc.kill()
        stdout, stderr = proc.communicate()
        pytest.fail(f"the daemon did not exit within 30 s of SIGTERM; stdout {stdout[-1000:]!r}, "
                    f"stderr {stderr[-2000:]!r}")
    stdout = first + stdout
    assert proc.returncode == 0, stderr
    assert "watching the host" in stdout and "Traceback" not in stderr
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(records) >= 10, (len(records), stderr)
    assert records[-1]["device"] == "host" and records[-1]["used_bytes"] > 0, records[-1]
    assert records[-1]["processes"][str(os.getpid())] > 10 * 2**20, records[-1]


def test_duration_ends_it(tmp_path):
    proc = autotune("--interval", "0.2", "--duration", "1", "--no-view")
    stdout, stderr = proc.communicate(timeout=20)
    assert proc.returncode == 0 and "stopped after" in stdout, stderr


@pytest.mark.parametrize("args, message", [
    (["--device", "99"], "--device 99: no "),  # "no GPU found" here, "no such GPU; found: ..." on a GPU host
    (["--interval", "0"], "--interval 0.0 is outside 0.05-10.0 s"),
    (["--interval", "fast"], "--interval 'fast' is not a number"),
    (["--out", "/proc/no/such.jsonl"], "--out /proc/no/such.jsonl: cannot write"),
    (["--pid", "999999999"], "--pid 999999999: no such process"),
    (["--prometheus", "localhost:http"], "expected [HOST:]PORT"),
])
def test_bad_arguments_are_one_clear_line(args, message):
    proc = autotune(*args, "--duration", "1")
    stdout, stderr = proc.communicate(timeout=20)
    assert proc.returncode == 2
    assert message in stderr and "Traceback" not in stderr


def test_prometheus_metrics_are_served_on_loopback(tmp_path):
    port = free_port()
    proc = autotune("--interval", "0.1", "--prometheus", str(port), "--pid", str(os.getpid()), "--no-view")
    try:
        body = None
        deadline = time.monotonic() + 15
        while body is None and time.monotonic() < deadline:
            try:
                body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=1).read().decode()
            except OSError:
                time.sleep(0.2)
        assert body is not None, "no metrics served"
        assert "autotune_host_memory_used_bytes" in body and "autotune_last_collect_success 1.0" in body
        assert f'autotune_process_memory_bytes{{device="host",pid="{os.getpid()}"}}' in body
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=10)
    assert proc.returncode == 0


def test_listen_address_defaults_to_loopback():
    assert parse_listen("9400") == ("127.0.0.1", 9400)
    assert parse_listen("0.0.0.0:9400") == ("0.0.0.0", 9400)
    with pytest.raises(UsageError):
        parse_listen("99999")


def gpus(monkeypatch):
    module = fake_nvml.make([FakeGpu(A, used=2**30, processes={4242: 3 * 2**30}), FakeGpu(B, used=5 * 2**30)])
    monkeypatch.setitem(sys.modules, "pynvml", module)
    return NVML()


def test_device_selection_by_index_and_uuid(monkeypatch):
    nvml = gpus(monkeypatch)
    assert [d.uuid for d in select_devices(nvml, "all")] == [A, B]
    assert [d.uuid for d in select_devices(nvml, "1")] == [B]
    assert [d.uuid for d in select_devices(nvml, B.lower()[4:])] == [B]
    with pytest.raises(UsageError, match="--device 7: no such GPU; found: 0 .*, 1 "):
        select_devices(nvml, "7")


def test_a_device_asked_for_on_a_host_without_gpus_is_one_clear_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", fake_nvml.make([], library_missing=True))
    with pytest.raises(UsageError, match="--device 0: no GPU found"):
        select_devices(NVML(), "0")


def test_gpu_readings_view_and_metrics(monkeypatch):
    nvml = gpus(monkeypatch)
    view = io.StringIO()
    daemon = Daemon(select_devices(nvml, "all"), nvml, [4242], None, view)
    daemon.tick()
    readings = daemon.sample()
    assert [(r.uuid, r.used_bytes, r.processes) for r in readings] == [(A, 2**30, {4242: 3 * 2**30}), (B, 5 * 2**30, {4242: None})]
    assert "[0] Fake H200" in view.getvalue() and "pid 4242: 3.0 GiB" in view.getvalue()
    export = PrometheusExport()
    export.serve(("127.0.0.1", free_port()))
    try:
        export.update(readings)
        assert export.registry.get_sample_value("autotune_gpu_memory_used_bytes", {"uuid": B, "index": "1"}) == 5 * 2**30
        assert export.registry.get_sample_value("autotune_process_memory_bytes", {"pid": "4242", "device": A}) == 3 * 2**30
        assert export.registry.get_sample_value("autotune_last_collect_success") == 1
    finally:
        export.server.shutdown()


def test_a_lost_gpu_shows_as_not_available_not_a_crash(monkeypatch):
    module = fake_nvml.make([FakeGpu(A, lost_after=1)])
    monkeypatch.setitem(sys.modules, "pynvml", module)
    nvml = NVML()
    daemon = Daemon(select_devices(nvml, "all"), nvml, [], None, io.StringIO())
    daemon.tick()
    daemon.tick()
    assert daemon.samples == 2 and daemon.sample()[0].used_bytes is None


def test_the_daemon_does_not_load_torch(tmp_path):
    # A watcher that sits next to training all day should be small and quick to stop: importing
    # torch cost ~300 MB of RSS and a second or more at exit.
    code = ("import sys\nfrom autotune.cli import main\n"
            "rc = main(['monitor', '--duration', '0.3', '--no-view'])\n"
            "assert 'torch' not in sys.modules, 'autotune monitor imported torch'\n"
            "sys.exit(rc)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
