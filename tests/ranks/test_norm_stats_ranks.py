"""Under torchrun (two gloo ranks on CPU): BatchNorm's running statistics follow norm_stats.py's rule on
every rank, under DDP and under FSDP2 (micro-batches of 8 of each rank's 32: a whole-batch loop's
statistics over that rank's samples, `num_batches_tracked` = steps), and after every step the ranks hold
rank 0's, as DDP keeps them. `Tuner.evaluate` under DDP: an OOM on one rank (real, RLIMIT_AS) is that
rank's alone (an evaluation forward is no collective): it halves its own pieces, gives the uncapped
result, and the ranks train on together; under FSDP2 it is refused on every rank."""

import json

import pytest

from tests.conftest import torchrun

pytestmark = pytest.mark.slow

SCRIPT = r'''
import json, os, sys, torch
from torch import nn
from autotune import Tuner
from autotune.memory.limits import cap_address_space, lift_address_space_cap

root, rank = sys.argv[1], int(os.environ["RANK"])
HOG = 2**20  # bytes per sample an evaluation allocates: what the cap on rank 1 refuses at 64 samples

class TwoBranches(nn.Module):  # tests/step/test_norm_stats.py's: BatchNorms on the raw input, side by side
    def __init__(self):
        super().__init__()
        self.conv = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                                  nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.wide = nn.Sequential(nn.Flatten(), nn.BatchNorm1d(3 * 8 * 8), nn.Linear(192, 8))
        self.head = nn.Linear(8, 4)
    def forward(self, x):
        return self.head(self.conv(x) + self.wide(x))

def batches(seed, steps=4):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(32, 3, 8, 8, generator=g) * 2 + 1, torch.randint(0, 4, (32,), generator=g))
            for _ in range(steps)]

def eval_loss(model, batch):
    torch.empty(HOG * len(batch[0]), dtype=torch.uint8).fill_(1)  # grows with the piece: the cap can refuse it
    return nn.functional.cross_entropy(model(batch[0]), batch[1])

out = {}
for case in ("ddp", "fsdp2"):
    torch.manual_seed(0)
    model = TwoBranches()
    mine = batches(1 + rank)
    # lr 0: every BatchNorm sees the same inputs in both loops; what differs is how the statistics are gathered.
    with Tuner(model, lambda params: torch.optim.SGD(params, lr=0.0), loss_fn=nn.functional.cross_entropy,
               device="cpu", run_dir=os.path.join(root, case), monitor=False, micro_batch_size=8, batch_size=32,
               shard=case == "fsdp2") as tuner:
        for batch in mine:
            tuner.step(batch)
        stats = {name: value.detach().clone() for name, value in model.state_dict().items()
                 if "running" in name or "num_batches_tracked" in name}
        gathered = [None, None]
        torch.distributed.all_gather_object(gathered, stats)
        evaluated = {}
        eval_batch = (torch.cat([b[0] for b in mine[:2]]), torch.cat([b[1] for b in mine[:2]]))  # 64 samples
        if case == "ddp":
            uncapped = float(tuner.evaluate(eval_batch, eval_loss))
            tuner.evaluator.micro_batch_size = 64  # the next evaluation starts whole again
            if rank == 1:
                cap_address_space(40 * 2**20)  # 64 samples x 1 MiB cannot be had; 32 can
            capped = float(tuner.evaluate(eval_batch, eval_loss))
            lift_address_space_cap()
            tuner.step(mine[0])  # and the ranks still train together
            evaluated = {"uncapped": uncapped, "capped": capped, "eval_ooms": tuner.evaluator.ooms,
                         "eval_micro": tuner.evaluator.micro_batch_size, "steps": tuner.step_count}
        else:
            try:
                tuner.evaluate(eval_batch, eval_loss)
            except NotImplementedError as exc:
                evaluated = {"refused": str(exc)}
    torch.manual_seed(0)
    plain = TwoBranches()  # this rank's samples through BatchNorm a whole batch at a time
    for x, _ in mine:
        plain(x)
    own = {name: value for name, value in plain.state_dict().items() if name in stats}
    out[case] = {"apart": {name: float((stats[name].double() - own[name].double()).abs().max()
                                        / own[name].double().abs().max()) for name in stats},
                 "tracked": sorted({int(v) for n, v in stats.items() if "num_batches_tracked" in n}),
                 "ranks_apart": max(float((a.double() - b.double()).abs().max())
                                    for a, b in zip(gathered[0].values(), gathered[1].values())),
                 **evaluated}
with open(os.path.join(root, f"rank{rank}.json"), "w") as f:
    json.dump(out, f)
'''


def test_batchnorm_statistics_and_evaluation_on_two_ranks(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    torchrun(script, [str(tmp_path)], [tmp_path / f"rank{r}.json" for r in (0, 1)])
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    for case in ("ddp", "fsdp2"):
        # Rank 0's statistics are its whole batches' (as a DDP or FSDP2 loop's rank 0 gathers them); the
        # other rank holds rank 0's after every step: one set of statistics, the one a checkpoint keeps.
        zero = ranks[0][case]
        assert all(apart < 1e-5 for apart in zero["apart"].values()), (case, zero["apart"])
        assert zero["tracked"] == [4], (case, zero)
        assert all(r[case]["ranks_apart"] == 0 for r in ranks), case
    for rank, out in enumerate(ranks):
        ddp = out["ddp"]
        assert abs(ddp["capped"] - ddp["uncapped"]) <= 1e-6 * abs(ddp["uncapped"]), ddp
        assert ddp["steps"] == 5
        # Rank 1's OOM was its own: it halved, rank 0 ran whole.
        assert (ddp["eval_ooms"], ddp["eval_micro"]) == ((1, 32) if rank == 1 else (0, 64)), (rank, ddp)
        assert "FSDP2" in out["fsdp2"]["refused"]
