"""limits.py's calibration with real OOMs under RLIMIT_AS, each in a fresh interpreter with one
malloc arena (as the demo and the examples calibrate): the probes allocate what their size says
(MiB), so what fits is known, and the calibration's probes are counted."""

from tests.conftest import run_python

MiB = 2**20

QUICK = """
import torch
from autotune.memory.limits import calibrate_headroom
calls = []
def probe(size):
    # After the whole batch's failure the quarter needs GROWN MiB more (a failed probe leaves the heap otherwise).
    grown = GROWN if 128 in calls else 0
    calls.append(size)
    torch.ones((size + grown) * 2**20 // 4)  # allocated and written: its pages are the process's
c = calibrate_headroom(probe, fits=32, fails=128, quick=True)
save({"calls": calls, "headroom": c.headroom_bytes, "fits": c.fits_bytes, "fails": c.fails_bytes, "reason": c.reason})
"""


def quick_calibration(tmp_path, grown: int) -> dict:
    proc, result = run_python(f"GROWN = {grown}\n" + QUICK, tmp_path)
    assert proc.returncode == 0 and result is not None, proc.stderr[-3000:]
    return result


def test_the_quick_calibration_probes_the_whole_batch_once_where_the_quarter_needs_a_little_more_after_it(tmp_path):
    # 3 MiB more: as much as two bisections of one need can differ (a step of their 2 MiB grid and
    # a page). The quick path asked for no growth at all and fell through to bisecting the whole
    # batch as well, half the time (the demo's ResNet-18: 19 more probes, a minute).
    result = quick_calibration(tmp_path, grown=3)
    assert result["calls"].count(128) == 1, result
    assert "does not run under" in result["reason"], result
    # Two margins (12 MiB each) above what the quarter needs after the failure (35 MiB and a page or two).
    assert 35 * MiB <= result["fits"] <= 40 * MiB and result["headroom"] == result["fits"] + 24 * MiB, result


def test_the_quick_calibration_bisects_both_where_the_quarter_grew_by_more_than_a_margin(tmp_path):
    # 30 MiB more: a headroom two margins above it would sit too close to where the whole batch
    # failed, so both are bisected and the headroom is their middle.
    result = quick_calibration(tmp_path, grown=30)
    assert result["calls"].count(128) > 1 and "does not run under" not in result["reason"], result
    assert result["fits"] < result["headroom"] < result["fails"], result


def test_the_quarter_measured_again_as_it_was_takes_two_probes_not_a_bisection(tmp_path):
    # Its need unchanged after the failure: checked where it was (it runs there, not 2 MiB below), where a
    # bisection under the ceiling took eight more (14 s of the demo's ResNet-18). No run under the ceiling
    # first: what runs where it was runs there too (3 s more of the demo's, once).
    result = quick_calibration(tmp_path, grown=0)
    after = result["calls"][result["calls"].index(128) + 1:]
    assert after == [32, 32], result
    assert "does not run under" in result["reason"] and result["headroom"] == result["fits"] + 24 * MiB, result



def test_a_resolution_of_zero_or_less_is_named_not_looped_on():
    import pytest

    from autotune.memory.limits import least_headroom

    for bad in (0, -1, 1.5):
        with pytest.raises(ValueError, match="resolution_bytes must be an integer between 1 and high_bytes"):
            least_headroom(lambda: None, 2**30, bad)  # 0 looped forever, -1 answered a negative headroom
