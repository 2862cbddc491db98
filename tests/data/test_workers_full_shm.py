"""Loader workers where /dev/shm is full: torch makes their queues' semaphores there, so where it has
no room `iter(DataLoader)` raises ENOSPC. Before, the worker that tune_workers added (or a checkpoint
restored) ended the run at that batch, and every resume died at the same step. Now the loader autotune
built falls back to loading in-process and no policy adds workers again; a caller's DataLoader's error
names /dev/shm and the ways out. A real 1 MiB tmpfs on /dev/shm itself, in a private mount namespace
(`unshare -m`, as root): filled to the last page, the semaphores cannot be made."""

import json
import shutil
import os
import subprocess
import sys
from pathlib import Path

import pytest

RUN = """
import sys, time
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

from autotune import AutoTrainer
from autotune.policies import TuneWorkers
from tests.small_tmpfs import fill

base = TensorDataset(torch.randn(64, 8), torch.randint(0, 2, (64,)))


class Slow(Dataset):  # waits on its "disk": the loop is input-bound, so tune_workers asks for a worker
    def __len__(self):
        return 64

    def __getitem__(self, i):
        time.sleep(0.001)
        return base[i]


def trainer(run_dir, data, num_workers=0, **kw):
    return AutoTrainer(nn.Linear(8, 2), data, loss_fn=nn.functional.cross_entropy, batch_size=8, device="cpu",
                       progress=False, run_dir=run_dir, num_workers=num_workers, monitor=False, **kw)


out = sys.argv[1]
# Room in /dev/shm: a worker starts, and the checkpoint says num_workers=1.
with trainer(out + "/resumed", Slow(), num_workers=1, policies=[]) as t:
    t.fit(max_steps=3)
fill(__import__("pathlib").Path("/dev/shm"))
# A resume of it where workers cannot start.
with trainer(out + "/resumed", Slow(), policies=[]) as t:
    print("RESUMED", t.fit(epochs=1, resume=True).steps, t.knobs.num_workers, flush=True)
# tune_workers adds one, it cannot start: trained in-process, and never asked for again.
with trainer(out + "/tuned", Slow(), checkpoint_interval=None,
             policies=[TuneWorkers(max_workers=1, judge_steps=2)]) as t:
    print("TUNED", t.fit(epochs=4).steps, t.knobs.num_workers, flush=True)
# The caller's own DataLoader: an error, that says where and what to do.
try:
    with trainer(out + "/user", DataLoader(Slow(), batch_size=8, num_workers=1), checkpoint_interval=None,
                 policies=[]) as t:
        t.fit(epochs=1)
except OSError as exc:
    print("USER", exc, flush=True)
"""


def records(path: Path, kind: str) -> list[dict]:
    lines = (json.loads(line) for name in ("events.jsonl", "steps.jsonl") if (path / name).exists()
             for line in (path / name).read_text().splitlines())
    return [record for record in lines if record["kind"] == kind]


@pytest.mark.slow
def test_workers_that_cannot_start_for_a_full_dev_shm_fall_back_to_in_process_loading(tmp_path):
    if not sys.platform.startswith("linux") or shutil.which("unshare") is None:
        pytest.skip("needs Linux's unshare (a private mount namespace for a small /dev/shm)")
    probe = subprocess.run(["unshare", "-m", "sh", "-c", "mount -t tmpfs -o size=1M tmpfs /dev/shm"],
                           capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs on /dev/shm in a private mount namespace (needs root): "
                    f"{probe.stderr.strip() or probe.returncode}")
    script = tmp_path / "run.py"
    script.write_text(RUN)
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run(["unshare", "-m", "sh", "-c", 'mount -t tmpfs -o size=1M tmpfs /dev/shm && '
                           'exec "$0" "$1" "$2"', sys.executable, str(script), str(tmp_path)],
                          capture_output=True, text=True, timeout=120, cwd=root,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(  # the script imports tests.small_tmpfs
                              [str(root)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])})
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = dict(line.split(" ", 1) for line in proc.stdout.splitlines())
    # The resume: 8 steps an epoch, 3 done before; the checkpoint's worker did not start, none in use.
    assert lines["RESUMED"] == "8 0"
    fallback = records(tmp_path / "resumed", "loader_rebuilt")[-1]
    assert fallback["num_workers"] == 0 and fallback["asked_workers"] == 1 and "28" in fallback["reason"]
    # The policy's worker: 4 epochs trained, and asked for once only (the ceiling holds).
    assert lines["TUNED"] == "32 0"
    asked = [r for r in records(tmp_path / "tuned", "action") if r["action"] == "set_loader_workers"]
    assert [(r["params"]["num_workers"], r["applied"]) for r in asked] == [(1, True)]
    assert [r["num_workers"] for r in records(tmp_path / "tuned", "loader_rebuilt")] == [1, 0]
    assert proc.stderr.count("data loader workers could not start") == 1  # one word (a process's warnings are once)
    assert "Traceback" not in proc.stderr  # nor torch's half-made iterator's complaints at collection
    # The caller's loader is theirs: its error names /dev/shm and the ways out.
    assert "/dev/shm" in lines["USER"] and "--shm-size" in lines["USER"] and "num_workers=0" in lines["USER"]
