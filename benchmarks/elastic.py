"""What a lost node costs: torchrun's elastic mode with autotune's resume, beside a restart from scratch.

A job of two "nodes" (two torchrun agents on 127.0.0.1, one gloo rank each, `--nnodes=1:2
--max-restarts=1`, the rendezvous store hosted by this script) trains a token MLP; at step LOST_AT
the second node's agent and rank are killed with SIGKILL. torchrun restarts the survivor alone. Two
ways on:

- `resume`: `fit(resume=True)`: from the last checkpoint (every EVERY steps), the same optimizer
  batch on one rank (issue 33)
- `scratch`: what a script without a resume does: the restarted rank starts the run over

Reported, medians over rounds: from the kill to the restarted rank's first step (the loss noticed,
the survivor's rendezvous, which waits `last_call_timeout` for another node, the start-up, the load),
and from the kill until the run is back at step LOST_AT (that, and the steps trained again).

    python benchmarks/elastic.py [--rounds 3] [--lost-at 1100] [--every 200]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
from datetime import timedelta
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import write_results  # noqa: E402

LAST_CALL = 10  # seconds the survivor's rendezvous waits for a second node

SCRIPT = r'''
import json, os, signal, sys, time, torch
from torch import nn
from torch.utils.data import Dataset
from autotune import AutoTrainer

run_dir, lost_at, every, resume = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "resume"
rank = int(os.environ["RANK"])
attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
if attempt and not resume:
    run_dir = os.path.join(run_dir, "from-scratch")  # no checkpoint to go on from
torch.set_num_threads(1)

class Tokens(Dataset):
    def __init__(self):
        g = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randint(0, 1000, (8192, 32), generator=g), torch.randint(0, 4, (8192,), generator=g)
    def __len__(self):
        return len(self.x)
    def __getitem__(self, i):
        return self.x[i], self.y[i]

class TokenMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed, self.mlp = nn.Embedding(1000, 64), nn.Sequential(nn.Linear(64, 768), nn.GELU(), nn.Linear(768, 64))
        self.head = nn.Linear(64, 4)
    def forward(self, x):
        return self.head(self.mlp(self.embed(x)).mean(dim=1))

stamps = open(os.path.join(sys.argv[1], f"stamps-attempt{attempt}-rank{rank}.jsonl"), "a", buffering=1)
def step(model, micro):
    if attempt == 0 and rank == 1 and trainer.step == lost_at:
        stamps.write(json.dumps({"killed": time.time()}) + "\n")
        os.kill(os.getppid(), signal.SIGKILL)
        os.kill(os.getpid(), signal.SIGKILL)
    stamps.write(json.dumps({"step": trainer.step, "time": time.time()}) + "\n")
    x, y = micro
    return nn.functional.cross_entropy(model(x), y)

torch.manual_seed(0)
trainer = AutoTrainer(TokenMLP(), Tokens(), step_fn=step, batch_size=16, device="cpu",
                      optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3), run_dir=run_dir, progress=False,
                      monitor=False, checkpoint_interval=None, checkpoint_every=every, seed=0)
trainer.fit(epochs=10, max_steps=lost_at + 5, resume=resume)
trainer.close()
'''


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def one_job(folder: Path, how: str, lost_at: int, every: int) -> dict[str, float]:
    import torch.distributed as dist

    script = folder / "train.py"
    script.write_text(SCRIPT)
    run_dir = folder / how
    run_dir.mkdir()
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, multi_tenant=True, timeout=timedelta(seconds=60))
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1:2", "--nproc-per-node=1",
               "--max-restarts=1", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}",
               f"--rdzv-id=elastic-{how}", "--monitor-interval=0.5",
               "--rdzv-conf", f"is_host=false,last_call_timeout={LAST_CALL}",
               str(script), str(run_dir), str(lost_at), str(every), how]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MALLOC_ARENA_MAX": "1"}
    agents = [subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
              for _ in range(2)]
    codes = sorted(agent.wait(timeout=600) for agent in agents)
    del store
    if codes != [-9, 0]:
        raise RuntimeError(f"the elastic job ended with {codes}, not one node lost and one finished: see {run_dir}")

    def stamps(attempt: int) -> list[dict]:
        return [json.loads(line) for path in run_dir.glob(f"stamps-attempt{attempt}-rank*.jsonl")
                for line in path.read_text().splitlines()]

    killed = next(s["killed"] for s in stamps(0) if "killed" in s)
    before = [s for s in stamps(0) if "step" in s]
    step_seconds = statistics.median(b["time"] - a["time"] for a, b in zip(before, before[1:]) if b["step"] == a["step"] + 1)
    after = [s for s in stamps(1) if "step" in s]
    first = min(s["time"] for s in after)
    back = min(s["time"] for s in after if s["step"] == lost_at)
    redone = lost_at - min(s["step"] for s in after)
    return {"to_first_step": first - killed, "back_at_loss": back - killed, "redone": redone,
            "step_ms": step_seconds * 1e3}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--lost-at", type=int, default=1100)
    parser.add_argument("--every", type=int, default=200)
    args = parser.parse_args()
    rows: dict[str, list[dict[str, float]]] = {"resume": [], "scratch": []}
    for _ in range(args.rounds):
        for how in rows:
            with tempfile.TemporaryDirectory() as folder:
                rows[how].append(one_job(Path(folder), how, args.lost_at, args.every))
                print(how, rows[how][-1], flush=True)

    def med(how: str, key: str) -> float:
        return statistics.median(r[key] for r in rows[how])

    lines = [f"Two nodes of one gloo rank each (two torchrun agents on 127.0.0.1, `--nnodes=1:2 --max-restarts=1`, "
             f"`last_call_timeout={LAST_CALL}`), a token MLP at batch 16 a rank, AdamW, one thread a rank; the "
             f"second node's agent and rank SIGKILLed at step {args.lost_at}; checkpoints every {args.every} steps. "
             f"{args.rounds} rounds, medians. A step before the loss: {med('resume', 'step_ms'):.0f} ms.", "",
             "| after the loss | kill -> first step (s) | kill -> back at the lost step (s) | steps trained again |",
             "| --- | --- | --- | --- |"]
    names = {"resume": "autotune `fit(resume=True)`: the last checkpoint, the same batch on one rank",
             "scratch": "a restart from scratch (no resume)"}
    for how, name in names.items():
        lines.append(f"| {name} | {med(how, 'to_first_step'):.1f} | {med(how, 'back_at_loss'):.1f} | "
                     f"{med(how, 'redone'):.0f} |")
    write_results("elastic", "Elastic: what a lost node costs", lines)


if __name__ == "__main__":
    main()
