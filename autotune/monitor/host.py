"""Host memory figures: the training process (and its children), cgroup, rlimit, MemAvailable.

Every reader returns None when its figure is not available on this machine, never raises.
The effective CPU cap is the one with the least headroom left, because that is the one
that will fail first: RLIMIT_AS counts virtual size, a cgroup counts the group's charged
memory, and the host as a whole has MemAvailable left.
"""

from __future__ import annotations

import resource
import time
from pathlib import Path

import psutil

from autotune.snapshot import DeviceSample
from autotune.units import format_bytes

_CGROUP_ROOT = Path("/sys/fs/cgroup")


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if text in ("max", ""):
        return None
    try:
        value = int(text)
    except ValueError:
        return None
    # cgroup v1 reports "no limit" as a huge page-aligned number
    return value if value < 2**60 else None


def rss_bytes(pid: int | None = None, children: bool = True) -> int | None:
    """Resident memory of the process, plus its children (DataLoader workers) by default."""
    try:
        proc = psutil.Process(pid)
        total = proc.memory_info().rss
        if children:
            for child in proc.children(recursive=True):
                try:
                    total += child.memory_info().rss
                except psutil.Error:
                    continue  # a worker that exited between listing and reading
        return total
    except psutil.Error:
        return None


def virtual_bytes() -> int | None:
    """Virtual size of this process: what RLIMIT_AS is measured against."""
    try:
        return psutil.Process().memory_info().vms
    except psutil.Error:
        return None


def rlimit_as_bytes() -> int | None:
    """The soft RLIMIT_AS of this process, None when unlimited."""
    soft, _hard = resource.getrlimit(resource.RLIMIT_AS)
    return None if soft == resource.RLIM_INFINITY else soft


def cgroup_memory() -> tuple[int | None, int | None]:
    """(current, max) of this process's memory cgroup: v2 first, then v1; None where unknown."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None, None
    for line in lines:
        hierarchy, controllers, path = line.split(":", 2)
        if hierarchy == "0" and controllers == "":  # cgroup v2
            base = _CGROUP_ROOT / path.lstrip("/")
            return _read_int(base / "memory.current"), _read_int(base / "memory.max")
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):  # cgroup v1
            base = _CGROUP_ROOT / "memory" / path.lstrip("/")
            if not base.exists():
                base = _CGROUP_ROOT / "memory"
            return _read_int(base / "memory.usage_in_bytes"), _read_int(base / "memory.limit_in_bytes")
    return None, None


def mem_available_bytes() -> int | None:
    """MemAvailable of the host (what can still be had without swapping)."""
    try:
        return psutil.virtual_memory().available
    except (psutil.Error, OSError):
        return None


def host_sample(soft_cap_bytes: int | None = None) -> DeviceSample:
    """One reading of the tightest CPU memory limit: `used` against `cap`, and which one it is.

    `soft_cap_bytes` is a user cap on the resident size of the process and its children.
    """
    rss = rss_bytes()
    candidates: list[tuple[int, int, str]] = []  # (used, cap, source)
    limit = rlimit_as_bytes()
    vms = virtual_bytes()
    if limit is not None and vms is not None:
        candidates.append((vms, limit, "rlimit_as"))
    cg_current, cg_max = cgroup_memory()
    if cg_current is not None and cg_max is not None:
        candidates.append((cg_current, cg_max, "cgroup"))
    if soft_cap_bytes is not None and rss is not None:
        candidates.append((rss, soft_cap_bytes, "memory_cap"))
    available = mem_available_bytes()
    if available is not None and rss is not None:
        candidates.append((rss, rss + available, "host"))
    total = psutil.virtual_memory().total
    if not candidates:
        return DeviceSample(time=time.time(), used_bytes=rss, total_bytes=total, source="host")
    used, cap, source = min(candidates, key=lambda c: c[1] - c[0])
    return DeviceSample(time=time.time(), used_bytes=used, cap_bytes=cap, total_bytes=total, source=source)


def describe_host_memory() -> str:
    """A one-line account of the host figures, for error messages."""
    parts = []
    rss = rss_bytes()
    if rss is not None:
        parts.append(f"rss {format_bytes(rss)} (with children)")
    vms, limit = virtual_bytes(), rlimit_as_bytes()
    if limit is not None:
        parts.append(f"virtual {format_bytes(vms)} of RLIMIT_AS {format_bytes(limit)}")
    cg_current, cg_max = cgroup_memory()
    if cg_max is not None:
        parts.append(f"cgroup {format_bytes(cg_current)} of {format_bytes(cg_max)}")
    available = mem_available_bytes()
    if available is not None:
        parts.append(f"host MemAvailable {format_bytes(available)}")
    return ", ".join(parts) or "host memory figures not available"

