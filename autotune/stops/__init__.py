"""Every stop is a stop: signals, and a loader that stops answering.

`preemption` (SIGTERM, SIGINT, SIGHUP, SIGUSR1, `sys.exit`: checkpoint and stop), `stall` (a watchdog that
names the batch a loader is stuck on).

Owns how a run learns it must stop. May import `common`, `observe` and `memory`; the run folder, the data
pipeline and the front door import it.
Touches nothing itself: the folder's modules say what each touches.
"""
