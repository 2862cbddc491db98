"""Host memory figures: a process (and its children), cgroup, rlimit, MemAvailable.

Every reader returns None when its figure is not available on this machine, never raises.
The figures can be read for another process (the monitor process reads the trainer's).
The effective CPU cap is the one with the least headroom left, because that is the one
that will fail first: RLIMIT_AS counts virtual size, a cgroup counts the group's charged
memory, a user cap counts resident memory, and the host as a whole has MemAvailable left.

Owns nothing: it reads /proc, cgroup files and rlimits. Touches nothing.
"""

from __future__ import annotations

import os
import resource
import time
from pathlib import Path

import psutil

from autotune.common.snapshot import DeviceSample
from autotune.common.units import format_bytes

CGROUP_ROOT = Path("/sys/fs/cgroup")


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


def _process(pid: int | None) -> psutil.Process | None:
    try:
        return psutil.Process(pid)
    except psutil.Error:
        return None


def rss_bytes(pid: int | None = None, children: bool = True, exclude: int | None = None) -> int | None:
    """Resident memory of the process, plus its children (DataLoader workers) by default,
    leaving out the child `exclude` (the monitor process does not count itself)."""
    proc = _process(pid)
    if proc is None:
        return None
    try:
        total = proc.memory_info().rss
        if children:
            for child in descendants(proc.pid):
                if child == exclude:
                    continue
                try:
                    total += psutil.Process(child).memory_info().rss
                except psutil.Error:
                    continue  # a worker that exited between listing and reading
        return total
    except psutil.Error:
        return None


def descendants(pid: int) -> list[int]:
    """The pids of `pid`'s children, theirs, and so on. Linux lists each thread's children in
    /proc/PID/task/TID/children: a read per thread, where `psutil.Process.children` reads the stat
    file of every process on the host (milliseconds, at every sample). Elsewhere, psutil's."""
    found: list[int] = []
    pending = [pid]
    while pending:
        parent = pending.pop()
        try:
            tasks = os.listdir(f"/proc/{parent}/task")
            kids = []
            for task in tasks:
                with open(f"/proc/{parent}/task/{task}/children", "rb") as f:
                    kids += [int(k) for k in f.read().split()]
        except FileNotFoundError:
            if parent == pid and not os.path.exists(f"/proc/{pid}/task/{pid}/children"):
                return [child.pid for child in psutil.Process(pid).children(recursive=True)]  # no such files here
            continue  # a child that exited while we looked, or a thread that ended
        except OSError:
            continue
        found += kids
        pending += kids
    return found


def virtual_bytes(pid: int | None = None) -> int | None:
    """Virtual size of the process: what RLIMIT_AS is measured against."""
    proc = _process(pid)
    try:
        return proc.memory_info().vms if proc is not None else None
    except psutil.Error:
        return None


def rlimit_as_bytes(pid: int | None = None) -> int | None:
    """The soft RLIMIT_AS of the process, None when unlimited or unreadable."""
    try:
        if pid is None:
            soft, _hard = resource.getrlimit(resource.RLIMIT_AS)
        else:
            soft, _hard = psutil.Process(pid).rlimit(psutil.RLIMIT_AS)
    except (psutil.Error, OSError, AttributeError):
        return None
    return None if soft == resource.RLIM_INFINITY or soft < 0 else soft


def parse_proc_cgroup(text: str, root: Path = CGROUP_ROOT) -> tuple[Path, Path] | None:
    """From /proc/PID/cgroup, the files holding (current, max) memory: v2 first, then v1."""
    lines = [line.split(":", 2) for line in text.splitlines() if line.count(":") >= 2]
    for hierarchy, controllers, path in lines:
        if hierarchy == "0" and controllers == "":  # cgroup v2: one unified hierarchy
            base = root / path.lstrip("/")
            return base / "memory.current", base / "memory.max"
    for _, controllers, path in lines:
        if "memory" in controllers.split(","):  # cgroup v1
            base = root / "memory" / path.lstrip("/")
            if not base.exists():  # inside a container the group is mounted at the root
                base = root / "memory"
            return base / "memory.usage_in_bytes", base / "memory.limit_in_bytes"
    return None


def cgroup_memory(pid: int | None = None, root: Path = CGROUP_ROOT) -> tuple[int | None, int | None]:
    """(current, max) of the process's memory cgroup; None where unknown or unlimited."""
    try:
        text = Path(f"/proc/{pid or 'self'}/cgroup").read_text()
    except OSError:
        return None, None
    files = parse_proc_cgroup(text, root)
    if files is None:
        return None, None
    return _read_int(files[0]), _read_int(files[1])


def mem_available_bytes() -> int | None:
    """MemAvailable of the host (what can still be had without swapping)."""
    try:
        return psutil.virtual_memory().available
    except (psutil.Error, OSError):
        return None


def host_sample(soft_cap_bytes: int | None = None, pid: int | None = None, rss: int | None = None) -> DeviceSample:
    """One reading of the tightest CPU memory limit for process `pid` (default: this one).

    `soft_cap_bytes` is a user cap on the resident size of the process and its children.
    `rss` may pass a recent `rss_bytes(pid)` to save walking the process tree again.
    """
    rss = rss_bytes(pid) if rss is None else rss
    candidates: list[tuple[int, int, str]] = []  # (used, cap, source)
    limit, vms = rlimit_as_bytes(pid), virtual_bytes(pid)
    if limit is not None and vms is not None:
        candidates.append((vms, limit, "rlimit_as"))
    cg_current, cg_max = cgroup_memory(pid)
    if cg_current is not None and cg_max is not None:
        candidates.append((cg_current, cg_max, "cgroup"))
    if soft_cap_bytes is not None and rss is not None:
        candidates.append((rss, soft_cap_bytes, "memory_cap"))
    try:
        memory = psutil.virtual_memory()  # one read of /proc/meminfo for both figures
        available, total = memory.available, memory.total
    except (psutil.Error, OSError):
        available = total = None
    if available is not None and rss is not None:
        candidates.append((rss, rss + available, "host"))
    if not candidates:
        return DeviceSample(time=time.time(), used_bytes=rss, total_bytes=total, source="host")
    used, cap, source = min(candidates, key=lambda c: c[1] - c[0])
    return DeviceSample(time=time.time(), used_bytes=used, cap_bytes=cap, total_bytes=total, source=source)


def describe_host_memory(pid: int | None = None) -> str:
    """A one-line account of the host figures, for error messages."""
    parts = []
    rss = rss_bytes(pid)
    if rss is not None:
        parts.append(f"rss {format_bytes(rss)} (with children)")
    limit = rlimit_as_bytes(pid)
    if limit is not None:
        parts.append(f"virtual {format_bytes(virtual_bytes(pid))} of RLIMIT_AS {format_bytes(limit)}")
    cg_current, cg_max = cgroup_memory(pid)
    if cg_max is not None:
        parts.append(f"cgroup {format_bytes(cg_current)} of {format_bytes(cg_max)}")
    available = mem_available_bytes()
    if available is not None:
        parts.append(f"host MemAvailable {format_bytes(available)}")
    return ", ".join(parts) or "host memory figures not available"


def room_bytes(soft_cap_bytes: int | None = None) -> int | None:
    """The host memory left under its tightest limit (`soft_cap_bytes` too, where given: training
    on CPU under a memory cap); None where it cannot be told. What a copy of the state (a
    background checkpoint, HF's save) must fit in."""
    sample = host_sample(soft_cap_bytes)
    return None if sample.cap_bytes is None or sample.used_bytes is None else sample.cap_bytes - sample.used_bytes
