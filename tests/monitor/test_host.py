import os
import signal
import subprocess
import sys
import time

import psutil

from autotune.monitor.host import cgroup_memory, descendants, host_sample, parse_proc_cgroup, rss_bytes
from autotune.common.units import format_bytes
from tests.conftest import run_python


def test_rss_counts_this_process():
    assert rss_bytes() > 10 * 2**20


def test_rss_rises_when_a_child_allocates():
    before = rss_bytes(os.getpid())
    child = subprocess.Popen([sys.executable, "-c",
                              "import sys; b = bytearray(300 * 2**20); print('ready', flush=True); sys.stdin.read()"],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ready"
        with_child = rss_bytes(os.getpid())
        alone = rss_bytes(os.getpid(), children=False)
        assert with_child - before > 250 * 2**20
        assert with_child - alone > 250 * 2**20
        assert rss_bytes(os.getpid(), exclude=child.pid) - before < 100 * 2**20
    finally:
        child.communicate("")


def test_descendants_are_children_and_grandchildren_as_psutil_sees_them():
    # A shell with two children of its own, and a child started from another thread of this process.
    import threading

    shell = subprocess.Popen(["bash", "-c", "sleep 30 & sleep 30 & wait"], start_new_session=True)
    from_thread = []
    thread = threading.Thread(target=lambda: from_thread.append(subprocess.Popen(["sleep", "30"])))
    thread.start()
    thread.join()
    try:
        # Only these subtrees: the test process may have other children coming and going (monitors exiting).
        for _ in range(100):  # until the shell has started its two
            if len(psutil.Process(shell.pid).children()) == 2:
                break
            time.sleep(0.02)
        expected = {c.pid for c in psutil.Process(shell.pid).children(recursive=True)}
        assert len(expected) == 2 and set(descendants(shell.pid)) == expected
        assert {shell.pid, from_thread[0].pid} | expected <= set(descendants(os.getpid()))
    finally:
        os.killpg(shell.pid, signal.SIGKILL)  # the shell and its two
        for proc in (shell, *from_thread):
            proc.kill()
            proc.wait()


def test_the_tightest_cap_is_reported():
    sample = host_sample(soft_cap_bytes=rss_bytes() + 2**20)  # 1 MiB of headroom: surely the tightest
    assert sample.source == "memory_cap" and sample.cap_bytes - sample.used_bytes <= 2**20 + 2**22


def test_rlimit_as_is_seen_when_set(tmp_path):
    proc, result = run_python("""
        from autotune.memory.limits import cap_address_space
        from autotune.monitor.host import host_sample
        cap = cap_address_space(200 * 2**20)
        s = host_sample()
        save({"cap": cap, "source": s.source, "sample_cap": s.cap_bytes, "used": s.used_bytes})
    """, tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert result["source"] == "rlimit_as" and result["sample_cap"] == result["cap"]
    assert result["cap"] - result["used"] <= 200 * 2**20


def test_rlimit_of_another_process_is_read(tmp_path):
    child = subprocess.Popen([sys.executable, "-c", "import resource, sys; "
                              "resource.setrlimit(resource.RLIMIT_AS, (2**36, resource.RLIM_INFINITY)); "
                              "print('ready', flush=True); sys.stdin.read()"],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ready"
        sample = host_sample(pid=child.pid)
        assert sample.used_bytes is not None
        from autotune.monitor.host import rlimit_as_bytes
        assert rlimit_as_bytes(child.pid) == 2**36
    finally:
        child.communicate("")


def test_cgroup_v2_files(tmp_path):
    group = tmp_path / "user.slice" / "job"
    group.mkdir(parents=True)
    (group / "memory.current").write_text("123456\n")
    (group / "memory.max").write_text("1000000\n")
    files = parse_proc_cgroup("0::/user.slice/job\n", root=tmp_path)
    assert files == (group / "memory.current", group / "memory.max")


def test_cgroup_limit_files_read_max_as_no_limit(tmp_path):
    from autotune.monitor.host import _read_int

    (tmp_path / "memory.max").write_text("max\n")
    (tmp_path / "memory.limit_in_bytes").write_text("9223372036854771712\n")  # v1's "no limit"
    (tmp_path / "memory.current").write_text("5\n")
    assert _read_int(tmp_path / "memory.max") is None
    assert _read_int(tmp_path / "memory.limit_in_bytes") is None
    assert _read_int(tmp_path / "memory.current") == 5
    assert _read_int(tmp_path / "missing") is None


def test_cgroup_v1_files(tmp_path):
    (tmp_path / "memory").mkdir()
    files = parse_proc_cgroup("12:cpu,cpuacct:/x\n11:memory:/docker/abc\n", root=tmp_path)
    # the group's own folder is absent (a container sees its group at the root)
    assert files == (tmp_path / "memory" / "memory.usage_in_bytes", tmp_path / "memory" / "memory.limit_in_bytes")


def test_this_machine_cgroup_is_read_or_not_available():
    current, limit = cgroup_memory()
    assert current is None or current > 0
    assert limit is None or limit > 0


def test_format_bytes():
    assert format_bytes(None) == "n/a"
    assert format_bytes(512) == "512 B"
    assert format_bytes(3 * 2**30 // 2) == "1.5 GiB"
    assert format_bytes(5 * 2**40) == "5.0 TiB"
