"""conftest.torchrun repeats a job once where gloo aborted a rank at interpreter exit after it
finished (torchrun then stops the other, maybe before that one wrote its result: CI, stop 65). The
repeat must start from the folders as they were: a job of several cases that journaled into each
case's folder, repeated without that, left every record twice (CI, stop 42)."""

import subprocess

import tests.conftest as conftest


def test_a_repeated_job_starts_from_every_folder_as_it_was(tmp_path, monkeypatch):
    cases = [tmp_path / "first", tmp_path / "second"]
    cases[1].mkdir()
    (cases[1] / "events.jsonl").write_text("before\n")
    results = [cases[1] / f"rank{r}.json" for r in (0, 1)]
    runs = []

    def job_that_aborts_at_exit_once(commands, env, timeout):
        runs.append(1)
        for folder in cases:
            folder.mkdir(exist_ok=True)
            with open(folder / "events.jsonl", "a") as journal:
                journal.write(f"run {len(runs)}\n")
        (cases[0] / "checkpoint").write_text(f"run {len(runs)}")
        for path in results[1:] if len(runs) == 1 else results:  # the first time, rank 0 was stopped before its own
            path.write_text("{}")
        stderr = conftest.TEARDOWN_ABORT if len(runs) == 1 else ""
        return subprocess.CompletedProcess(commands, 1 if stderr else 0, "", stderr)

    monkeypatch.setattr(conftest, "_run_job", job_that_aborts_at_exit_once)
    conftest.torchrun(tmp_path / "train.py", [], results, folders=cases)
    assert len(runs) == 2
    assert (cases[0] / "events.jsonl").read_text() == "run 2\n"
    assert (cases[1] / "events.jsonl").read_text() == "before\nrun 2\n"
