"""The monitor process: device and host memory sampled beside the run, and `autotune monitor`.

`host` (the host's figures: RSS, cgroup v2, MemAvailable, RLIMIT_AS), `nvml` (the only `import pynvml`),
`board` (the shared-memory board samples travel on), `process` (the monitor process, started with spawn),
`schedule` (its jobs' scheduler, APScheduler), `daemon` (`autotune monitor`). The trainer's side of the
link is `autotune.tuning.monitor_link`.

Owns sampling. Never imports torch (the monitor process must not initialise CUDA: a contract in
pyproject.toml holds it); may import `common` and `observe`; memory and everything above may import it.
Touches nothing itself: the folder's modules say what each touches.
"""
