"""`autotune report` on real run directories: normal, with OOMs, crashed mid-write, empty, not a run."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from autotune import AutoTrainer
from autotune import Event
from autotune.cli import main
from autotune.observe.journal import Journal
from autotune.observe.report import KEEP, NotARun, render, summarize, throughput_over_time


@pytest.fixture(scope="module")
def run_with_ooms(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("runs") / "ooms"
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(256, 8), torch.randint(0, 2, (256,)))
    trainer = AutoTrainer(nn.Linear(8, 2), data, loss_fn=nn.functional.cross_entropy, batch_size=32, device="cpu",
                          progress=False, monitor=False, run_dir=run_dir, inject_oom=0.3, seed=1)
    trainer.fit(epochs=2)
    return run_dir


def test_a_normal_run(tmp_path, capsys):
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(512, 8), torch.randint(0, 2, (512,)))
    trainer = AutoTrainer(nn.Linear(8, 2), data, loss_fn=nn.functional.cross_entropy, batch_size=32, device="cpu",
                          progress=False, monitor=False, run_dir=tmp_path / "run", policies="conservative",
                          num_workers=1)  # as tune_workers would pick at step 20: its 0.3 s start-up no longer a gap
    result = trainer.fit(epochs=2)
    summary = summarize(tmp_path / "run")
    assert summary["status"] == "finished" and summary["samples_seen"] == 1024 and summary["steps"] == result.steps
    assert summary["ooms"] == {"survived": 0, "seconds_lost": 0, "by_micro_batch": {}, "gave_up": 0, "same_size_retries": 0,
                              "same_size_fit": 0, "last_breakdown": None,
                              "last_snapshot": None}
    assert summary["micro_batch_size"] == {"start": 32, "end": 32}
    windows = summary["throughput_over_time"]
    # How many of the 8 stretches hold two steps is the machine's timing (a loaded one leaves gaps):
    # the windowing itself is checked on scripted steps below.
    assert windows and all(w["samples_per_second"] > 0 for w in windows)
    # The windows reach the run's end (what follows the last step, the end checkpoint and the close, takes
    # longer on a loaded machine: 0.5 s of 3.3 was seen with the suite run beside four others).
    assert windows[-1]["to_seconds"] == pytest.approx(summary["wall_seconds"], abs=max(0.5, 0.25 * summary["wall_seconds"]))
    assert main(["report", str(tmp_path / "run")]) == 0
    text = capsys.readouterr().out
    # The windows start where the steps log has two lines in one (0.0 s, or later on a loaded machine).
    assert "finished" in text and f"samples/s over time: {windows[0]['from_seconds']}s-" in text and "OOMs survived 0\n" in text


def test_throughput_is_cut_into_equal_stretches_and_a_gap_or_a_resume_is_left_out():
    # 100 samples a second for 8 s, a line every 0.5 s; then nothing for 4 s; then a resume from an
    # earlier checkpoint (samples_seen falls back) at the same rate.
    steps = [{"time": 0.5 * i, "samples_seen": 50 * i} for i in range(17)]
    windows = throughput_over_time(steps)
    assert len(windows) == 8 and all(w["samples_per_second"] == pytest.approx(100) for w in windows)
    assert [w["from_seconds"] for w in windows] == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0]
    gap = steps[:9] + [{"time": 12.0 + 0.5 * i, "samples_seen": 400 + 50 * i} for i in range(9)]  # 4-8 s: no line
    assert [w["from_seconds"] for w in throughput_over_time(gap)] == [0.0, 2.0, 12.0, 14.0]
    resumed = steps + [{"time": 8.5, "samples_seen": 200}, {"time": 9.0, "samples_seen": 250}]  # back to 200
    seen = throughput_over_time(resumed, windows=9)
    assert seen and all(w["samples_per_second"] > 0 for w in seen) and seen[-1]["to_seconds"] < 9.0
    assert throughput_over_time(steps[:1]) == [] and throughput_over_time([]) == []


def test_a_run_still_in_progress(tmp_path):
    # A policy that reads the report from inside the run, half-way through the second epoch.
    seen = {}

    class ReportMidway:
        name = "report_midway"
        events = frozenset({Event.BATCH_END})

        def decide(self, event, snap):
            if snap.step == 24 and not seen:
                seen.update(summarize(tmp_path / "run"))
            return []

        def state_dict(self):
            return {}

        def load_state_dict(self, state):
            return None

    data = TensorDataset(torch.randn(512, 8), torch.randint(0, 2, (512,)))
    AutoTrainer(nn.Linear(8, 2), data, loss_fn=nn.functional.cross_entropy, batch_size=32, device="cpu",
                progress=False, monitor=False, run_dir=tmp_path / "run", policies=[ReportMidway()]).fit(epochs=2)
    assert seen["status"].startswith("in progress") and seen["epochs_completed"] == 1
    assert seen["steps"] >= 16 and seen["journal_lines_unreadable"] == 0
    assert summarize(tmp_path / "run")["status"] == "finished"


def test_a_run_with_ooms_in_text_and_json(run_with_ooms, capsys):
    summary = summarize(run_with_ooms)
    journal = [json.loads(line) for line in (run_with_ooms / "events.jsonl").read_text().splitlines()]
    assert summary["status"] == "finished" and summary["samples_seen"] == 512 and summary["epochs_completed"] == 2
    assert summary["ooms"]["survived"] == sum(r["kind"] == "oom" for r in journal) > 0
    assert 0 < summary["ooms"]["seconds_lost"] < summary["wall_seconds"]
    assert summary["actions"]["halve_on_oom"][0]["reason"].startswith("out of memory at micro-batch")
    assert summary["checkpoints"][-1]["reason"] == "end"
    assert main(["report", str(run_with_ooms)]) == 0
    text = capsys.readouterr().out
    assert "finished" in text and f"OOMs survived {summary['ooms']['survived']}" in text and "halve_on_oom" in text
    assert "of work and clean-up lost to them" in text
    assert main(["report", "--json", str(run_with_ooms)]) == 0
    assert json.loads(capsys.readouterr().out)["ooms"] == summary["ooms"]


def test_a_run_that_crashed_mid_write(run_with_ooms, tmp_path):
    crashed = tmp_path / "crashed"
    crashed.mkdir()
    lines = (run_with_ooms / "events.jsonl").read_text().splitlines()
    end = next(i for i, line in enumerate(lines) if '"kind": "epoch_end"' in line)
    (crashed / "events.jsonl").write_text("\n".join(lines[:end + 1]) + "\n" + lines[end + 1][:25])  # cut mid-line
    summary = summarize(crashed)
    assert summary["journal_lines_unreadable"] == 1 and summary["epochs_completed"] == 1
    assert summary["status"].startswith("in progress")
    assert "could not be read" in render(summary)


def test_an_empty_run_and_a_folder_that_is_not_a_run(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "events.jsonl").write_text("")
    summary = summarize(tmp_path / "empty")
    assert summary["steps"] == 0 and "nothing recorded yet" in render(summary)
    with pytest.raises(NotARun, match="no events.jsonl"):
        summarize(tmp_path)
    assert main(["report", str(tmp_path / "missing")]) == 2
    assert "is not a folder" in capsys.readouterr().err


def test_the_timeline_plot_is_a_png_with_the_expected_axes(run_with_ooms, tmp_path, capsys):
    from autotune.observe.report_plot import plot_timeline

    out = tmp_path / "timeline.png"
    fig = plot_timeline(run_with_ooms, out)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and 10_000 < out.stat().st_size < 2_000_000
    memory, micro, wait = fig.axes
    assert memory.get_ylabel() == "memory (GiB)" and micro.get_ylabel() == "micro-batch"
    assert wait.get_ylabel() == "data wait (%)"
    sizes = micro.lines[0].get_ydata()
    assert sizes[0] == 32 and min(sizes) < 32  # the injected OOMs shrank it
    assert any(t.get_text() == "OOM" for t in memory.texts)
    assert main(["report", str(run_with_ooms), "--plot"]) == 0
    assert (run_with_ooms / "timeline.png").exists() and "timeline:" in capsys.readouterr().err


def test_the_report_names_the_largest_sites_of_an_oom_snapshot(tmp_path):
    # The journal line a CUDA run with memory_snapshot=True writes (tests/test_trainer_gpu.py makes a real one).
    log = Journal(tmp_path / "run" / "events.jsonl")
    log.write("fit_start", 0, 0, device="cuda:0", micro_batch_size=64)
    log.write("oom", 3, 0, micro_batch_size=64, device="cuda:0", message="CUDA out of memory", injected=False,
              lost_seconds=0.1, ooms=1, breakdown=None,
              memory_snapshot={"path": str(tmp_path / "run" / "oom-3.pickle"),
                               "largest_sites": [{"site": "model.py:12 in forward", "bytes": 512 * 2**20}]})
    log.close()
    text = render(summarize(tmp_path / "run"))
    assert "oom-3.pickle" in text and "512.0 MiB  model.py:12 in forward" in text


def test_lines_it_cannot_read_are_skipped_and_counted_and_the_rest_reported(tmp_path, capsys):
    # A byte gone bad, a JSON line that is not an object, records missing what the report reads: each was
    # a refusal or a traceback; now each is one of the unreadable lines the report counts.
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    good = [{"kind": "fit_start", "time": 1.0, "step": 0, "epoch": 0},
            {"kind": "oom", "time": 2.0, "step": 3, "epoch": 0, "micro_batch_size": 32, "message": "x"},
            {"kind": "fit_end", "time": 3.0, "step": 8, "epoch": 1, "samples_seen": 256}]
    lines = [json.dumps(good[0]).encode(), b'{"kind": "epoch_end", "time": 2.5, "note": "caf\xe9"}',
             b"[1, 2, 3]", b'"just a string"', json.dumps({"kind": "oom", "step": 4, "epoch": 0}).encode(),
             json.dumps({"kind": "action", "time": 2.2, "step": 3, "epoch": 0, "action": "set_micro_batch"}).encode(),
             json.dumps(good[1]).encode(), json.dumps(good[2]).encode()]
    (run_dir / "events.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    summary = summarize(run_dir)
    assert summary["journal_lines_unreadable"] == 5
    assert summary["status"] == "finished" and summary["ooms"]["survived"] == 1 and summary["actions"] == {}
    assert main(["report", str(run_dir)]) == 0
    assert "note: 5 journal line(s) could not be read and were skipped" in capsys.readouterr().out


def test_the_report_never_imports_torch(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "events.jsonl").write_text(json.dumps({"kind": "fit_start", "time": 1.0, "step": 0, "epoch": 0}) + "\n")
    code = ("import sys, runpy\nsys.argv = ['autotune', 'report', sys.argv[1]]\ntry:\n"
            "    runpy.run_module('autotune.cli', run_name='__main__')\nexcept SystemExit as e:\n"
            "    assert not e.code, e.code\nassert 'torch' not in sys.modules, 'torch was imported'\n")
    done = subprocess.run([sys.executable, "-c", code, str(run_dir)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


def _long_journal(path: Path, mib: float) -> int:
    """A journal of about `mib` MiB, a long run's mix (60% policy actions, 20% OOMs, 20% checkpoints, an
    epoch end every 1,000 steps, one fit); returns its number of records."""
    target, written, records = mib * 2**20, 0, 0
    with open(path, "w") as f:
        def put(record: dict) -> None:
            nonlocal written, records
            line = json.dumps(record) + "\n"
            f.write(line)
            written, records = written + len(line), records + 1

        put({"kind": "fit_start", "time": 0.0, "step": 0, "epoch": 0, "device": "cpu", "world": 1,
             "micro_batch_size": 32, "batch_size": 32})
        step = 0
        while written < target:
            step += 1
            t, epoch, kind = step / 100, step // 1000, ("checkpoint", "oom", "action", "action", "action")[step % 5]
            if kind == "checkpoint":
                put({"kind": kind, "time": t, "step": step, "epoch": epoch, "reason": "every",
                     "path": f"/runs/x/checkpoints/step-{step:09d}.pt", "seconds": 0.1})
            elif kind == "oom":
                put({"kind": kind, "time": t, "step": step, "epoch": epoch, "micro_batch_size": 32,
                     "message": "DefaultCPUAllocator: can't allocate memory", "lost_seconds": 0.01})
            else:
                put({"kind": kind, "time": t, "step": step, "epoch": epoch, "policy": "halve_on_oom",
                     "action": "set_micro_batch", "params": {"size": 16}, "applied": True,
                     "reason": "an OOM at micro-batch 32", "note": ""})
            if step % 1000 == 0:
                put({"kind": "epoch_end", "time": t, "step": step, "epoch": epoch - 1, "samples_seen": step * 32,
                     "loss": 0.5, "micro_batch_size": 16})
    return records


def test_the_reports_memory_does_not_grow_with_the_journal(tmp_path):
    # A long run's journal is hundreds of MB of actions and OOMs: the report streams it, keeping counts, sums
    # and the newest KEEP records of each kind. (Its speed on 200 MB: benchmarks/report_size.py.) On the old
    # code, which held every record, the peak grew ~7x the journal's size.
    peaks, records = [], []
    for mib in (1, 24):
        run_dir = tmp_path / f"journal-{mib}"
        run_dir.mkdir()
        records.append(_long_journal(run_dir / "events.jsonl", mib))
        done, peak = _report_in_a_child(run_dir)
        assert done.returncode == 0, done.stderr[-2000:]
        peaks.append(peak)
    assert peaks[1] - peaks[0] < 12, peaks  # MiB, for 23 MiB more journal
    summary = summarize(tmp_path / "journal-24")
    assert len(summary["actions"]["halve_on_oom"]) == KEEP and len(summary["checkpoints"]) == KEEP
    assert summary["ooms"]["survived"] + summary["counts"]["checkpoints"] \
        + summary["action_counts"]["halve_on_oom"]["applied"] + summary["counts"]["epochs"] + 1 == records[1]


def _report_in_a_child(run_dir: Path, cap_bytes: int = 2**30) -> tuple[subprocess.CompletedProcess, float]:
    # `autotune report` in its own interpreter, under an address-space cap (so a report that reads without
    # bound fails here instead of taking the machine) and a time limit (so one that blocks fails too); with
    # its peak RSS in MiB.
    script = ("import resource, subprocess, sys\n"
              f"def cap(): resource.setrlimit(resource.RLIMIT_AS, ({cap_bytes}, {cap_bytes}))\n"
              "done = subprocess.run([sys.executable, '-m', 'autotune.cli', 'report', sys.argv[1]], preexec_fn=cap,"
              " capture_output=True, text=True, timeout=60)\n"
              "sys.stdout.write(done.stdout); sys.stderr.write(done.stderr)\n"
              "print(f'\\nRC={done.returncode} RSS={resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024}')")
    done = subprocess.run([sys.executable, "-c", script, str(run_dir)], capture_output=True, text=True, timeout=120)
    tail = done.stdout.rsplit("RC=", 1)[-1].split()
    return (subprocess.CompletedProcess(done.args, int(tail[0]), done.stdout, done.stderr),
            float(tail[1].removeprefix("RSS=")))


def _one_record_run(run_dir: Path) -> None:
    run_dir.mkdir()
    (run_dir / "events.jsonl").write_text(json.dumps({"kind": "fit_start", "time": 1.0, "step": 0, "epoch": 0}) + "\n")


def test_the_report_refuses_a_journal_that_is_not_a_regular_file(tmp_path):
    # A FIFO blocked the old report for ever; a directory was an IsADirectoryError traceback.
    fifo_run, dir_run = tmp_path / "fifo", tmp_path / "dir"
    fifo_run.mkdir()
    os.mkfifo(fifo_run / "events.jsonl")
    (dir_run / "events.jsonl").mkdir(parents=True)
    for run_dir, what in ((fifo_run, "a FIFO"), (dir_run, "a directory")):
        done, _ = _report_in_a_child(run_dir)
        assert done.returncode == 2, done.stderr[-2000:]
        assert f"events.jsonl is {what}, not a regular file" in done.stderr and "Traceback" not in done.stderr


def test_the_report_reads_the_journal_whatever_the_side_files_are(tmp_path):
    # samples.jsonl a link to /dev/zero (the old report grew until MemoryError) and steps.jsonl a FIFO (blocked):
    # the report says so and reports the journal.
    run_dir = tmp_path / "run"
    _one_record_run(run_dir)
    (run_dir / "samples.jsonl").symlink_to("/dev/zero")
    os.mkfifo(run_dir / "steps.jsonl")
    done, _ = _report_in_a_child(run_dir)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "samples.jsonl is a device, not a regular file" in done.stderr
    assert "steps.jsonl is a FIFO, not a regular file" in done.stderr


def test_a_huge_line_is_skipped_and_counted_in_bounded_memory(tmp_path):
    # One 256 MiB line of NULs (a sparse tail a crash can leave) between two records: the old report held the
    # line whole (a 300 MB line cost 650 MB); now it is read past in 1 MiB pieces and counted.
    small, huge = tmp_path / "small", tmp_path / "huge"
    _one_record_run(small)
    _one_record_run(huge)
    with open(huge / "events.jsonl", "r+b") as f:
        f.seek(256 * 2**20, os.SEEK_END)
        f.write(b"\n" + json.dumps({"kind": "fit_end", "time": 2.0, "step": 0, "epoch": 0}).encode() + b"\n")
    (_, small_peak), (done, huge_peak) = _report_in_a_child(small), _report_in_a_child(huge)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "note: 1 journal line(s) could not be read" in done.stdout and "finished" in done.stdout
    assert huge_peak - small_peak < 16, (small_peak, huge_peak)  # MiB


_AT = '"time": 1796616000.0, "step": 3, "epoch": 0'


@pytest.mark.parametrize("line", [
    "[" * 200000 + "]" * 200000,  # json.loads: RecursionError, not a ValueError (a traceback)
    '{' + _AT + ', "kind": "data_stalled"}',  # its fields missing: "'NoneType' object is not subscriptable"
    '{' + _AT + ', "kind": "evaluate", "metrics": "x"}',  # AttributeError in render
    '{' + _AT + ', "kind": "checkpoint", "path": -1}',
    '{' + _AT + ', "kind": "epoch_end", "samples_seen": "x"}',
    '{' + _AT + ', "kind": "evaluate", "ooms": "x"}',
    '{' + _AT + ', "kind": "sample_cache", "hit_rate": "x"}',
    '{' + _AT + ', "kind": "relief", "relief": "pruning", "parameters_removed_in_all": "x"}',
    '{' + _AT + ', "kind": "oom", "micro_batch_size": 4, "lost_seconds": "x"}',
    '{' + _AT + ', "kind": "oom", "micro_batch_size": 4, "breakdown": {"held": "x", "measure": "virtual"}}',
    '{' + _AT + ', "kind": "oom", "micro_batch_size": 4, "memory_snapshot": {"path": "a", "largest_sites": [1]}}',
], ids=["nested", "stall-without-fields", "metrics-str", "path-int", "samples-str", "ooms-str", "hit-rate-str",
        "pruned-str", "lost-str", "breakdown-held-str", "snapshot-site-int"])
def test_a_record_of_the_wrong_shape_is_skipped_and_counted(run_with_ooms, tmp_path, capsys, line):
    # Each was a traceback or "error: ..." with no report (issue 56): every field the report reads is checked
    # against the type records.py's registry declares, before any of it is used.
    run_dir = tmp_path / "run"
    shutil.copytree(run_with_ooms, run_dir)
    assert summarize(run_dir)["journal_lines_unreadable"] == 0  # what the trainer writes passes the checks
    with open(run_dir / "events.jsonl", "a") as f:
        f.write(line + "\n")
    assert main(["report", str(run_dir)]) == 0
    text = capsys.readouterr().out
    assert "note: 1 journal line(s) could not be read and were skipped" in text and "finished" in text
    assert main(["report", "--json", str(run_dir)]) == 0
    assert json.loads(capsys.readouterr().out)["journal_lines_unreadable"] == 1


def test_a_copied_run_names_its_own_checkpoint_not_the_path_it_was_written_at(run_with_ooms, tmp_path, capsys):
    # `cp -r runA runB; mv runA elsewhere`: the journal's paths are runA's, gone; the report named one as
    # "newest on disk". Now it names the copy's own file, and says so when that is gone too.
    run_dir, old = tmp_path / "runB", str(run_with_ooms)
    shutil.copytree(run_with_ooms, run_dir)
    journal = run_dir / "events.jsonl"
    journal.write_text(journal.read_text().replace(json.dumps(old)[1:-1], str(tmp_path / "runA")))
    assert main(["report", str(run_dir)]) == 0
    newest = capsys.readouterr().out.split("newest on disk: ", 1)[1].splitlines()[0].split(": ", 1)[1]
    assert Path(newest).parent == run_dir / "checkpoints" and Path(newest).is_file()
    shutil.rmtree(run_dir / "checkpoints")
    summary = summarize(run_dir)
    assert summary["checkpoints"] and not any(c["on_disk"] or c["file"] for c in summary["checkpoints"])
    assert "written, none on disk" in render(summary)


def test_the_runs_id_is_read_past_a_line_nested_too_deeply(tmp_path):
    # The run lock and resume read the newest run id from the journal's end: a deeply nested last line that
    # names "run_id" was a RecursionError there.
    from autotune.observe.journal import last_run_id

    path = tmp_path / "events.jsonl"
    path.write_text(json.dumps({"kind": "fit_start", "run_id": "aaaaaaaaaaaa", "time": 1.0, "step": 0, "epoch": 0})
                    + "\n" + '{"run_id": ' + "[" * 200000 + "]" * 200000 + "}\n")
    assert last_run_id(path) == "aaaaaaaaaaaa"


def test_a_checkpoint_path_that_cannot_be_looked_up_is_not_on_disk(run_with_ooms, tmp_path, capsys):
    # Well typed, but too long a name to stat: Path.exists raised OSError, and the report was "error: ..." only.
    run_dir = tmp_path / "run"
    shutil.copytree(run_with_ooms, run_dir)
    with open(run_dir / "events.jsonl", "a") as f:
        f.write('{' + _AT + ', "kind": "checkpoint", "reason": "every", "path": "' + "x" * 5000 + '"}\n')
    assert main(["report", str(run_dir)]) == 0
    assert f"newest on disk: step {summarize(run_with_ooms)['checkpoints'][-1]['step']} (end)" in capsys.readouterr().out
