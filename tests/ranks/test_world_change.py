"""Resume on another number of ranks (issue 33): a run checkpointed at world size A and resumed at
world size B trains the same global batches as an uninterrupted run at A: the same samples in the
same optimizer steps, every sample once an epoch, and the same weights within float tolerance.

Two FSDP2 (gloo) ranks under torchrun against one process alone, both ways: a sharded checkpoint read
whole, a whole one read into shards (DDP both ways: tests/ranks/test_elastic.py). The tolerance: the batch's
gradient is the same sum over the same samples, added in another order (two ranks' means averaged,
or one rank's accumulated micro-batches): float32 rounding, ~1e-7 relative a step, over 32 SGD steps
with momentum."""

import json

import pytest
import torch

from autotune.observe.report import render, summarize
from tests.conftest import journal, python, torchrun

pytestmark = pytest.mark.slow

N, GLOBAL_BATCH, EPOCHS, STOP_AT = 512, 32, 2, 11  # 16 steps an epoch; the stop is mid-epoch 1

SCRIPT = r'''
import json, os, sys, torch
from torch import nn
from torch.utils.data import Dataset
from autotune import AutoTrainer

run_dir, phase, tag, batch_size, shard = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5] == "shard"
world = int(os.environ.get("WORLD_SIZE", "1"))
rank = int(os.environ.get("RANK", "0"))

class Numbered(Dataset):
    """Samples that carry their own index, so the test can see which were trained."""
    def __init__(self):
        g = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn({N}, 8, generator=g), torch.randint(0, 3, ({N},), generator=g)
    def __len__(self):
        return len(self.x)
    def __getitem__(self, i):
        return self.x[i], self.y[i], i

seen = []
def step(model, micro):
    x, y, ids = micro
    seen.extend(ids.tolist())
    return nn.functional.cross_entropy(model(x), y)

torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 3))
# The script as a user leaves it when a node is lost: each rank's batch_size as on the first job.
trainer = AutoTrainer(model, Numbered(), step_fn=step, batch_size=batch_size, device="cpu",
                      optimizer=lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9), run_dir=run_dir,
                      progress=False, monitor=False, checkpoint_interval=None, seed=3, shard=shard)
if phase == "first":
    result = trainer.fit(epochs={EPOCHS}, max_steps={STOP_AT})
else:
    result = trainer.fit(epochs={EPOCHS}, resume=phase == "resume")
if shard and world > 1:  # the whole weights from every rank's shards (a collective: before close)
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    weights = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
else:
    weights = model.state_dict()
trainer.close()
if rank == 0:
    torch.save(weights, os.path.join(run_dir, f"final-{{tag}}.pt"))
with open(os.path.join(run_dir, f"seen-{{tag}}-rank{{rank}}.json"), "w") as f:
    json.dump({{"seen": seen, "steps": result.steps, "samples": result.samples_seen,
               "batch": result.batch_size}}, f)
'''.format(N=N, EPOCHS=EPOCHS, STOP_AT=STOP_AT)


def run(tmp_path, world, run_dir, phase, tag, batch_size, shard=False):
    """The script on `world` ranks: 2 under torchrun (gloo), 1 as a plain process; `shard`: FSDP2
    where there are ranks to shard over."""
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    args = [str(run_dir), phase, tag, str(batch_size), "shard" if shard else "whole"]
    results = [run_dir / f"seen-{tag}-rank{rank}.json" for rank in range(world)]
    if world == 2:
        torchrun(script, args, results)
    else:
        proc = python([str(script), *args], tmp_path, {"OMP_NUM_THREADS": "1"}, timeout=240)
        assert proc.returncode == 0, proc.stderr[-4000:]
    return [json.loads(path.read_text()) for path in results]


# DDP from two ranks to one and from one to two: tests/ranks/test_elastic.py, where torchrun restarts the job
# after a node is lost or joins.
@pytest.mark.parametrize("before, after, shard", [(2, 1, True), (1, 2, True)],
                         ids=["fsdp2-2-ranks-then-1", "1-rank-then-fsdp2-2"])
def test_a_resume_on_another_number_of_ranks_trains_the_same_batches_to_the_same_weights(tmp_path, before, after,
                                                                                        shard):
    # fsdp2: the sharded job's checkpoint is a folder of both ranks' shards (DCP), read whole by one process;
    # one process's checkpoint is a file of whole tensors, each rank keeping its shards of them.
    batch_size = GLOBAL_BATCH // before  # each rank's, as the first job's script says; the resumed job keeps it
    whole = tmp_path / "whole"
    run(tmp_path, before, whole, "whole", "whole", batch_size, shard)
    broken = tmp_path / "broken"
    first = run(tmp_path, before, broken, "first", "first", batch_size, shard)
    assert all(r["steps"] == STOP_AT for r in first)
    if shard:
        assert (broken / "checkpoints" / f"step-{STOP_AT:09d}").is_dir() == (before > 1)
    resumed = run(tmp_path, after, broken, "resume", "resumed", batch_size, shard)

    # The same weights as the run that was never stopped, to float32 rounding (see the module docstring).
    reference = torch.load(whole / "final-whole.pt", weights_only=True)
    weights = torch.load(broken / "final-resumed.pt", weights_only=True)
    for key, value in reference.items():
        torch.testing.assert_close(weights[key], value, rtol=1e-5, atol=1e-6)
    # Every sample once an epoch: the first job's samples and the resumed job's together.
    seen = [i for r in first + resumed for i in r["seen"]]
    assert sorted(seen) == sorted(list(range(N)) * EPOCHS)
    assert all(r["samples"] == N * EPOCHS and r["steps"] == EPOCHS * N // GLOBAL_BATCH for r in resumed)
    assert all(r["batch"] == GLOBAL_BATCH // after for r in resumed)  # each rank's share of the same batch
    (changed,) = [r for r in journal(broken) if r["kind"] == "world_changed"]
    assert (changed["from_world"], changed["to_world"], changed["step"]) == (before, after, STOP_AT)
    assert (changed["batch_size_from"], changed["batch_size_to"]) == (GLOBAL_BATCH // before, GLOBAL_BATCH // after)
    assert changed["global_batch"] == GLOBAL_BATCH
    shown = render(summarize(broken))
    assert (f"ranks: {before} from step 0 (batch {GLOBAL_BATCH // before} each) -> {after} from step {STOP_AT} "
            f"(batch {GLOBAL_BATCH // after} each)") in shown, shown
