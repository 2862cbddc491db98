from autotune.monitor.host import host_sample, rss_bytes
from autotune.units import format_bytes
from tests.conftest import run_python


def test_rss_counts_this_process():
    assert rss_bytes() > 10 * 2**20


def test_the_tightest_cap_is_reported():
    sample = host_sample(soft_cap_bytes=rss_bytes() + 2**20)  # 1 MiB of headroom: surely the tightest
    assert sample.source == "memory_cap" and sample.cap_bytes - sample.used_bytes <= 2**20 + 2**22


def test_rlimit_as_is_seen_when_set(tmp_path):
    proc, result = run_python("""
        from autotune.limits import cap_address_space
        from autotune.monitor.host import host_sample
        cap = cap_address_space(200 * 2**20)
        s = host_sample()
        save({"cap": cap, "source": s.source, "sample_cap": s.cap_bytes, "used": s.used_bytes})
    """, tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert result["source"] == "rlimit_as" and result["sample_cap"] == result["cap"]
    assert result["cap"] - result["used"] <= 200 * 2**20


def test_format_bytes():
    assert format_bytes(None) == "n/a"
    assert format_bytes(512) == "512 B"
    assert format_bytes(3 * 2**30 // 2) == "1.5 GiB"
    assert format_bytes(5 * 2**40) == "5.0 TiB"
