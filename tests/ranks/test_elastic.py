"""torchrun's elastic mode (issue 33), two "nodes" as two torchrun agents on 127.0.0.1, one rank each,
`--nnodes=1:2 --max-restarts=1`:

- a node lost: agent and rank killed with SIGKILL mid-run; torchrun restarts the survivor on one rank;
- a node joins: a job running on one node is restarted by torchrun on two when the second arrives.

Either way `fit(resume=True)` goes on from the last checkpoint with the same optimizer batch, and the run
ends with the weights of a run whose ranks never changed (one process: the same optimizer batch, so one or
two ranks end alike, to float32 rounding); every sample is trained once an epoch by the
steps that count: those checkpointed before the change and those after the resume (the steps between the
checkpoint and the change are trained again, as after any crash).

The rendezvous store is hosted here, not by an agent: the agent that hosts it cannot be the one lost."""

import json
import os
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.conftest import _kill_tree, free_port, journal, python

pytestmark = pytest.mark.slow

N, GLOBAL_BATCH, EPOCHS, EVERY, LOST_AT = 512, 32, 2, 4, 11  # 16 steps an epoch; checkpoints at 4, 8, 12, ...

SCRIPT = r'''
import json, os, signal, sys, time, torch
from torch import nn
from torch.utils.data import Dataset
from autotune import AutoTrainer

run_dir, batch_size, event, at = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
rank = int(os.environ.get("RANK", "0"))
world = int(os.environ.get("WORLD_SIZE", "1"))
attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))  # failures restarted (not joins)

class Numbered(Dataset):
    """Samples that carry their own index, so the test can see which were trained."""
    def __init__(self):
        g = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(%(N)d, 8, generator=g), torch.randint(0, 3, (%(N)d,), generator=g)
    def __len__(self):
        return len(self.x)
    def __getitem__(self, i):
        return self.x[i], self.y[i], i

# Each micro-batch's samples, written as trained: a rank killed with SIGKILL leaves its lines behind.
seen = open(os.path.join(run_dir, f"seen-attempt{attempt}-rank{rank}.jsonl"), "a", buffering=1)

def step(model, micro):
    x, y, ids = micro
    if event == "lose" and attempt == 0 and rank == 1 and trainer.step == at:
        os.kill(os.getppid(), signal.SIGKILL)  # the node is lost: its torchrun agent,
        os.kill(os.getpid(), signal.SIGKILL)   # and its rank
    if event == "join" and world == 1 and trainer.step == at:
        open(os.path.join(run_dir, "waiting"), "w").close()  # the test starts the second node now;
        # torchrun stops this rank (SIGTERM) to restart the job on both. autotune's own handler would
        # checkpoint at the end of this step, which never ends: torchrun would wait out its grace period.
        signal.signal(signal.SIGTERM, lambda *_: os._exit(143))
        time.sleep(240)
    seen.write(json.dumps({"step": trainer.step, "world": world, "ids": ids.tolist()}) + "\n")
    return nn.functional.cross_entropy(model(x), y)

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 3))
# The script as it stays when a node is lost: each rank's batch_size as on the first job.
trainer = AutoTrainer(model, Numbered(), step_fn=step, batch_size=batch_size, device="cpu",
                      optimizer=lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9), run_dir=run_dir,
                      progress=False, monitor=False, checkpoint_interval=None, checkpoint_every=%(EVERY)d, seed=3)
result = trainer.fit(epochs=%(EPOCHS)d, resume=True)
trainer.close()
if rank == 0:
    torch.save(model.state_dict(), os.path.join(run_dir, "final.pt"))
with open(os.path.join(run_dir, f"result-rank{rank}.json"), "w") as f:
    json.dump({"steps": result.steps, "samples": result.samples_seen, "batch": result.batch_size,
               "world": world, "attempt": attempt}, f)
''' % {"N": N, "EPOCHS": EPOCHS, "EVERY": EVERY}


def elastic_job(script: Path, args: list[str], join_at_marker: Path | None = None,
                timeout: float = 240) -> list[tuple[int, str]]:
    """Two torchrun agents, one rank each, `--nnodes=1:2 --max-restarts=1`, around a rendezvous store
    hosted here; the second starts with the first, or (`join_at_marker`) once that file exists.
    Returns each agent's (exit code, output)."""
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, multi_tenant=True, timeout=timedelta(seconds=60))
    # TORCH_DISABLE_SHARE_RDZV_TCP_STORE: with the store shared (torch's default), an agent restarted for a
    # node that joins keeps the last round's store address, which the new agent waits for in vain (a
    # re-rendezvous timeout here; pytorch#123678 reports scale-up failing with c10d too).
    env = {**os.environ, "MALLOC_ARENA_MAX": "1", "OMP_NUM_THREADS": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1:2", "--nproc-per-node=1",
               "--max-restarts=1", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}",
               "--rdzv-id=elastic-test", "--monitor-interval=0.5",
               # Started together, the agents fill the first rendezvous at once; after a loss the survivor
               # waits last_call_timeout for a second node before it goes on alone (so does a first node
               # alone). A node is taken for dead after keep_alive_max_attempt heartbeats of
               # keep_alive_interval missed (torch's defaults: 3 of 5 s).
               "--rdzv-conf", f"is_host=false,last_call_timeout={3 if join_at_marker else 10},"
               "keep_alive_interval=1,keep_alive_max_attempt=3", str(script), *args]
    deadline = time.monotonic() + timeout
    with tempfile.TemporaryDirectory() as folder:
        logs = [open(Path(folder) / f"{node}.log", "w+") for node in range(2)]
        agents = [subprocess.Popen(command, stdout=logs[0], stderr=subprocess.STDOUT, text=True, env=env)]
        if join_at_marker is not None:
            while not join_at_marker.exists() and agents[0].poll() is None and time.monotonic() < deadline:
                time.sleep(0.2)
        agents.append(subprocess.Popen(command, stdout=logs[1], stderr=subprocess.STDOUT, text=True, env=env))
        try:
            codes = [agent.wait(timeout=max(deadline - time.monotonic(), 0.1)) for agent in agents]
        except subprocess.TimeoutExpired:
            for agent in agents:
                _kill_tree(agent.pid)
                agent.wait()
            codes = None
        outputs = []
        for log in logs:
            log.seek(0)
            outputs.append(log.read())
            log.close()
    del store
    if codes is None:
        pytest.fail("the elastic job hung:\n" + "\n----\n".join(out[-3000:] for out in outputs))
    return list(zip(codes, outputs))


def trained(run_dir: Path, attempt: int, before_step: int | None = None, world: int | None = None) -> list[int]:
    # The samples the job's ranks trained on in `attempt`, at the steps before `before_step` if given, on
    # `world` ranks if given.
    ids: list[int] = []
    for path in run_dir.glob(f"seen-attempt{attempt}-rank*.jsonl"):
        for line in path.read_text().splitlines():
            record = json.loads(line)
            if (before_step is None or record["step"] < before_step) and world in (None, record["world"]):
                ids += record["ids"]
    return ids


def same_weights(run_dir: Path, reference_dir: Path) -> None:
    reference = torch.load(reference_dir / "final.pt", weights_only=True)
    weights = torch.load(run_dir / "final.pt", weights_only=True)
    for key, value in reference.items():  # float32 rounding: see tests/ranks/test_world_change.py
        torch.testing.assert_close(weights[key], value, rtol=1e-5, atol=1e-6)


@pytest.fixture(scope="module")
def whole(tmp_path_factory) -> Path:
    """The run whose ranks never change, on one process: the reference of both tests. The optimizer batch
    is the same on one rank or two, so both end with its weights (to float32 rounding)."""
    folder = tmp_path_factory.mktemp("whole")
    script = folder / "train.py"
    script.write_text(SCRIPT)
    proc = python([str(script), str(folder), str(GLOBAL_BATCH), "none", "0"], folder, {"OMP_NUM_THREADS": "1"},
                  timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return folder


def test_a_lost_node_is_survived_by_torchrun_restarting_the_rest_and_the_run_ends_as_if_nothing_was_lost(tmp_path,
                                                                                                        whole):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    batch_size = GLOBAL_BATCH // 2

    run_dir = tmp_path / "lost"
    run_dir.mkdir()
    (survivor_code, survivor_log), (lost_code, _) = sorted(elastic_job(script, [str(run_dir), str(batch_size),
                                                                                "lose", str(LOST_AT)]),
                                                            key=lambda job: job[0] != 0)
    assert survivor_code == 0 and lost_code == -9, survivor_log[-4000:]
    result = json.loads((run_dir / "result-rank0.json").read_text())
    assert result["attempt"] == 1 and result["world"] == 1  # restarted once, alone
    assert result["steps"] == EPOCHS * N // GLOBAL_BATCH and result["samples"] == EPOCHS * N
    assert result["batch"] == GLOBAL_BATCH  # one rank now carries the whole optimizer batch

    records = journal(run_dir)
    resumed_at = LOST_AT // EVERY * EVERY  # the last checkpoint before the loss
    (changed,) = [r for r in records if r["kind"] == "world_changed"]
    assert (changed["from_world"], changed["to_world"], changed["step"]) == (2, 1, resumed_at)
    assert [r["step"] for r in records if r["kind"] == "resume" and r["found"]] == [resumed_at]

    same_weights(run_dir, whole)
    counted = trained(run_dir, 0, before_step=resumed_at) + trained(run_dir, 1)
    assert sorted(counted) == sorted(list(range(N)) * EPOCHS)


def test_a_node_that_joins_is_taken_in_by_torchrun_restarting_the_job_and_the_run_ends_as_if_it_had_not(tmp_path,
                                                                                                        whole):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)

    run_dir = tmp_path / "joined"
    run_dir.mkdir()
    jobs = elastic_job(script, [str(run_dir), str(GLOBAL_BATCH), "join", str(LOST_AT)],
                       join_at_marker=run_dir / "waiting")
    assert [code for code, _ in jobs] == [0, 0], jobs[0][1][-4000:]
    results = [json.loads((run_dir / f"result-rank{rank}.json").read_text()) for rank in (0, 1)]
    assert all(r["world"] == 2 and r["batch"] == GLOBAL_BATCH // 2 for r in results)  # the same batch, halved
    assert all(r["steps"] == EPOCHS * N // GLOBAL_BATCH and r["samples"] == EPOCHS * N for r in results)

    resumed_at = LOST_AT // EVERY * EVERY
    (changed,) = [r for r in journal(run_dir) if r["kind"] == "world_changed"]
    assert (changed["from_world"], changed["to_world"], changed["step"]) == (1, 2, resumed_at)
    same_weights(run_dir, whole)
    # A restart for a join is no failure: the attempt stays 0; the ranks tell the two jobs apart.
    counted = trained(run_dir, 0, before_step=resumed_at, world=1) + trained(run_dir, 0, world=2)
    assert sorted(counted) == sorted(list(range(N)) * EPOCHS)
