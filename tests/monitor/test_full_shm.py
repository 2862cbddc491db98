"""A full /dev/shm (a container's 64 MiB, used up) never kills a run: a real AutoTrainer run with the
monitor and the sample cache on, in a real 1 MiB tmpfs filled to the last page (tests/small_tmpfs.py).
Before, the trainer died by SIGBUS when the monitor's board was first written: no checkpoint, no word."""

import json
import subprocess
import sys

import pytest

from tests.small_tmpfs import full_shm, small_shm  # noqa: F401  (fixtures)

RUN = """
import sys
import torch
from torch import nn
from torch.utils.data import Dataset

from autotune import AutoTrainer
from autotune.common.actions import CacheSamples
from autotune.common.events import Event
from autotune.tuning import monitor_link as link
from autotune.decisions.policy import PolicyBase

link.START_AFTER_S = 0.0  # the monitor (and its board) at the first batch, not a second in


class CacheAtOnce(PolicyBase):
    name = "cache_at_once"
    events = frozenset({Event.BATCH_END})
    asked = False

    def decide(self, event, snap):
        if self.asked:
            return []
        self.asked = True
        return [CacheSamples(reason="the test asks")]


class Numbers(Dataset):
    cacheable = True

    def __len__(self):
        return 64

    def __getitem__(self, index):
        return torch.full((8,), float(index)), torch.tensor([float(index % 3)])


with AutoTrainer(nn.Linear(8, 1), Numbers(), loss_fn=nn.functional.mse_loss, batch_size=8, device="cpu",
                 progress=False, monitor_interval=0.05, checkpoint_interval=None, run_dir=sys.argv[1],
                 policies=[CacheAtOnce()]) as trainer:
    print(trainer.fit(epochs=2).samples_seen)
"""


@pytest.mark.slow
def test_a_run_with_shared_memory_full_finishes_and_says_where_its_board_and_cache_went(full_shm, tmp_path):
    run = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-c", RUN, str(run)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-3000:])  # before: -7 (SIGBUS), no word
    assert proc.stdout.split() == ["128"]
    assert proc.stderr.count("the monitor's sample board could not be made") == 1, proc.stderr
    assert proc.stderr.count("not caching samples: no room") == 1, proc.stderr
    records = [json.loads(line) for line in (run / "events.jsonl").read_text().splitlines()]
    (started,) = [r for r in records if r["kind"] == "monitor_start"]
    assert started["board"].startswith(str(run))
    (off,) = [r for r in records if r["kind"] == "sample_cache_off"]
    assert str(full_shm) in off["reason"]
    assert not list(run.glob("*.board")) and [p.name for p in full_shm.iterdir()] == ["fill"]
