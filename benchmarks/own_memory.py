"""autotune's own memory, part by part, beside a plain loop's (issue 34).

Each row is a fresh process: a small MLP trained by hand for a few steps (warm: its weights,
gradients, optimizer state and libraries in place), then what the row adds, trained the same
number of steps again. Reported: what the process's virtual size (what RLIMIT_AS counts) and
resident size grew by over the warm hand loop, and the resident size of the monitor process
(a cgroup counts it; RLIMIT_AS does not, it is another process). glibc's default malloc arenas
(no MALLOC_ARENA_MAX), as a user's process has them; the address-space cap autotune is given
is set before the trainer is built, as a user under a cap would.

With `--compare-with DIR` (a checkout of an earlier autotune), its rows too, in the same run.

    python benchmarks/own_memory.py [--compare-with DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import write_results  # noqa: E402

ROOT = Path(__file__).parents[1]

CHILD = r"""
import json, os, sys, tempfile, psutil, torch
from torch import nn
from torch.utils.data import TensorDataset
row = sys.argv[1]
OPTIONS = {  # what each AutoTrainer row turns on
    "AutoTrainer, no policies, no monitor, no checkpoints": {"policies": [], "monitor": False, "checkpoint_interval": None},
    "AutoTrainer, default preset": {"monitor": False, "checkpoint_interval": None},
    "AutoTrainer, default preset, monitor": {"checkpoint_interval": None},
    "AutoTrainer, default preset, monitor, checkpoints": {"checkpoint_every": 4},  # written on a thread
}
torch.manual_seed(0)
data = TensorDataset(torch.randn(4096, 64), torch.randint(0, 10, (4096,)))
model = nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 10))
optimizer = torch.optim.AdamW(model.parameters())
def by_hand(steps):
    for i in range(steps):
        x, y = data[i * 64:(i + 1) * 64]
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step(); optimizer.zero_grad(set_to_none=True)
def sizes():
    me = psutil.Process()
    return me.memory_info().vms, me.memory_info().rss
by_hand(16)
before = sizes()
monitor = 0
if row == "a plain loop, 16 steps more":
    by_hand(16)
else:
    from autotune import AutoTrainer
    from autotune.memory.limits import cap_address_space
    cap_address_space(2 * 2**30)  # a cap far from binding: what counts is what autotune reserves under one
    seen = {}
    class AtTheLastStep:  # read while the run is live: its threads and its monitor process running
        def on_step_end(self, trainer):
            if trainer.step == 15:
                seen["sizes"] = sizes()
                seen["monitor"] = sum(c.memory_info().rss for c in psutil.Process().children(recursive=True))
    trainer = AutoTrainer(model, data, loss_fn=nn.functional.cross_entropy, optimizer=optimizer, batch_size=64,
                          device="cpu", run_dir=tempfile.mkdtemp(), progress=False, shuffle=False,
                          callbacks=[AtTheLastStep()], **OPTIONS[row])
    trainer.fit(max_steps=16)
    after, monitor = seen["sizes"], seen["monitor"]
    trainer.close()
    print(json.dumps({"virtual": after[0] - before[0], "resident": after[1] - before[1], "monitor": monitor}))
    raise SystemExit(0)
after = sizes()
print(json.dumps({"virtual": after[0] - before[0], "resident": after[1] - before[1], "monitor": 0}))
"""

ROWS = ["a plain loop, 16 steps more", "AutoTrainer, no policies, no monitor, no checkpoints",
        "AutoTrainer, default preset", "AutoTrainer, default preset, monitor",
        "AutoTrainer, default preset, monitor, checkpoints"]


def measure(row: str, tree: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "MALLOC_ARENA_MAX"}
    env.update(PYTHONPATH=str(tree), OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-c", CHILD, row], capture_output=True, text=True, env=env, cwd=tree,
                          timeout=300)
    if proc.returncode != 0:
        raise RuntimeError(f"{row} ({tree}): {proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--compare-with", default=None, help="a checkout of an earlier autotune (its root folder)")
    args = parser.parse_args()
    trees = [("this tree", ROOT)]
    if args.compare_with:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=args.compare_with).stdout.strip()
        trees.append((f"{commit or args.compare_with} (--compare-with)", Path(args.compare_with)))
    MiB = 2**20
    lines = ["| autotune | what runs after the warm hand loop | virtual size grew (MiB) | resident grew (MiB) | "
             "the monitor process, resident (MiB) |", "| --- | --- | --- | --- | --- |"]
    for name, tree in trees:
        for row in ROWS:
            if name != "this tree" and row == ROWS[0]:
                continue  # no autotune in it
            figures = measure(row, tree)
            lines.append(f"| {name if row != ROWS[0] else '-'} | {row} | {figures['virtual'] / MiB:.1f} | "
                         f"{figures['resident'] / MiB:.1f} | {figures['monitor'] / MiB:.1f} |")
            print(lines[-1], file=sys.stderr)
    lines += ["", "A fresh process a row: an MLP 64-512-10 with AdamW trained 16 steps by hand (warm), then the row's "
              "16 steps; the growth over the warm loop, read at the 15th step (the run's threads and its monitor "
              "process live; checkpoints: every 4 steps, three written by then). glibc's default malloc arenas; under an address-space cap "
              "of 2 GiB above the warm size set before the trainer is built (autotune takes one malloc arena "
              "then). The monitor is another process: RLIMIT_AS does not count it, a cgroup does."]
    write_results("own_memory", "autotune's own memory beside a plain loop (CPU)", lines)


if __name__ == "__main__":
    main()
