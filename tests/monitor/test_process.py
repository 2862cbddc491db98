"""The monitor process for real: its lifecycle, what it loads, what it writes."""

import json
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from autotune.monitor.process import MonitorConfig, MonitorProcess, SampleLog
from tests.small_tmpfs import full_shm, small_shm  # noqa: F401  (fixtures)


def gone(pid):
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def wait_for(predicate, timeout):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()


def first_sample(monitor, timeout=10):
    got = []
    assert wait_for(lambda: got.append(monitor.latest()) or got[-1] is not None, timeout), "no sample arrived"
    return got[-1]


def test_samples_arrive_and_the_timeline_is_written(tmp_path):
    monitor = MonitorProcess(tmp_path, interval=0.05)
    monitor.start()
    try:
        sample, process_bytes = first_sample(monitor)
        assert sample.source in ("host", "rlimit_as", "cgroup") and sample.used_bytes > 0
        assert process_bytes > 10 * 2**20  # this test process's RSS
        time.sleep(2.3)  # past one flush
    finally:
        monitor.stop()
    lines = (tmp_path / "samples.jsonl").read_text().splitlines()
    assert len(lines) >= 10
    record = json.loads(lines[-1])
    assert record["pid"] == os.getpid() and record["device"] == "host" and record["used_bytes"] > 0
    assert not monitor.alive() and not monitor.board.path.exists()


def test_the_monitor_starts_on_idle_cores_then_runs_below_the_trainers_priority_and_stops_without_a_wait(tmp_path):
    from autotune.monitor.process import _cores_busy

    monitor = MonitorProcess(tmp_path, interval=0.05)
    monitor.start()
    try:
        if _cores_busy():  # other processes keep every core busy: no idle core to start on
            assert not monitor.idle and os.sched_getscheduler(monitor.pid) == os.SCHED_OTHER
        else:
            assert monitor.idle and os.sched_getscheduler(monitor.pid) == os.SCHED_IDLE  # its start-up
        first_sample(monitor)
        monitor.settle()  # what the link does at its first sample
        # Leaving SCHED_IDLE needs RLIMIT_NICE or CAP_SYS_NICE: without them it stays (and says so)
        policy = os.sched_getscheduler(monitor.pid)
        assert policy == (os.SCHED_IDLE if monitor.idle else os.SCHED_OTHER)
        if os.geteuid() == 0:
            assert not monitor.idle  # root may leave it: it did
        assert monitor.lowered and psutil.Process(monitor.pid).nice() == min(19, os.getpriority(os.PRIO_PROCESS, 0) + 10)
    finally:
        started = time.perf_counter()
        monitor.stop(wait=False)
        returned = time.perf_counter() - started
    assert returned < 0.03  # its exit takes ~60 ms: not waited for
    assert wait_for(lambda: not monitor.alive(), 5)  # it exits, and is reaped: no zombie left
    assert not monitor.board.path.exists()


def test_the_monitor_loads_neither_torch_nor_cuda(tmp_path):
    monitor = MonitorProcess(tmp_path, interval=0.1)
    monitor.start()
    try:
        first_sample(monitor)
        maps = open(f"/proc/{monitor.pid}/maps").read()
        assert "libtorch" not in maps and "libcuda" not in maps and "libcudart" not in maps
        assert psutil.Process(monitor.pid).memory_info().rss < 150 * 2**20
    finally:
        monitor.stop()


def test_on_cores_other_processes_keep_busy_the_monitor_starts_and_samples(tmp_path):
    # A busy loop a core, at the trainer's priority: under SCHED_IDLE the monitor would never run.
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(os.cpu_count() or 1)]
    try:
        time.sleep(0.5)
        monitor = MonitorProcess(tmp_path, interval=0.05)
        monitor.start()
        try:
            assert not monitor.idle and monitor.lowered
            first_sample(monitor)
        finally:
            monitor.stop()
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()


def test_the_monitor_dies_with_its_parent(tmp_path):
    parent = subprocess.Popen([sys.executable, "-c", f"""
import sys, time
from autotune.monitor.process import MonitorProcess
m = MonitorProcess({str(tmp_path)!r}, interval=0.1)
m.start()
print(m.pid, flush=True)
time.sleep(60)
"""], stdout=subprocess.PIPE, text=True)
    monitor_pid = int(parent.stdout.readline())
    assert wait_for(lambda: (tmp_path / "monitor.log").exists(), 5)
    time.sleep(0.5)  # let it get going
    assert not gone(monitor_pid)
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    assert wait_for(lambda: gone(monitor_pid), 2.0), "monitor outlived its parent by more than 2 s"


def test_training_survives_a_killed_monitor_and_restarts_it(tmp_path, monkeypatch):
    import torch
    from torch import nn
    from torch.utils.data import TensorDataset

    from autotune import AutoTrainer
    from autotune.tuning import monitor_link as link
    from tests.conftest import journal

    monkeypatch.setattr(link, "START_AFTER_S", 0.1)

    state = {}

    def step(model, batch):
        x, y = batch
        monitor = state["trainer"].monitor  # started once the run has trained START_AFTER_S
        if monitor is not None and not state.get("killed"):
            state["killed"] = monitor.pid
            os.kill(state["killed"], signal.SIGKILL)
        time.sleep(0.05)
        return nn.functional.cross_entropy(model(x), y)

    data = TensorDataset(torch.randn(64, 4), torch.randint(0, 2, (64,)))
    trainer = AutoTrainer(nn.Linear(4, 2), data, step_fn=step, batch_size=4, device="cpu", progress=False,
                          run_dir=tmp_path / "run", monitor_interval=0.05)
    state["trainer"] = trainer
    result = trainer.fit()
    assert result.samples_seen == 64
    restarts = [r for r in journal(tmp_path / "run") if r["kind"] == "monitor_restart"]
    assert restarts and restarts[0]["restarts"] == 1 and restarts[0]["returncode"] == -signal.SIGKILL
    assert trainer.monitor is None and gone(state["killed"])


@pytest.mark.slow
def test_memory_high_reaches_a_policy(tmp_path):
    # Under RLIMIT_AS with 64 MiB of headroom the process sits at ~98% of its cap.
    from tests.conftest import journal, run_python

    proc, _ = run_python(f"""
        import dataclasses, time, torch
        from typing import ClassVar
        from torch import nn
        from torch.utils.data import TensorDataset
        from autotune import AutoTrainer, EmptyCache, Event
        from autotune.memory.limits import cap_address_space

        decided = []

        @dataclasses.dataclass
        class Notices:
            name: ClassVar[str] = "notices"
            events: ClassVar[frozenset] = frozenset({{Event.MEMORY_HIGH}})
            def decide(self, event, snap):
                decided.append(event)
                return [EmptyCache(reason=f"memory at {{snap.sample.used_fraction:.3f}} of {{snap.sample.source}}")]
            def state_dict(self): return {{}}
            def load_state_dict(self, state): return None

        class StopOnceDecided:  # not a fixed number of steps: on a loaded machine the monitor starts late
            def on_step_end(self, trainer):
                if decided:
                    trainer.request_stop("the policy saw MEMORY_HIGH")

        def step(model, batch):
            time.sleep(0.03)
            return nn.functional.cross_entropy(model(batch[0]), batch[1])

        data = TensorDataset(torch.randn(4096, 4), torch.randint(0, 2, (4096,)))  # 30 s at the most
        trainer = AutoTrainer(nn.Linear(4, 2), data, step_fn=step, batch_size=4, device="cpu", progress=False,
                              run_dir={str(tmp_path / "run")!r}, monitor_interval=0.05, policies=[Notices()],
                              callbacks=[StopOnceDecided()])
        cap_address_space(64 * 2**20)
        trainer.fit()
    """, tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    actions = [r for r in journal(tmp_path / "run") if r["kind"] == "action" and r["event"] == "memory_high"]
    assert actions and "of rlimit_as" in actions[0]["reason"]


def test_the_timeline_has_a_size_bound(tmp_path):
    log = SampleLog(tmp_path / "samples.jsonl", max_bytes=4000)
    for i in range(300):
        log.add({"i": i, "pad": "x" * 20})
        if i % 10 == 9:
            log.flush()
    total = sum(p.stat().st_size for p in tmp_path.glob("samples*.jsonl"))
    assert total <= 4000 + 400  # the bound, plus at most one flush's worth
    last = json.loads((tmp_path / "samples.jsonl").read_text().splitlines()[-1])
    assert last["i"] == 299


def test_interval_limits():
    with pytest.raises(ValueError, match="between 0.05 and 10"):
        MonitorConfig(pid=1, board="x", samples_path=None, interval=0.01)


def test_the_monitor_starts_once_a_run_has_trained_a_while(tmp_path, monkeypatch):
    # Its start-up (~0.1 s of a core) is a fifth of a 0.5 s run on two busy cores: a run shorter
    # than START_AFTER_S never starts it; a longer one does, at its first batch past that.
    import torch
    from torch import nn
    from torch.utils.data import TensorDataset

    from autotune import AutoTrainer
    from autotune.tuning import monitor_link as link
    from tests.conftest import journal

    def fit(run_dir, seconds_per_step=0.0):
        def step(model, batch):
            time.sleep(seconds_per_step)
            return nn.functional.cross_entropy(model(batch[0]), batch[1])

        data = TensorDataset(torch.randn(64, 4), torch.randint(0, 2, (64,)))
        with AutoTrainer(nn.Linear(4, 2), data, step_fn=step, batch_size=4, device="cpu", progress=False,
                         run_dir=run_dir, monitor_interval=0.05) as trainer:
            trainer.fit()
        return [r for r in journal(run_dir) if r["kind"] == "monitor_start"]

    monkeypatch.setattr(link, "START_AFTER_S", 60.0)
    assert fit(tmp_path / "short") == []
    monkeypatch.setattr(link, "START_AFTER_S", 0.2)
    (started,) = fit(tmp_path / "long", seconds_per_step=0.05)  # 16 steps of 50 ms
    assert 2 <= started["step"] <= 8, started


def test_a_monitor_that_cannot_start_mid_run_leaves_training_going_and_says_so(tmp_path, monkeypatch, capsys):
    # It starts mid-run, maybe near a memory cap: a refused fork must not end the run.
    import errno

    import torch
    from torch import nn
    from torch.utils.data import TensorDataset

    from autotune import AutoTrainer
    from autotune.tuning import monitor_link as link
    from autotune.monitor import process
    from tests.conftest import journal

    def refused(*args, **kwargs):
        raise OSError(errno.ENOMEM, "Cannot allocate memory")

    monkeypatch.setattr(link, "START_AFTER_S", 0.0)
    monkeypatch.setattr(process.subprocess, "Popen", refused)
    data = TensorDataset(torch.randn(32, 4), torch.randint(0, 2, (32,)))
    with AutoTrainer(nn.Linear(4, 2), data, loss_fn=nn.functional.cross_entropy, batch_size=4, device="cpu",
                     progress=False, run_dir=tmp_path / "run") as trainer:
        assert trainer.fit().samples_seen == 32 and trainer.monitor is None
    (gave_up,) = [r for r in journal(tmp_path / "run") if r["kind"] == "monitor_gave_up"]
    assert gave_up["restarts"] == 0 and "could not start (OSError" in capsys.readouterr().err
    assert not [r for r in journal(tmp_path / "run") if r["kind"] == "monitor_start"]
    from autotune.monitor.board import default_path

    assert not list(default_path().parent.glob(f"autotune-{os.getpid()}-*.board"))  # its board went with it


SAMPLES_THROUGH = """
import sys, time
from pathlib import Path
from autotune.monitor.process import MonitorProcess
monitor = MonitorProcess(Path(sys.argv[1]), interval=0.05)  # its board's header is written here
monitor.start()
deadline = time.monotonic() + 10
while (got := monitor.latest()) is None and time.monotonic() < deadline:
    time.sleep(0.02)
monitor.stop()
print(got is not None and got[0].used_bytes > 0, monitor.board.path.parent, monitor.board.path.exists())
"""


def test_with_shared_memory_full_the_monitor_samples_through_a_board_in_the_run_folder(full_shm, tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    proc = subprocess.run([sys.executable, "-c", SAMPLES_THROUGH, str(run)], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-2000:])  # before: -7, SIGBUS making the board
    assert proc.stdout.split() == ["True", str(run), "False"]  # sampled by the monitor, read here; then removed
    assert "run folder instead" in proc.stderr
    assert [p.name for p in full_shm.iterdir()] == ["fill"] and not list(run.glob("*.board"))
