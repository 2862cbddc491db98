"""The trainer's side of the monitor: start and stop the process, read its newest sample
between steps, keep it alive, and turn samples and allocator figures into events.

Owns the monitor process, the recent-sample window and the memory detector. Touches no
training state; what it sees goes out as events (MEMORY_HIGH, MEMORY_PRESSURE) and samples.
Imports torch (through autotune.memory.figures): the monitor process itself (process.py) does not.
"""

from __future__ import annotations

import collections
import time
from pathlib import Path

import torch

from autotune.common.events import Event
from autotune.common.notices import warn
from autotune.common.snapshot import AllocatorStats, DeviceSample
from autotune.decisions.detectors import MemoryDetector
from autotune.memory.figures import cuda_uuid, device_sample
from autotune.monitor.process import MonitorProcess
from autotune.observe.journal import Journal
from autotune.observe.records import Kind

# The monitor process starts once a run has trained this long. Its start-up (an interpreter and
# its imports) takes ~0.1 s of a core, which on two busy cores is a fifth of a 0.5 s run; a run
# that short has its memory read in-process at its measured steps and never needed the monitor.
START_AFTER_S = 1.0


class MonitorLink:
    """The monitor process of one trainer (none on ranks other than 0, or with `enabled=False`)."""

    def __init__(self, run_dir: Path, device: torch.device, *, enabled: bool, interval: float,
                 cap_bytes: int | None, journal: Journal):
        self.run_dir, self.device = run_dir, device
        self.enabled, self.interval, self.cap_bytes = enabled, interval, cap_bytes
        self.journal = journal
        self.process: MonitorProcess | None = None
        self.detector = MemoryDetector()
        self.window: collections.deque[DeviceSample] = collections.deque(maxlen=20)
        self._own: tuple[float, DeviceSample] | None = None  # (monotonic time, an in-process reading)
        self._heard_at = 0.0  # monotonic time of its last sample, or of the last look at whether it lives
        self._start_at: float | None = None  # monotonic time the process is due to start (`start`)

    def start(self, step: int, epoch: int) -> None:
        """At a run's start: the process starts at the first batch `START_AFTER_S` later (`watch`)."""
        if self.enabled and self.process is None and self._start_at is None:
            self._start_at = time.monotonic() + START_AFTER_S

    def _due(self) -> bool:
        return self._start_at is not None and time.monotonic() >= self._start_at

    def _launch(self, step: int, epoch: int) -> None:
        # Mid-run, maybe near a memory cap: a start that fails (a refused fork, its shared board) leaves
        # training to go on without samples, said so, as when the monitor's restarts are spent.
        self._start_at = None
        process = None
        try:
            process = MonitorProcess(self.run_dir, interval=self.interval, gpu_uuid=cuda_uuid(self.device),
                                     cap_bytes=self.cap_bytes)
            process.start()
        except (OSError, MemoryError) as exc:
            if process is not None:
                process.board.close(unlink=True)
            self.journal.write(Kind.MONITOR_GAVE_UP, step, epoch, returncode=None, restarts=0, pid=None)
            warn(f"the monitor process could not start ({type(exc).__name__}: {exc}); training goes on without "
                 "memory samples", error=True)
            return
        self.process = process
        self.journal.write(Kind.MONITOR_START, step, epoch, pid=self.process.pid, interval=self.interval,
                           board=str(self.process.board.path))

    def stop(self, wait: bool = True) -> None:
        """Stop the monitor; `wait=False` does not wait for its exit (see MonitorProcess.stop)."""
        self._start_at = None
        if self.process is not None:
            self.process.stop(wait=wait)
            self.process = None

    def watch(self, allocator: AllocatorStats | None, step: int, epoch: int) -> list[Event]:
        """Between steps: take the monitor's newest sample (microseconds, never blocks), keep the
        monitor alive, and return what the detectors see. Between two samples (most steps) this
        is one read of the board's sequence number; whether the process lives is asked (a
        waitpid) only when no sample came for an interval."""
        events = []
        if self.process is None and self._due():
            self._launch(step, epoch)
        elif self.process is not None:
            got = self.process.latest()
            if got is not None:
                self._heard_at = time.monotonic()
                self.process.settle()  # started: its sampling gets a share of the cores from now on
                sample = got[0]
                if sample.used_bytes is None and self.device.type == "cuda":
                    # NVML not available here: CUDA's own figure, read in-process, stands in.
                    sample = device_sample(self.device, self.cap_bytes)
                self.window.append(sample)
                events += self.detector.on_sample(sample)
            elif self._silent():
                self._heard_at = time.monotonic()
                if not self.process.alive():
                    self._died(step, epoch)
        events += self.detector.on_step(allocator, self.window[-1] if self.window else None)
        return events

    def news(self) -> bool:
        """Whether `watch` may have something to say without allocator figures: a sample came,
        or none came for an interval (is the process alive?), or the process is due to start.
        Most steps: no."""
        process = self.process
        if process is None:
            return self._due()
        return process.board.changed() or self._silent()

    def _silent(self) -> bool:
        # No sample for an interval: whether the process lives is worth a look (a waitpid).
        return time.monotonic() - self._heard_at >= self.interval

    def _died(self, step: int, epoch: int) -> None:
        # Training goes on without it; the journal and the log say so.
        code = self.process.returncode
        restarted = self.process.restart()
        self.journal.write(Kind.MONITOR_RESTART if restarted else Kind.MONITOR_GAVE_UP, step, epoch,
                           returncode=code, restarts=self.process.restarts, pid=self.process.pid)
        if restarted:
            warn(f"the monitor process exited (code {code}); restarted it ({self.process.restarts}/"
                 f"{self.process.max_restarts})")
        else:
            warn(f"the monitor process exited (code {code}) and its restarts are spent; training "
                 "goes on without memory samples", error=True)
            self.stop()

    def latest(self, fresh: bool = False) -> DeviceSample:
        """The newest sample; read in-process where the moment matters (an OOM), or when no monitor
        sample is there (none runs, or its first has not come) at most once per `interval`: a host
        reading walks the process's children in /proc, milliseconds that a ~1 ms step must not pay."""
        if self.window and not fresh:
            return self.window[-1]
        now = time.monotonic()
        if fresh or self._own is None or now - self._own[0] >= self.interval:
            self._own = (now, device_sample(self.device, self.cap_bytes))
        return self._own[1]
