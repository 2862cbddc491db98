"""`autotune monitor`: watch GPU (or host) memory on its own, like nvitop or gpustat.

    autotune monitor [--device all|INDEX|UUID] [--interval S] [--out FILE.jsonl]
                     [--pid PID ...] [--duration S] [--prometheus [HOST:]PORT]

Watches every GPU NVML sees (MIG instances included), or the host when there is none, and
says so. Prints a compact live view, appends JSONL lines to --out, serves Prometheus
metrics with --prometheus (extra `prometheus-client`). SIGTERM or SIGINT: flush, exit 0.
--device INDEX is NVML's index (as nvidia-smi shows), not CUDA's.

Owns: the daemon's devices, timeline file and Prometheus endpoint. Touches nothing of any process it watches.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
import threading
import time
from pathlib import Path
from typing import Any, TextIO

import psutil

from autotune.common.units import format_bytes
from autotune.monitor import host
from autotune.monitor.nvml import NVML, GpuInfo, normalize_uuid, session
from autotune.monitor.process import MAX_INTERVAL, MIN_INTERVAL, SampleLog
from autotune.monitor.schedule import run_until_stopped, stop_on_signals


class UsageError(ValueError):
    """A bad argument: printed as one line, exit code 2."""


@dataclasses.dataclass
class Reading:
    """One device at one moment, as written to the JSONL file."""

    time: float
    device: str  # "gpu" or "host"
    uuid: str | None
    index: int | None
    name: str
    used_bytes: int | None
    total_bytes: int | None
    processes: dict[int, int | None]  # pid -> bytes (GPU memory, or RSS with children on the host)


def interval_arg(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--interval {text!r} is not a number of seconds") from None
    if not MIN_INTERVAL <= value <= MAX_INTERVAL:
        raise argparse.ArgumentTypeError(f"--interval {value} is outside {MIN_INTERVAL}-{MAX_INTERVAL} s")
    return value


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{value} must be > 0")
    return value


def parse_listen(text: str) -> tuple[str, int]:
    """'[HOST:]PORT' -> (host, port); the host defaults to 127.0.0.1 (not every interface)."""
    address, _, port = text.rpartition(":")
    try:
        number = int(port)
    except ValueError:
        raise UsageError(f"--prometheus {text!r}: expected [HOST:]PORT") from None
    if not 0 < number < 65536:
        raise UsageError(f"--prometheus {text!r}: port must be 1-65535")
    return address or "127.0.0.1", number


def select_devices(nvml: NVML, wanted: str) -> list[GpuInfo]:
    """The GPUs to watch for `--device`; [] means the host (only allowed for 'all')."""
    devices = nvml.devices()
    if wanted == "all":
        return devices
    if not devices:
        raise UsageError(f"--device {wanted}: no GPU found (NVML not available or no devices); "
                         "use --device all to watch the host")
    whole = [d for d in devices if d.parent_uuid is None]
    if wanted.isdigit():
        chosen = [d for d in whole if d.index == int(wanted)]
    else:
        chosen = [d for d in devices if normalize_uuid(d.uuid) == normalize_uuid(wanted)]
    if not chosen:
        found = ", ".join(f"{d.index} ({d.uuid})" for d in whole)
        raise UsageError(f"--device {wanted}: no such GPU; found: {found}")
    return chosen


class Daemon:
    """Samples the chosen devices; writes JSONL, the live view and Prometheus gauges."""

    def __init__(self, devices: list[GpuInfo], nvml: NVML, pids: list[int], out: SampleLog | None,
                 view: TextIO | None, prometheus: Any = None):
        self.devices, self.nvml, self.pids = devices, nvml, pids
        self.out, self.view, self.prometheus = out, view, prometheus
        self.samples = 0
        self._last_view = 0.0
        self._processes: dict[str, dict[int, int | None]] = {}  # per device, refreshed at most once a second
        self._processes_time = float("-inf")

    def _per_process(self, now: float) -> dict[str, dict[int, int | None]]:
        # Per-process figures walk the process table (host) or ask the driver (GPU):
        # worth doing once a second, not at every sample.
        if not self.pids or now - self._processes_time < 1.0:
            return self._processes
        self._processes_time = now
        figures: dict[str, dict[int, int | None]] = {}
        for device in self.devices:
            per_process = self.nvml.processes(device.uuid)
            figures[device.uuid] = {pid: (per_process or {}).get(pid) for pid in self.pids} if per_process is not None else {}
        if not self.devices:
            figures["host"] = {pid: host.rss_bytes(pid) for pid in self.pids}
        self._processes = figures
        return figures

    def sample(self) -> list[Reading]:
        now = time.time()
        processes = self._per_process(time.monotonic())
        readings = []
        for device in self.devices:
            memory = self.nvml.memory(device.uuid)
            readings.append(Reading(now, "gpu", device.uuid, device.index, device.name,
                                    memory.used_bytes if memory else None,
                                    memory.total_bytes if memory else device.total_bytes,
                                    processes.get(device.uuid, {})))
        if not self.devices:
            vm = psutil.virtual_memory()
            readings.append(Reading(now, "host", None, None, "host", vm.total - vm.available, vm.total,
                                    processes.get("host", {})))
        return readings

    def tick(self) -> None:
        try:
            readings = self.sample()
        except Exception as exc:  # a sensor failure must not end the daemon; it shows as a failed collect
            logging.getLogger("autotune.monitor").warning("sampling failed: %s", exc)
            if self.prometheus:
                self.prometheus.collected(False)
            return
        self.samples += 1
        for reading in readings:
            if self.out is not None:
                self.out.add(dataclasses.asdict(reading))
        if self.prometheus:
            self.prometheus.update(readings)
        self.show(readings)

    def show(self, readings: list[Reading]) -> None:
        if self.view is None:
            return
        live = self.view.isatty()
        now = time.monotonic()
        if not live and now - self._last_view < 10:  # a log file gets a line every 10 s, not every tick
            return
        self._last_view = now
        lines = []
        for r in readings:
            share = f"{100 * r.used_bytes / r.total_bytes:5.1f}%" if r.used_bytes is not None and r.total_bytes else "  n/a"
            label = f"[{r.index}] {r.name}" if r.device == "gpu" else "host"
            procs = "  ".join(f"pid {pid}: {format_bytes(b)}" for pid, b in r.processes.items())
            lines.append(f"{time.strftime('%H:%M:%S')} {label:<28} {format_bytes(r.used_bytes):>10} / "
                         f"{format_bytes(r.total_bytes):<10} {share}  {procs}".rstrip())
        if live:  # redraw in place
            self.view.write(f"\x1b[{len(lines)}F" if self.samples > 1 else "")
            self.view.write("".join(f"\x1b[2K{line}\n" for line in lines))
        else:
            self.view.write("".join(line + "\n" for line in lines))
        self.view.flush()


class PrometheusExport:
    """Gauges in Prometheus base units, served over HTTP by prometheus-client once `serve` is called."""

    def __init__(self) -> None:
        try:
            import prometheus_client as prom
        except ImportError:
            raise UsageError("--prometheus needs the optional extra: pip install 'autotune[prometheus]'") from None
        self.registry = prom.CollectorRegistry()
        gauge = lambda name, doc, labels=(): prom.Gauge(name, doc, labels, registry=self.registry)  # noqa: E731
        self.gpu_used = gauge("autotune_gpu_memory_used_bytes", "GPU memory in use", ("uuid", "index"))
        self.gpu_total = gauge("autotune_gpu_memory_total_bytes", "GPU memory in all", ("uuid", "index"))
        self.host_used = gauge("autotune_host_memory_used_bytes", "host memory in use (total - available)")
        self.host_total = gauge("autotune_host_memory_total_bytes", "host memory in all")
        self.process = gauge("autotune_process_memory_bytes", "memory of a watched process", ("pid", "device"))
        self.success = gauge("autotune_last_collect_success", "1 if the last collection worked, else 0")
        self.stamp = gauge("autotune_last_collect_timestamp_seconds", "unix time of the last collection")
        self._prom = prom

    def serve(self, listen: tuple[str, int]) -> None:
        """Start answering scrapes on `listen` (after the first collection: a scrape never sees empty gauges)."""
        try:
            self.server, _thread = self._prom.start_http_server(listen[1], addr=listen[0], registry=self.registry)
        except OSError as exc:
            raise UsageError(f"--prometheus {listen[0]}:{listen[1]}: cannot listen: {exc}") from None

    def update(self, readings: list[Reading]) -> None:
        for r in readings:
            if r.device == "gpu":
                labels = {"uuid": r.uuid, "index": str(r.index)}
                if r.used_bytes is not None:
                    self.gpu_used.labels(**labels).set(r.used_bytes)
                if r.total_bytes is not None:
                    self.gpu_total.labels(**labels).set(r.total_bytes)
            else:
                self.host_used.set(r.used_bytes or 0)
                self.host_total.set(r.total_bytes or 0)
            for pid, value in r.processes.items():
                if value is not None:
                    self.process.labels(pid=str(pid), device=r.uuid or "host").set(value)
        self.collected(all(r.used_bytes is not None for r in readings))

    def collected(self, ok: bool) -> None:
        self.success.set(1 if ok else 0)
        self.stamp.set(time.time())


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default="all", help="all (default), an NVML index, or a GPU/MIG UUID")
    parser.add_argument("--interval", type=interval_arg, default=1.0, help="seconds between samples (0.05-10)")
    parser.add_argument("--out", type=Path, help="append JSONL samples to this file")
    parser.add_argument("--pid", type=int, nargs="+", default=[], help="also report these processes' memory")
    parser.add_argument("--duration", type=positive_float, help="stop after this many seconds")
    parser.add_argument("--prometheus", metavar="[HOST:]PORT", help="serve metrics (binds 127.0.0.1 by default)")
    parser.add_argument("--no-view", action="store_true", help="no live view on stdout")


def run_daemon(args: argparse.Namespace) -> int:
    """`autotune monitor`: returns the exit code; bad arguments raise UsageError."""
    stop_requested = threading.Event()
    stop_on_signals(stop_requested)
    for pid in args.pid:
        if not psutil.pid_exists(pid):
            raise UsageError(f"--pid {pid}: no such process")
    out = None
    if args.out is not None:
        try:
            open(args.out, "a", encoding="utf-8").close()  # prove it can be written before anything runs
        except OSError as exc:
            raise UsageError(f"--out {args.out}: cannot write: {exc.strerror}") from None
        out = SampleLog(args.out, max_bytes=2**62)  # the user's file: no rotation
    listen = parse_listen(args.prometheus) if args.prometheus else None
    prometheus = PrometheusExport() if listen else None
    nvml = session()
    devices = select_devices(nvml, args.device)
    view = None if args.no_view else sys.stdout
    if devices:
        print(f"watching {len(devices)} GPU(s): " + ", ".join(f"[{d.index}] {d.name} {d.uuid}" for d in devices))
    else:
        print("no GPU found (NVML not available or no devices): watching the host's memory")
    sys.stdout.flush()

    daemon = Daemon(devices, nvml, args.pid, out, view, prometheus)
    daemon.tick()
    if prometheus is not None:
        prometheus.serve(listen)
    if stop_requested.is_set():  # a signal came during start-up: stop after one sample
        print(f"stopped after {daemon.samples} samples")
        return 0
    jobs = [("sample", daemon.tick, args.interval)]
    if out is not None:
        jobs.append(("flush", out.flush, 2.0))
    if args.duration:
        timer = threading.Timer(args.duration, stop_requested.set)
        timer.daemon = True
        timer.start()
    run_until_stopped(jobs, stop_requested)
    if out is not None:
        out.flush()
    print(f"stopped after {daemon.samples} samples" + (f"; wrote {args.out}" if out is not None else ""))
    return 0
