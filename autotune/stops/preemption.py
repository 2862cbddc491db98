"""Stop signals during `fit()`: finish the step, checkpoint, exit 128 + the signal's number.

Schedulers, terminals and launchers stop a process with a signal: SIGTERM (Slurm, Kubernetes,
systemd, spot instances, `kill`), SIGINT (Ctrl-C), SIGHUP (a closed terminal or ssh session),
SIGUSR1 (Slurm's `--signal=USR1@T`). While a fit runs, the first of the trainer's stop signals
(`stop_signals`: those four by default) only raises a flag; the loop sees it after the current
optimizer step, writes a checkpoint and raises `Preempted`. While the loop waits for a batch
(`interrupts()` says so: stall.py), the handler raises `StoppedWhileWaiting` instead, so a loader
that never answers does not hold the stop.

A stop under way is not abandoned. A repeated signal (a launcher forwarding to a process group
sends one more, a person presses Ctrl-C twice) is said on stderr and ignored, during the step and
while the checkpoint is written; only a third Ctrl-C aborts at once (`KeyboardInterrupt`, no
checkpoint), for a person at a terminal who insists. Once `Preempted` leaves the fit, SIGTERM,
SIGHUP and SIGUSR1 are ignored until the process has exited (a repeat cannot cut the exit
short); a later fit puts them back. A signal the process ignores when the fit starts (SIG_IGN:
`nohup` ignores SIGHUP) stays ignored.

The loader's workers share the trainer's process group, and often its cgroup, so a group's
signal reaches them too (`kill -- -PGID`, scancel, systemctl stop). The workers of the loader
autotune builds ignore the stop signals (`WorkerStops`): they keep serving the batch in hand,
and the trainer stops them after its checkpoint. A worker of a DataLoader the user built dies of
a SIGTERM (torch's handler ends it); its death, which torch's SIGCHLD handler raises as an
error, is read as that stop (`StopRequests._child_ended`), and an error of the loader while a
stop is under way is the stop too (batch_in_hand.py).

Owns: the stop signals' handlers while a fit runs (put back after), SIGCHLD's (torch's, wrapped)
meanwhile, and the stop signals' handlers in the workers of the loader autotune builds. Touches
nothing else.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import os
import platform
import signal
import sys
import threading
from multiprocessing.sharedctypes import RawValue
from types import FrameType
from typing import Any, Callable, Iterator, Sequence

from autotune.common.notices import warn
from autotune.common.stale import die_with_parent
from autotune.stops.stall import StoppedWhileWaiting

DEFAULT_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1)
ABORT_AFTER_SIGINTS = 3  # Ctrl-C pressed this often in one stop aborts at once
# Not requests to stop: uncatchable, faults a handler would return into, or the workers' deaths.
_REFUSED = {"SIGKILL": "it cannot be caught", "SIGSTOP": "it cannot be caught",
            "SIGCHLD": "it says a child process ended (torch's DataLoader watches it)",
            **{name: "it is a fault, not a request to stop" for name in
               ("SIGSEGV", "SIGBUS", "SIGFPE", "SIGILL", "SIGABRT", "SIGTRAP", "SIGSYS")}}


class Preempted(SystemExit):
    """Training stopped on a signal after writing a checkpoint. Exit code 128 + signal number
    (143 for SIGTERM, 130 for SIGINT, 129 for SIGHUP, 138 for SIGUSR1), as shells and schedulers
    expect."""

    def __init__(self, signum: int, message: str):
        super().__init__(128 + signum)
        self.signum = signum
        self.message = message

    def __str__(self) -> str:
        return self.message


def stop_signals(value: Any) -> tuple[signal.Signals, ...]:
    """`AutoTrainer(stop_signals=...)` checked: None (the default four), one signal or a sequence
    of them, each a `signal.Signals`, its number or its name ("SIGUSR2" or "USR2"); () for none."""
    if value is None:
        return DEFAULT_STOP_SIGNALS
    items = [value] if isinstance(value, (str, int)) else value
    try:
        items = list(items)
    except TypeError:
        raise TypeError(f"stop_signals={value!r}: pass signal names or numbers, e.g. ['SIGTERM', 'SIGUSR1']") from None
    found: list[signal.Signals] = []
    for item in items:
        sig = _one_signal(item, value)
        if sig.name in _REFUSED:
            raise ValueError(f"stop_signals: {sig.name} cannot be a stop signal: {_REFUSED[sig.name]}")
        if sig not in found:
            found.append(sig)
    return tuple(found)


def _one_signal(item: Any, given: Any) -> signal.Signals:
    if isinstance(item, str):
        name = item.strip().upper()
        name = name if name.startswith("SIG") else "SIG" + name
        if name in signal.Signals.__members__:
            return signal.Signals[name]
        raise ValueError(f"stop_signals: {item!r} is not a signal's name here (e.g. 'SIGTERM', 'SIGUSR1')")
    if isinstance(item, int) and not isinstance(item, bool):
        try:
            return signal.Signals(item)
        except ValueError:
            raise ValueError(f"stop_signals: {item} is not a signal number with a name here") from None
    raise TypeError(f"stop_signals={given!r}: {item!r} is neither a signal's name nor its number")


def _say(message: str) -> None:
    # From a signal handler: one write(2), not `warn`, whose buffered stderr may be mid-write in the
    # interrupted code (a reentrant write raises, and would abandon the checkpoint being written).
    if os.environ.get("RANK", "0") != "0" or not logging.getLogger("autotune").isEnabledFor(logging.WARNING):
        return
    with contextlib.suppress(OSError):
        os.write(2, f"autotune: {message}\n".encode())


def _after_stop(signum: int, frame: FrameType | None) -> None:
    """A stop signal once `Preempted` has left the fit: the process is on its way out; nothing to do."""


_BEFORE_STOP: dict[int, Any] = {}  # the handlers `_after_stop` stands in for, put back by a later fit


class StopRequests:
    """The stop signals' handlers for the duration of a `with` block (main thread only); a
    trainer keeps one and enters it for each fit. `interrupts()`: whether the loop is in a wait
    the first signal should unwind."""

    def __init__(self, signals: Sequence[int] = DEFAULT_STOP_SIGNALS,
                 interrupts: Callable[[], bool] | None = None) -> None:
        self.signals = tuple(signals)
        self.interrupts = interrupts
        self.signum: int | None = None  # the stop signal this fit received first
        self.repeats = 0  # those received after it
        self._sigints = 0
        self._pid: int | None = None  # the process that installed the handlers (not a forked worker)
        self._previous: dict[int, Any] = {}
        self._child_previous: Any = None

    def pending(self) -> int | None:
        """The stop signal received in this fit, if any."""
        return self.signum

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if os.getpid() != self._pid:
            return  # a forked loader worker inherited the handler: its trainer acts on the stop
        self._sigints += signum == signal.SIGINT
        if self.signum is None:
            self.signum = signum
            if self.interrupts is not None and self.interrupts():
                raise StoppedWhileWaiting(signum)  # out of the blocked fetch (PEP 475 retries it otherwise)
            return
        self.repeats += 1
        if self._sigints >= ABORT_AFTER_SIGINTS:
            raise KeyboardInterrupt
        if self.repeats == 1:
            _say(f"{signal.Signals(signum).name} again: the stop goes on (a checkpoint of the last completed step, "
                 f"then exit {128 + self.signum}); Ctrl-C {ABORT_AFTER_SIGINTS} times aborts at once, without it")

    def _child_ended(self, signum: int, frame: FrameType | None) -> None:
        # torch's SIGCHLD handler raises where a loader worker died of a signal. Killed by a stop
        # signal, it was stopped with this process (its group, its cgroup): that stop, not a failure,
        # whether this process's own signal came first or not. (A death torch's shutdown reaps before
        # this runs, which may be late where another thread took the signal, is not seen at all.)
        try:
            if callable(self._child_previous):
                self._child_previous(signum, frame)
        except RuntimeError as exc:
            stop = next((sig for sig in self.signals if f"killed by signal: {signal.strsignal(sig)}" in str(exc)), None)
            if stop is None or os.getpid() != self._pid:
                raise
            if self.signum is None:  # else the stop under way reached the worker too: nothing more to do
                self._handle(stop, frame)

    def __enter__(self) -> "StopRequests":
        self.signum, self.repeats, self._sigints = None, 0, 0
        if threading.current_thread() is not threading.main_thread():
            return self
        self._pid = os.getpid()
        for sig in self.signals:
            current = signal.getsignal(sig)
            if current is _after_stop:
                current = _BEFORE_STOP.pop(sig, signal.SIG_DFL)
            elif current == signal.SIG_IGN:
                continue  # ignored on purpose (nohup)
            elif current is None or (current == signal.SIG_DFL and _handled_outside_python(sig)):
                warn(f"{signal.Signals(sig).name} has a handler set outside Python's signal module (faulthandler."
                     "register?): it is left to it, so it does not stop a fit with a checkpoint; leave it out of "
                     "stop_signals to say so", key=f"foreign handler {sig}")
                continue
            signal.signal(sig, self._handle)
            self._previous[sig] = current
        if self._previous:
            _torch_watches_workers()  # before ours wraps it (installed later, it would wrap ours)
            if signal.getsignal(signal.SIGCHLD) is not None:  # else set outside Python: it could not be put back
                self._child_previous = signal.signal(signal.SIGCHLD, self._child_ended)
        return self

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        leaving = self.signum is not None and isinstance(exc, SystemExit)  # stopped: the process is exiting
        for sig, previous in self._previous.items():
            if leaving and sig != signal.SIGINT and previous == signal.SIG_DFL:
                _BEFORE_STOP[sig] = previous
                signal.signal(sig, _after_stop)
            else:
                signal.signal(sig, previous)
        if self._child_previous is not None:
            signal.signal(signal.SIGCHLD, self._child_previous)
        self._previous.clear()
        self._child_previous = None


def _handled_outside_python(sig: int) -> bool:
    # Python's record says SIG_DFL, the kernel's says a handler (faulthandler.register's): taking the
    # signal over would lose it, as only SIG_DFL could be put back. Linux (glibc's struct sigaction
    # begins with the handler; not on MIPS); elsewhere it is not looked at.
    if not sys.platform.startswith("linux") or platform.machine().lower().startswith("mips"):
        return False
    action = ctypes.create_string_buffer(256)
    if ctypes.CDLL(None, use_errno=True).sigaction(int(sig), None, action) != 0:
        return False
    return ctypes.c_void_p.from_buffer(action).value not in (None, 1)  # SIG_DFL is 0, SIG_IGN 1


def _torch_watches_workers() -> None:
    try:
        from torch.utils.data._utils.signal_handling import _set_SIGCHLD_handler
    except ImportError:  # another torch: its handler, if any, is installed later and ours is not reached
        return
    _set_SIGCHLD_handler()


class WorkerStops:
    """The stop signals in the workers of the loader autotune builds (`worker_init_fn`). A group's
    signal reaches them too: they ignore it and keep serving the batch in hand, since the trainer
    acts on it and stops them after its checkpoint. While it stops them (`stopping()`), a signal
    (torch's `terminate()` sends SIGTERM to a worker that did not end in time) ends them, as
    torch's own handler would."""

    def __init__(self, signals: Sequence[int] = DEFAULT_STOP_SIGNALS) -> None:
        self.signals = tuple(int(sig) for sig in signals)
        self._stopping: Any = None  # a shared flag the workers read, made with the first workers

    def worker_init_fn(self) -> Callable[[int], None]:
        """The `worker_init_fn` of a DataLoader built here: the workers die with their trainer
        (stale.py) and ignore the stop signals until it stops them."""
        if self._stopping is None:
            self._stopping = RawValue(ctypes.c_bool, False)
        return functools.partial(_worker_init, os.getpid(), self.signals, self._stopping)

    @contextlib.contextmanager
    def stopping(self) -> Iterator[None]:
        """Around the trainer's shutdown of its workers: a stop signal then ends a worker."""
        if self._stopping is None:
            yield
            return
        self._stopping.value = True
        try:
            yield
        finally:
            self._stopping.value = False


def _worker_init(parent: int, signals: tuple[int, ...], stopping: Any, worker_id: int) -> None:
    die_with_parent(parent, worker_id)
    ignore = functools.partial(_in_worker, stopping)
    for sig in signals:
        if signal.getsignal(sig) != signal.SIG_IGN:  # nohup's stays as the trainer had it
            signal.signal(sig, ignore)


def _in_worker(stopping: Any, signum: int, frame: FrameType | None) -> None:
    # A Python handler, not SIG_IGN: a program the dataset starts gets the default back at exec.
    if stopping.value:
        os._exit(0)
