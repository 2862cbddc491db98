"""The background monitor process: samples memory on a schedule and publishes the latest
figure through a seqlocked board (board.py) and the timeline to `run_dir/samples.jsonl`.

The trainer starts it as a fresh interpreter (`python -m autotune.monitor.process`), the
spawn way: nothing of the trainer is inherited, not even its `__main__` (multiprocessing's
spawn would re-import the user's script, and with it torch). It imports neither torch nor
CUDA; GPU figures come from NVML, which needs no CUDA context.

Jobs (APScheduler 3.x, one worker thread, overruns coalesce):
  memory     every `interval` s   device (NVML) or host figures -> board + buffer
  processes  at most once a s     the trainer's own bytes: GPU per-process, or RSS with children
  flush      every 2 s            buffer -> samples.jsonl (rotated to samples.1.jsonl past a bound)
  parent     every 1 s            exit when the trainer is gone (backs up PR_SET_PDEATHSIG)

Owns: the monitor process (started, restarted, stopped), its timeline file and board. Touches
nothing of the trainer (it only reads the trainer's memory figures).
"""

from __future__ import annotations

import ctypes
import dataclasses
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from pathlib import Path

import psutil

from autotune.common.snapshot import DeviceSample
from autotune.monitor import host
from autotune.monitor.board import Board, create_board
from autotune.monitor.nvml import session as nvml_session
from autotune.monitor.schedule import run_until_stopped, stop_on_signals
from autotune.observe.journal import open_for_append

MIN_INTERVAL, MAX_INTERVAL = 0.05, 10.0
_PR_SET_PDEATHSIG = 1
_IDLE_START_S = 1.0  # a start-up on idle cores that took longer found none


@dataclasses.dataclass
class MonitorConfig:
    """What the monitor process watches and where it writes."""

    pid: int  # the process to watch (the trainer); its children count on CPU
    board: str  # path of the shared sample board
    samples_path: str | None  # samples.jsonl, or None for no timeline
    interval: float = 0.5
    gpu_uuid: str | None = None  # watch this GPU through NVML; None: the host
    cap_bytes: int | None = None  # a memory cap to measure against (GPU: set by the trainer; CPU: soft cap)
    max_log_bytes: int = 64 * 2**20  # samples.jsonl and its one rotated predecessor stay under this

    def __post_init__(self) -> None:
        if not MIN_INTERVAL <= self.interval <= MAX_INTERVAL:
            raise ValueError(f"monitor interval must be between {MIN_INTERVAL} and {MAX_INTERVAL} s, got {self.interval}")


class SampleLog:
    """Buffered JSONL writer with a size bound: past half the bound the file is rotated once."""

    def __init__(self, path: Path | None, max_bytes: int):
        self.path = path
        self.max_bytes = max_bytes
        self.buffer: deque[dict] = deque()

    def add(self, record: dict) -> None:
        self.buffer.append(record)

    def flush(self) -> None:
        if self.path is None:
            self.buffer.clear()
            return
        lines = []
        while self.buffer:
            lines.append(json.dumps(self.buffer.popleft()) + "\n")
        if not lines:
            return
        if self.path.exists() and self.path.stat().st_size > self.max_bytes // 2:
            self.path.replace(self.path.with_suffix(".1.jsonl"))
        with open_for_append(self.path) as f:
            f.writelines(lines)


class Sampler:
    """Takes one memory reading of the watched device or host."""

    def __init__(self, config: MonitorConfig):
        self.config = config
        self.nvml = nvml_session() if config.gpu_uuid else None
        self.process_bytes: int | None = None
        self.samples_taken = 0
        self._unlisted_said = False  # NVML did not list the trainer's PID: said once (monitor.log)

    def read(self) -> DeviceSample:
        config = self.config
        if self.nvml is not None:
            memory = self.nvml.memory(config.gpu_uuid)
            if memory is None:
                return DeviceSample(time=time.time(), source="nvml")
            return DeviceSample(time=time.time(), used_bytes=memory.used_bytes,
                                cap_bytes=config.cap_bytes or memory.total_bytes,
                                total_bytes=memory.total_bytes, source="nvml")
        return host.host_sample(config.cap_bytes, pid=config.pid, rss=self.process_bytes)

    def read_process(self) -> int | None:
        if self.nvml is not None:
            per_process = self.nvml.processes(self.config.gpu_uuid)
            self.process_bytes = None if per_process is None else per_process.get(self.config.pid)
            if per_process is not None and self.config.pid not in per_process and not self._unlisted_said:
                # Not 0: in a container NVML lists the host's PIDs, which this namespace cannot see.
                self._unlisted_said = True
                print(f"NVML lists no process {self.config.pid} on {self.config.gpu_uuid} ({len(per_process)} "
                      "listed; in a container NVML gives the host's PIDs): the trainer's own bytes are not known "
                      "here; its journal has the allocator's reserved bytes of every measured step instead",
                      file=sys.stderr, flush=True)
        else:
            self.process_bytes = host.rss_bytes(self.config.pid, exclude=os.getpid())
        return self.process_bytes


def _die_with_parent(parent_pid: int) -> None:
    # The kernel sends SIGTERM when the parent dies; if it died before this line ran, the
    # parent pid has already changed and we leave at once.
    libc = None
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL("libc.so.6", use_errno=True)
        except OSError:
            libc = None  # no glibc: the parent job still notices within a second
    if libc is not None:
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != parent_pid:
        sys.exit(0)


def run(config: MonitorConfig, parent_pid: int | None = None, duration: float | None = None) -> None:
    """Sample until stopped (SIGTERM/SIGINT, parent gone, or `duration` elapsed)."""
    stop = threading.Event()
    stop_on_signals(stop)
    board = Board(Path(config.board))
    log = SampleLog(Path(config.samples_path) if config.samples_path else None, config.max_log_bytes)
    sampler = Sampler(config)

    def sample_memory() -> None:
        sample = sampler.read()
        sampler.samples_taken += 1
        board.write(sample, sampler.process_bytes, sampler.samples_taken)
        log.add({"time": sample.time, "used_bytes": sample.used_bytes, "cap_bytes": sample.cap_bytes,
                 "total_bytes": sample.total_bytes, "source": sample.source, "process_bytes": sampler.process_bytes,
                 "device": config.gpu_uuid or "host", "pid": config.pid})

    def check_parent() -> None:
        if parent_pid is not None and (os.getppid() != parent_pid or not psutil.pid_exists(parent_pid)):
            stop.set()

    sampler.read_process()
    sample_memory()  # a first figure at once, before the first interval passes
    jobs = [("memory", sample_memory, config.interval),
            ("processes", sampler.read_process, max(1.0, config.interval)),
            ("flush", log.flush, 2.0)]
    if parent_pid is not None:
        jobs.append(("parent", check_parent, 1.0))
    if duration is not None:
        timer = threading.Timer(duration, stop.set)
        timer.daemon = True
        timer.start()
    run_until_stopped(jobs, stop)
    log.flush()
    board.close()


def main(argv: list[str] | None = None) -> int:
    """Entry point of the monitor process: `python -m autotune.monitor.process CONFIG_JSON`."""
    args = sys.argv[1:] if argv is None else argv
    config = MonitorConfig(**json.loads(args[0]))
    _die_with_parent(config.pid)
    run(config, parent_pid=config.pid)
    return 0


class MonitorProcess:
    """The trainer's handle on its monitor process: start, read the latest sample, restart, stop."""

    def __init__(self, run_dir: Path, pid: int | None = None, interval: float = 0.5, gpu_uuid: str | None = None,
                 cap_bytes: int | None = None, max_restarts: int = 3):
        self.run_dir = Path(run_dir)
        self.config = MonitorConfig(pid=pid or os.getpid(), board="",
                                    samples_path=str(self.run_dir / "samples.jsonl"), interval=interval,
                                    gpu_uuid=gpu_uuid, cap_bytes=cap_bytes)
        self.max_restarts = max_restarts
        self.restarts = 0
        self.board = create_board(fallback=self.run_dir)  # /dev/shm, or the run folder when it has no room
        self.config.board = str(self.board.path)
        self._proc: subprocess.Popen | None = None
        self.lowered = False  # whether it runs below the trainer's priority
        self.idle = False  # whether it runs only on idle cores (SCHED_IDLE, during its start-up)
        self._started_at = 0.0

    def start(self) -> None:
        _reap_exited()
        log = open(self.run_dir / "monitor.log", "ab")
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "autotune.monitor.process", json.dumps(dataclasses.asdict(self.config))],
                stdin=subprocess.DEVNULL, stdout=log, stderr=log, close_fds=True,
            )
        finally:
            log.close()
        # Below the training's priority. Its start-up (an interpreter and its imports, ~0.2 s of a
        # core) runs under SCHED_IDLE, on the cores training leaves idle: at ten steps nicer it
        # still took a ~10% share of a 2-core run that keeps both busy (benchmarks/overhead.py).
        # Its sampling then runs ten steps nicer (`settle`), where a share is worth having: near
        # the cap its samples should not wait. Set from here: a preexec_fn would cost a full fork.
        # Where other processes already keep every core busy, no core goes idle and a start-up
        # under SCHED_IDLE would never end (no sample, not even its exit when the trainer dies).
        self.lowered = _lower_priority(self._proc.pid)
        self.idle = self.lowered and not _cores_busy() and _set_idle(self._proc.pid, True)
        self._started_at = time.monotonic()

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    @property
    def returncode(self) -> int | None:
        return self._proc.returncode if self._proc is not None else None

    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def restart(self) -> bool:
        """Start a new monitor if restarts remain; False when the budget is spent."""
        if self.restarts >= self.max_restarts:
            return False
        self.restarts += 1
        self.start()
        return True

    def settle(self) -> None:
        """Its start-up is over (its first sample came): from SCHED_IDLE to ten steps nicer than the
        trainer. Where leaving SCHED_IDLE is not allowed (an unprivileged user, RLIMIT_NICE 0) it
        stays there: it then samples in the gaps training leaves, which a GPU run has plenty of."""
        if self.idle and self._proc is not None:
            self.idle = not _set_idle(self._proc.pid, False)

    def latest(self) -> tuple[DeviceSample, int | None] | None:
        """The newest sample and the trainer's own bytes, or None when nothing new arrived."""
        got = self.board.read_new()
        if got is None and self.idle and time.monotonic() - self._started_at > _IDLE_START_S:
            self.settle()  # the idle cores gave its start-up no room: it gets its share ten steps nicer
        return got

    def stop(self, timeout: float = 2.0, wait: bool = True) -> None:
        """Stop the monitor. `wait=False`: signal it and go on (its exit takes ~60 ms, which the end
        of a fit need not wait for); it is reaped at the next start or stop of any monitor. No
        thread is started for it: under a hard memory cap a new thread's stack may not fit."""
        _reap_exited()
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            if wait:
                _reap(self._proc, timeout)
            else:
                _EXITING.append(self._proc)
        self.board.close(unlink=True)


def _lower_priority(pid: int) -> bool:
    """Run `pid` ten steps nicer than this process; False where it cannot be (not POSIX, already gone)."""
    if not hasattr(os, "setpriority"):
        return False
    try:
        os.setpriority(os.PRIO_PROCESS, pid, min(19, os.getpriority(os.PRIO_PROCESS, 0) + 10))
    except OSError:  # it exited at once: its monitor.log says why, and the link restarts it
        return False
    return True


def _cores_busy() -> bool:
    """Whether other processes keep every core busy: as many runnable now besides this one as
    there are cores, or a load average over the last minute as high (Linux's /proc/loadavg)."""
    cores = os.cpu_count() or 1
    try:
        with open("/proc/loadavg") as f:
            fields = f.read().split()
        return int(fields[3].split("/")[0]) - 1 >= cores or float(fields[0]) >= cores
    except (OSError, ValueError, IndexError):  # not Linux
        return False


def _set_idle(pid: int, idle: bool) -> bool:
    """Move `pid` into SCHED_IDLE (True) or back to the normal policy; False where it cannot be."""
    if not hasattr(os, "SCHED_IDLE"):  # not Linux
        return False
    try:
        os.sched_setscheduler(pid, os.SCHED_IDLE if idle else os.SCHED_OTHER, os.sched_param(0))
    except OSError:  # gone, or (leaving SCHED_IDLE) not permitted
        return False
    return True


_EXITING: list[subprocess.Popen] = []  # monitors signalled to stop and not reaped yet


def _reap_exited() -> None:
    # poll() reaps a child that has exited; the others stay listed (a signalled monitor exits in ~60 ms).
    _EXITING[:] = [proc for proc in _EXITING if proc.poll() is None]


def _reap(proc: subprocess.Popen, timeout: float) -> None:
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


if __name__ == "__main__":
    sys.exit(main())
