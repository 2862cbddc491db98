import os
import subprocess
import sys
import textwrap

import pytest

from autotune.observe.journal import Journal, read_journal


def test_lines_are_written_as_they_happen(tmp_path):
    journal = Journal(tmp_path / "run" / "events.jsonl")
    journal.write("fit_start", 0, 0, device="cpu")
    # flushed without close: a crash right now would keep it
    (record,) = read_journal(tmp_path / "run" / "events.jsonl")
    assert record["kind"] == "fit_start" and record["device"] == "cpu" and record["time"] > 0


def test_a_truncated_last_line_is_skipped(tmp_path):
    path = tmp_path / "events.jsonl"
    path.write_text('{"kind": "fit_start", "step": 0}\n{"kind": "oom", "st')
    assert [r["kind"] for r in read_journal(path)] == ["fit_start"]


def test_a_bad_line_in_the_middle_is_an_error(tmp_path):
    path = tmp_path / "events.jsonl"
    path.write_text('{"kind": "a"}\nnot json\n{"kind": "b"}\n')
    with pytest.raises(ValueError, match="events.jsonl:2"):
        list(read_journal(path))


def test_a_journal_that_ends_mid_line_gets_its_newline_before_the_next_record(tmp_path):
    # What a kill -9 mid-write (or a short write on a full disk) leaves: the resumed run's first record was
    # appended onto the fragment and lost with it.
    from autotune.observe.journal import read_lines

    path = tmp_path / "events.jsonl"
    path.write_text('{"kind": "fit_start", "step": 0, "epoch": 0, "time": 1}\n{"kind": "oom", "st')
    journal = Journal(path)
    journal.write("resume", 3, 0, found=False)
    journal.close()
    records, unreadable = read_lines(path)
    assert [r["kind"] for r in records] == ["fit_start", "resume"] and unreadable == 1


def test_a_child_the_run_forks_writes_nothing_into_its_journal_or_checkpoints(tmp_path):
    # A callback forks a helper that ends with sys.exit(0): the child unwound through fit, which journaled
    # `fit_failed: SystemExit: 0` into the parent's journal (the report then called a finished run failed).
    import json
    import subprocess
    import sys
    import textwrap

    script = f"""
        import os, sys, torch
        from torch import nn
        from torch.utils.data import TensorDataset
        from autotune import AutoTrainer
        from autotune.observe.journal import read_lines

        class ForkAtStep3:
            def on_step_end(self, trainer):
                if trainer.step == 3:
                    pid = os.fork()
                    if pid == 0:
                        sys.exit(0)
                    os.waitpid(pid, 0)

        data = TensorDataset(torch.randn(128, 8), torch.randint(0, 2, (128,)))
        run_dir = {str(tmp_path / "run")!r}
        trainer = AutoTrainer(nn.Linear(8, 2), data, loss_fn=nn.functional.cross_entropy, batch_size=16,
                              device="cpu", progress=False, monitor=False, checkpoint_interval=None,
                              callbacks=[ForkAtStep3()], run_dir=run_dir)
        trainer.fit(epochs=1)
        trainer.close()
        records, _ = read_lines(os.path.join(run_dir, "events.jsonl"))
        print(json.dumps({{"kinds": [r["kind"] for r in records],
                          "checkpoints": sorted(os.listdir(os.path.join(run_dir, "checkpoints")))}}))
    """
    # Not conftest.run_python: its faulthandler watchdog thread hangs a forked child's exit (CPython's, not ours).
    proc = subprocess.run([sys.executable, "-c", "import json\n" + textwrap.dedent(script)], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.splitlines()[-1])
    assert "fit_failed" not in result["kinds"] and result["kinds"].count("fit_end") == 1, result
    assert result["checkpoints"] == ["step-000000008.pt", "step-000000008.pt.sha256"], result


@pytest.mark.slow  # two interpreters
def test_a_progress_bar_whose_stderr_is_gone_stops_and_the_run_goes_on(tmp_path):
    """`python train.py 2>&1 | head`, a closed descriptor 2: the bar's write fails (a broken pipe, a bad
    descriptor) and the run went down with it, checkpointed; the bar stops, the run ends."""
    script = textwrap.dedent(f"""
        import os, torch
        from torch import nn
        from torch.utils.data import TensorDataset
        from autotune import AutoTrainer
        torch.manual_seed(0)
        data = TensorDataset(torch.randn(256, 8), torch.randint(0, 2, (256,)))
        trainer = AutoTrainer(nn.Linear(8, 2), data, loss_fn=nn.functional.cross_entropy, batch_size=16, device="cpu",
                              run_dir={str(tmp_path)!r} + "/" + os.environ["GONE"], monitor=False, inject_oom=0.3,
                              seed=1)
        if os.environ["GONE"] == "descriptor":
            os.close(2)
        result = trainer.fit(epochs=2)
        print("trained", result.samples_seen, flush=True)
    """)
    for gone in ("pipe", "descriptor"):
        proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, env={**os.environ, "GONE": gone})
        proc.stderr.close()  # the reader left: every write to stderr is a broken pipe
        out, _ = proc.communicate(timeout=120)
        assert proc.returncode == 0 and out.endswith("trained 512\n"), (gone, proc.returncode, out)
