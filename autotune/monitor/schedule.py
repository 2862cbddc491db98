"""Run sampling jobs on a timer until asked to stop: the monitor process and the daemon share it.

APScheduler's BlockingScheduler runs the jobs in one worker thread. Stopping is a flag: a
signal handler only sets it, and another thread shuts the scheduler down. Calling `shutdown()`
from the handler itself could deadlock, because the handler runs on the main thread, which may
be inside the scheduler holding a lock (a job submit) that shutdown needs.

Owns: the scheduler thread and the stop flag. Touches nothing else.
"""

from __future__ import annotations

import logging
import signal
import threading
from typing import Callable, Sequence

STOP_POLL_SECONDS = 0.25  # the backstop for a request made before the scheduler started


def stop_on_signals(stop: threading.Event) -> None:
    """SIGTERM and SIGINT set `stop` (and do nothing else: see the module docstring)."""
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())


def run_until_stopped(jobs: Sequence[tuple[str, Callable[[], None], float]], stop: threading.Event) -> None:
    """Run each `(name, function, every_seconds)` on its interval until `stop` is set."""
    from apscheduler.executors.pool import ThreadPoolExecutor
    from apscheduler.schedulers import SchedulerNotRunningError
    from apscheduler.schedulers.blocking import BlockingScheduler

    logging.getLogger("apscheduler").setLevel(logging.ERROR)  # no per-run "Running job" lines
    # One worker: jobs never overlap; a slow one is coalesced, not queued up.
    scheduler = BlockingScheduler(executors={"default": ThreadPoolExecutor(1)},
                                  job_defaults={"coalesce": True, "max_instances": 1, "misfire_grace_time": None})

    def shut_down() -> None:  # in a thread of its own or the worker, never in a signal handler
        try:
            scheduler.shutdown(wait=False)
        except SchedulerNotRunningError:
            return  # asked before start(): the polling job below acts once it runs

    def shut_down_if_requested() -> None:
        if stop.is_set():
            shut_down()

    def shut_down_when_asked() -> None:  # at once (the monitor's owner waits for it to exit), no fast polling
        stop.wait()
        shut_down()

    threading.Thread(target=shut_down_when_asked, name="autotune-stop", daemon=True).start()
    scheduler.add_job(shut_down_if_requested, "interval", seconds=STOP_POLL_SECONDS, id="stop")
    for name, function, seconds in jobs:
        scheduler.add_job(function, "interval", seconds=seconds, id=name)
    if not stop.is_set():  # a request that came while setting up: no need to start
        scheduler.start()  # blocks until shut_down() is called
