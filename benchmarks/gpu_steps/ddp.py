"""GPU check (f): DDP, two processes on the one GPU (gloo over CUDA tensors: NCCL refuses two ranks
on one device). A real CUDA OOM on rank 1 only (a request larger than the card, at step 2, on
the batch's first attempt and its same-size retry): both ranks agree, retry once at the same
size, then halve, and both end with the weights of the run where no rank ran out of memory.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _step import Report, main  # noqa: E402
import json  # noqa: E402
import torch  # noqa: E402
from autotune.observe.journal import read_journal  # noqa: E402

RANK = r'''
import json, os, sys, torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import TensorDataset
from autotune import AutoTrainer

out, spikes = sys.argv[1], int(sys.argv[2])
rank = int(os.environ["RANK"])
dist.init_process_group("gloo")  # before autotune's join: NCCL refuses two ranks on one GPU
g = torch.Generator().manual_seed(0)
data = TensorDataset(torch.randn(1024, 64, generator=g), torch.randint(0, 4, (1024,), generator=g))
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 4))
attempts = []

def step(m, batch):
    if rank == 1 and trainer.step == 2 and len(attempts) < spikes:
        attempts.append(1)  # more than the card holds: cudaMalloc refuses, a real CUDA OOM
        torch.empty(2 * torch.cuda.get_device_properties(0).total_memory, dtype=torch.uint8, device="cuda:0")
    return nn.functional.cross_entropy(m(batch[0]), batch[1])

trainer = AutoTrainer(model, data, step_fn=step, batch_size=64, device="cuda:0", progress=False, shuffle=True,
                      optimizer=lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9), run_dir=os.path.join(out, "run"),
                      checkpoint_interval=None)
result = trainer.fit(epochs=1)
weights = {k: v.detach().cpu() for k, v in model.state_dict().items()}
torch.save(weights, os.path.join(out, f"rank{rank}.pt"))
with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
    json.dump({"ooms": result.ooms, "micro": result.micro_batch_size, "samples": result.samples_seen}, f)
trainer.close()
'''


def run(report: Report, device) -> None:
    with tempfile.TemporaryDirectory() as folder:
        script = Path(folder) / "rank.py"
        script.write_text(RANK)
        outcomes = {}
        for name, spikes in (("clean", 0), ("rank 1 OOMs", 2)):
            out = Path(folder) / name.replace(" ", "-")
            out.mkdir()
            proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                                   "--standalone", str(script), str(out), str(spikes)],
                                  capture_output=True, text=True, timeout=240,
                                  env={**os.environ, "OMP_NUM_THREADS": "1"})
            if not report.check(f"{name}: both ranks finished", proc.returncode == 0, proc.stderr[-1500:]):
                return
            outcomes[name] = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]
            outcomes[name + " weights"] = [torch.load(out / f"rank{r}.pt") for r in (0, 1)]
            outcomes[name + " journal"] = list(read_journal(out / "run" / "events.jsonl"))
        report.figure("rank 1 OOMs: each rank's outcome", outcomes["rank 1 OOMs"])
        kinds = [r["kind"] for r in outcomes["rank 1 OOMs journal"]]
        report.check("the OOM was agreed: a same-size retry, then a smaller size on both ranks",
                     kinds.count("oom") >= 2 and kinds.count("oom_retry") == 1
                     and all(o["micro"] == outcomes["rank 1 OOMs"][0]["micro"] for o in outcomes["rank 1 OOMs"]),
                     kinds)
        report.check("every sample once", all(o["samples"] == 1024 for o in outcomes["rank 1 OOMs"]))
        clean, capped = outcomes["clean weights"], outcomes["rank 1 OOMs weights"]
        report.check("both ranks hold the same weights", all(torch.equal(capped[0][k], capped[1][k]) for k in capped[0]))
        report.check("the weights of the run without an OOM", all(
            torch.allclose(capped[0][k], clean[0][k], rtol=1e-4, atol=1e-5) for k in clean[0]))


if __name__ == "__main__":
    main(run)
