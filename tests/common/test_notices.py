"""What a user must know reaches stderr by default, once per cause, rank 0 only; the level is one
switch (AUTOTUNE_VERBOSITY, autotune.set_verbosity). Each case is a fresh interpreter: the
library's logger is configured once per process."""

import subprocess
import sys

import pytest

SCRIPT = """
from autotune.common.notices import warn, info
warn("a failed checkpoint", key="ckpt")
warn("a failed checkpoint, again", key="ckpt")  # the same cause: said once
warn("an unsafe resume")
info("a detail")
"""


def run(code, **env):
    import os
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          env={**{k: v for k, v in os.environ.items() if k not in ("RANK", "AUTOTUNE_VERBOSITY")},
                               **env})


def test_warnings_reach_stderr_by_default_once_per_cause_and_info_stays_quiet():
    proc = run(SCRIPT)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.splitlines() == ["autotune: a failed checkpoint", "autotune: an unsafe resume"]
    assert proc.stdout == ""


def test_only_rank_zero_speaks_under_torchrun():
    assert run(SCRIPT, RANK="1").stderr == ""
    assert run(SCRIPT, RANK="0").stderr.count("autotune:") == 2


def test_what_only_one_rank_knows_is_said_on_that_rank():
    # A stalled loader (stall.py) is rarely rank 0's: its peers only wait for it.
    code = "from autotune.common.notices import warn\nwarn('rank 1: no batch for 31 s', every_rank=True)\n"
    assert run(code, RANK="1").stderr == "autotune: rank 1: no batch for 31 s\n"


@pytest.mark.parametrize("level, lines", [("error", 0), ("warning", 2), ("info", 3), ("debug", 3)])
def test_one_environment_variable_sets_the_level(level, lines):
    assert run(SCRIPT, AUTOTUNE_VERBOSITY=level).stderr.count("autotune:") == lines


def test_set_verbosity_overrides_the_environment_and_names_a_bad_level():
    proc = run("import autotune\nautotune.set_verbosity('error')\n" + SCRIPT, AUTOTUNE_VERBOSITY="info")
    assert proc.stderr == ""
    proc = run("import autotune\nautotune.set_verbosity('loud')")
    assert "verbosity must be one of error, warning, info, debug, got 'loud'" in proc.stderr
    proc = run(SCRIPT, AUTOTUNE_VERBOSITY="loud")
    assert "AUTOTUNE_VERBOSITY='loud' is not one of" in proc.stderr


def test_the_command_line_shows_each_warning_once_in_its_own_format():
    proc = run("from autotune import notices\nfrom loguru import logger\nimport sys\n"
               "logger.remove(); logger.add(sys.stderr, format='{level} {message}'); logger.enable('autotune')\n"
               "notices.show_through_loguru()\n" + SCRIPT)
    assert proc.stderr.splitlines() == ["WARNING a failed checkpoint", "DEBUG a failed checkpoint, again",
                                        "WARNING an unsafe resume", "INFO a detail"]


def test_a_warning_under_a_progress_bar_starts_a_line_of_its_own():
    # The OOM line was glued onto tqdm's bar ("...it/s]autotune: ..."): written through tqdm, the bar is
    # cleared first and drawn again below it.
    code = ("from tqdm import tqdm\nfrom autotune.common.notices import warn\nimport sys\n"
            "bar = tqdm(total=10, file=sys.stderr, ascii=True, mininterval=0)\nbar.update(3)\n"
            "warn('an OOM survived')\nbar.update(1)\nbar.close()\n")
    proc = run(code)
    assert proc.returncode == 0, proc.stderr
    before, _, after = proc.stderr.partition("autotune: an OOM survived")
    assert after, proc.stderr
    line_start = max(before.rfind("\r"), before.rfind("\n"))
    assert before[line_start + 1:] == "", repr(proc.stderr)
    assert after.startswith("\n") and "4/10" in after  # the bar drawn again below


@pytest.mark.parametrize("gone", ["sys.stderr.close()", "sys.stderr = None"])
def test_a_closed_or_absent_stderr_loses_the_line_not_the_run(gone):
    """A daemon that closed its stderr, pythonw's None: a warning is not said, and the caller goes on
    (logging's handleError raised ValueError writing to the closed stream, out of the training step)."""
    script = f"import sys\nfrom autotune.common.notices import warn\n{gone}\nwarn('an OOM survived', key='k')\nprint('went on')"
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout == "went on\n", (proc.stdout, proc.stderr)
