"""Costs of watching memory: training with the monitor on vs off, the daemon's CPU use at
10 Hz, and the latency of reading the latest sample from the shared board.

    python benchmarks/monitor.py [--rounds 9] [--seconds 20]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

import psutil
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).parent))
from common import median, write_results  # noqa: E402
from overhead import BATCH, CLASSES, FEATURES, SAMPLES, make_data, make_model  # noqa: E402

from autotune import AutoTrainer  # noqa: E402
from autotune.monitor.board import Board, default_path  # noqa: E402
from autotune.common.snapshot import DeviceSample  # noqa: E402


def train(data, monitor: bool, run_dir: Path) -> tuple[float, float]:
    """(wall time of fit, median time between consecutive steps after the first ten)."""
    stamps = []

    def step(model, batch):
        stamps.append(time.perf_counter())
        return nn.functional.cross_entropy(model(batch[0]), batch[1])

    trainer = AutoTrainer(make_model(), data, step_fn=step, optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3),
                          batch_size=BATCH, device="cpu", progress=False, monitor=monitor, run_dir=run_dir)
    start = time.perf_counter()
    trainer.fit(epochs=2)
    wall = time.perf_counter() - start
    return wall, statistics.median(b - a for a, b in zip(stamps[10:], stamps[11:]))


def monitor_start_cost(tries: int = 5) -> tuple[float, float]:
    """Median seconds from starting the monitor process to its first sample, and the CPU
    seconds its start-up took (imports), measured on the child."""
    from autotune.monitor.process import MonitorProcess

    walls, cpus = [], []
    for i in range(tries):
        monitor = MonitorProcess(Path(f"runs/bench-monitor/start{i}"), interval=0.5)
        Path(monitor.run_dir).mkdir(parents=True, exist_ok=True)
        start = time.perf_counter()
        monitor.start()
        while monitor.latest() is None:
            time.sleep(0.002)
        walls.append(time.perf_counter() - start)
        cpus.append(sum(psutil.Process(monitor.pid).cpu_times()[:2]))
        monitor.stop()
    return statistics.median(walls), statistics.median(cpus)


def daemon_cpu(seconds: float) -> float:
    """Percent of one core the daemon uses at 10 Hz, measured after its start-up."""
    proc = subprocess.Popen([sys.executable, "-m", "autotune.cli", "monitor", "--interval", "0.1", "--no-view",
                             "--out", "/dev/null", "--pid", str(psutil.Process().pid)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        time.sleep(2.0)  # imports and first samples
        watched = psutil.Process(proc.pid)
        start_cpu, start = sum(watched.cpu_times()[:2]), time.perf_counter()
        time.sleep(seconds)
        used = sum(watched.cpu_times()[:2]) - start_cpu
        return 100 * used / (time.perf_counter() - start)
    finally:
        proc.terminate()
        proc.wait()


def read_latency_us(reads: int = 200_000) -> tuple[float, float]:
    path = default_path()
    writer, reader = Board(path, create=True), Board(path)
    writer.write(DeviceSample(time=time.time(), used_bytes=1, cap_bytes=2, total_bytes=2, source="host"), 1, 1)
    timings = []
    for _ in range(20):
        start = time.perf_counter()
        for _ in range(reads // 20):
            reader.read()
        timings.append((time.perf_counter() - start) / (reads // 20) * 1e6)
    writer.close(unlink=True)
    reader.close()
    return statistics.median(timings), max(timings)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--seconds", type=float, default=20.0)
    args = parser.parse_args()
    data = make_data()
    runs = Path("runs/bench-monitor")
    train(data, True, runs / "warm-on")
    train(data, False, runs / "warm-off")
    on, off = [], []
    for r in range(args.rounds):
        for monitor in ((True, False) if r % 2 == 0 else (False, True)):
            (on if monitor else off).append(train(data, monitor, runs / f"{r}-{monitor}"))
        print(f"round {r}: on {on[-1]} off {off[-1]}", file=sys.stderr)
    step_on, step_off = median([s for _, s in on]), median([s for _, s in off])
    wall_on, wall_off = median([w for w, _ in on]), median([w for w, _ in off])
    start_wall, start_cpu = monitor_start_cost()
    cpu = daemon_cpu(args.seconds)
    read_median, read_max = read_latency_us()
    lines = [
        f"Training: MLP {FEATURES}-1024-1024-{CLASSES}, AdamW, {SAMPLES} samples x 2 epochs, batch {BATCH}, CPU, "
        f"{args.rounds} alternating rounds; monitor at its default 0.5 s interval.", "",
        "| measure | value | target |", "| --- | --- | --- |",
        f"| step time, monitor on / off (median interval between steps) | {step_on * 1e3:.2f} ms / "
        f"{step_off * 1e3:.2f} ms = {step_on / step_off:.3f} | <= 1.01 |",
        f"| whole fit (2 epochs, ~{wall_off:.1f} s), monitor on / off | {wall_on / wall_off:.3f} | (start-up included) |",
        f"| monitor start-up, once per fit: to first sample; its CPU | {start_wall * 1e3:.0f} ms; {start_cpu:.2f} s of "
        "a core | |",
        f"| daemon CPU at 10 Hz (host + 1 pid, JSONL), over {args.seconds:.0f} s | {cpu:.2f}% of a core | < 2% |",
        f"| latest-sample read from the board (median of 20 batches; worst batch) | {read_median:.2f} us; "
        f"{read_max:.2f} us | microseconds |",
        "", "Per-round step-time ratios (on / off): " + ", ".join(f"{a[1] / b[1]:.3f}" for a, b in zip(on, off)),
    ]
    write_results("monitor", "Monitor: cost on training, daemon CPU, read latency (CPU)", lines)


if __name__ == "__main__":
    main()
