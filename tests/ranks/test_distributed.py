"""torchrun: two gloo ranks on CPU. An OOM on one rank only (real, under RLIMIT_AS on rank 1),
in forward or in backward, must not strand the other rank: both agree, both shrink, both
retry the same batch, and the result equals a two-rank run without any OOM."""

import concurrent.futures
import json

import pytest
import torch

from tests.conftest import torchrun

pytestmark = pytest.mark.slow

# In a rank's script: `agreements` counts the ranks' full agreements (an all-reduce of their
# maximum: distributed.Ranks.agree); a steady step's rides in the gradients' all-reduce instead.
COUNT_AGREEMENTS = r'''
agreements = 0
all_reduce = torch.distributed.all_reduce
def counted_all_reduce(tensor, op=torch.distributed.ReduceOp.SUM, **kwargs):
    global agreements
    agreements += op == torch.distributed.ReduceOp.MAX
    return all_reduce(tensor, op=op, **kwargs)
torch.distributed.all_reduce = counted_all_reduce
'''

SCRIPT = r'''
import json, os, sys, torch
from torch import nn
from torch.utils.data import TensorDataset
from autotune import AutoTrainer
from autotune.memory.limits import cap_address_space, lift_address_space_cap

root, names = sys.argv[1], sys.argv[2].split(",")
rank = int(os.environ["RANK"])
CASES = {"clean": ("forward", False), "forward": ("forward", True), "backward": ("backward", True),
         "two-nodes": ("forward", True)}  # name: (where Hog allocates, rank 1 capped)
phase = "forward"
''' + COUNT_AGREEMENTS + r'''
HOG = 2**20  # bytes per sample a "heavy" layer allocates: activations that grow with the micro-batch

class Hog(torch.autograd.Function):
    """Allocates HOG bytes per sample in forward or in backward: a real allocation the cap can refuse."""
    @staticmethod
    def forward(ctx, x):
        if phase == "forward":
            torch.empty(HOG * x.shape[0], dtype=torch.uint8).fill_(1)
        return x.view_as(x)
    @staticmethod
    def backward(ctx, grad):
        if phase == "backward":
            torch.empty(HOG * grad.shape[0], dtype=torch.uint8).fill_(1)
        return grad

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(16, 64), nn.Linear(64, 4)
    def forward(self, x):
        return self.b(torch.tanh(Hog.apply(self.a(x))))

for name in names:  # the cases one after another in one job: its start-up is paid once
    phase, capped = CASES[name]
    run_dir = os.path.join(root, name)
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(512, 16, generator=g), torch.randint(0, 4, (512,), generator=g))
    model = Net()
    trainer = AutoTrainer(model, data, loss_fn=nn.functional.cross_entropy, batch_size=64, device="cpu",
                          optimizer=lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), run_dir=run_dir,
                          progress=False, monitor=False, checkpoint_interval=None)
    nn.functional.cross_entropy(model(data[:2][0]), data[:2][1]).backward()  # warm up before the cap
    model.zero_grad(set_to_none=True)
    if capped and rank == 1:
        cap_address_space(40 * 2**20)  # 64 samples x 1 MiB cannot be had; 32 can
    agreements = 0
    result = trainer.fit(epochs=2)
    lift_address_space_cap()
    if rank == 0:
        torch.save(model.state_dict(), os.path.join(run_dir, "final.pt"))
    with open(os.path.join(run_dir, f"rank{rank}.json"), "w") as f:
        json.dump({"micro": result.micro_batch_size, "ooms": result.ooms, "samples": result.samples_seen,
                   "steps": result.steps, "agreements": agreements}, f)
'''


def job(tmp_path, names, nodes=1):
    # One torchrun job training the cases `names` in turn, each into tmp_path/<case>.
    script = tmp_path / f"{names[0]}.py"
    script.write_text(SCRIPT)
    torchrun(script, [str(tmp_path), ",".join(names)], [tmp_path / names[-1] / f"rank{r}.json" for r in (0, 1)],
             nodes=nodes, folders=[tmp_path / name for name in names])


def outcome(tmp_path, name):
    run_dir = tmp_path / name
    ranks = [json.loads((run_dir / f"rank{r}.json").read_text()) for r in (0, 1)]
    return ranks, torch.load(run_dir / "final.pt", weights_only=True), run_dir


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The clean run and the OOM cases in one job; beside it the same forward case launched as two
    nodes (one torchrun a rank, as two machines would start them, a rendezvous on 127.0.0.1)."""
    tmp = tmp_path_factory.mktemp("ddp")
    with concurrent.futures.ThreadPoolExecutor(2) as pool:  # with this file's other two jobs: all two at a time
        for done in [pool.submit(job, tmp, ["clean", "forward", "backward"]),
                     pool.submit(job, tmp, ["two-nodes"], nodes=2),
                     pool.submit(step_oom_job, tmp / "step-oom"), pool.submit(items_job, tmp / "items")]:
            done.result()
    return {"root": tmp, **{name: outcome(tmp, name) for name in ("clean", "forward", "backward", "two-nodes")}}


@pytest.mark.parametrize("case", ["forward", "backward", "two-nodes"])
def test_an_oom_on_one_rank_is_survived_by_both(runs, case):
    clean_ranks, clean_weights, _ = runs["clean"]
    ranks, weights, run_dir = runs[case]
    assert clean_ranks[0]["ooms"] == 0
    assert ranks[0]["micro"] == ranks[1]["micro"] < 64  # the same new size on both ranks
    assert ranks[0]["ooms"] == ranks[1]["ooms"] >= 1  # both saw the agreed failure
    assert ranks[0]["samples"] == clean_ranks[0]["samples"] == 1024
    for key in clean_weights:
        torch.testing.assert_close(weights[key], clean_weights[key], rtol=1e-5, atol=1e-6)
    records = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
    assert any(r["kind"] == "oom" for r in records)  # journaled once, by rank 0
    assert ranks[0]["agreements"] > clean_ranks[0]["agreements"]  # the OOM's: agreed in full


def test_a_steady_step_makes_one_collective_its_agreement_rides_in_the_gradients_all_reduce(runs):
    # The clean run agrees in full at its first batch only (nothing agreed before it) and at the
    # end's checkpoint; every other step's agreement was the gradients' all-reduce.
    ranks, _, _ = runs["clean"]
    assert ranks[0]["steps"] == 8
    assert ranks[0]["agreements"] == ranks[1]["agreements"] <= 2, ranks


STEP_OOM = r'''
import json, os, sys, torch
from torch import nn
from torch.utils.data import TensorDataset
from autotune import AutoTrainer, OutOfMemory

root, cases = sys.argv[1], [tuple(map(int, case.split(":"))) for case in sys.argv[2].split(",")]
rank = int(os.environ["RANK"])
fail_at = None

class RunsOutOnRank1(torch.optim.SGD):
    """Rank 1's `fail_at`-th step asks for memory no machine has: a real MemoryError there only."""
    def __init__(self, params):
        super().__init__(params, lr=0.1)
        self.steps = 0
    def step(self, closure=None):
        self.steps += 1
        if rank == 1 and self.steps == fail_at:
            bytearray(1 << 60)
        return super().step(closure)

for fail_at, every in cases:  # one job, the cases one after another: the job survives each
    run_dir = os.path.join(root, f"{fail_at}-{every}")
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(512, 16, generator=g), torch.randint(0, 4, (512,), generator=g))
    trainer = AutoTrainer(nn.Linear(16, 4), data, loss_fn=nn.functional.cross_entropy, batch_size=64, device="cpu",
                          optimizer=RunsOutOnRank1, run_dir=run_dir, progress=False, monitor=False,
                          checkpoint_every=every or None, checkpoint_interval=None)
    try:
        trainer.fit(epochs=2)  # each rank: 4 steps an epoch, 8 in all
        error = None
    except OutOfMemory as exc:
        error = str(exc)
    with open(os.path.join(run_dir, f"rank{rank}.json"), "w") as f:
        json.dump({"error": error, "step": trainer.step}, f)
'''


# What the other rank does next when rank 1's optimizer step fails: the next batch's
# agreement; a checkpoint due at that step (its gather); the end-of-fit checkpoint.
CASES = [(3, 0), (6, 3), (8, 0)]


def step_oom_job(tmp_path):
    tmp_path.mkdir()
    script = tmp_path / "train.py"
    script.write_text(STEP_OOM)
    last = tmp_path / "-".join(map(str, CASES[-1]))
    torchrun(script, [str(tmp_path), ",".join(f"{a}:{b}" for a, b in CASES)], [last / f"rank{r}.json" for r in (0, 1)],
             timeout=180, folders=[tmp_path])


def test_an_oom_in_one_ranks_optimizer_step_stops_every_rank_with_the_same_error(runs):
    tmp_path = runs["root"] / "step-oom"
    for fail_at, every in CASES:
        run_dir = tmp_path / f"{fail_at}-{every}"
        ranks = [json.loads((run_dir / f"rank{r}.json").read_text()) for r in (0, 1)]
        for outcome in ranks:
            assert outcome["error"] and "in optimizer.step()" in outcome["error"], (fail_at, every, ranks)
            assert "rank 1: out of memory in optimizer.step()" in outcome["error"], (fail_at, every, ranks)
        records = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()]
        assert [r for r in records if r["kind"] == "out_of_memory" and r["phase"] == "optimizer_step"]


ITEMS_SCRIPT = r'''
import os, sys, torch
from torch import nn
from torch.utils.data import TensorDataset
from autotune import AutoTrainer

run_dir, micro = sys.argv[1], int(sys.argv[2])
rank = int(os.environ["RANK"])
g = torch.Generator().manual_seed(0)
x, y = torch.randn(64, 8, generator=g), torch.randint(0, 3, (64,), generator=g)
tokens = torch.arange(64) % 5 + 1  # 1 to 5 "label tokens" per sample: ranks and micro-batches differ
torch.save({"x": x, "y": y, "tokens": tokens}, os.path.join(run_dir, "data.pt")) if os.environ["RANK"] == "0" else None

def step(model, micro):
    xb, yb, nb = micro
    per_sample = nn.functional.cross_entropy(model(xb), yb, reduction="none")
    return (per_sample * nb).sum() / nb.sum(), nb.sum()  # the mean over tokens, and how many

class StopOnRank1:
    def on_step_end(self, trainer):
        if rank == 1 and trainer.step == 1:
            trainer.request_stop("rank 1 had enough")

for mode in ("train", "stop"):  # the second run: only rank 1's callback asks to stop
    torch.manual_seed(0)
    model = nn.Linear(8, 3)
    trainer = AutoTrainer(model, TensorDataset(x, y, tokens), step_fn=step, batch_size=16, micro_batch_size=micro,
                          device="cpu", optimizer=lambda p: torch.optim.SGD(p, lr=0.5), run_dir=run_dir + mode,
                          progress=False, monitor=False, checkpoint_interval=None, shuffle=False, clip_grad_norm=0.05,
                          eval_dataset=TensorDataset(x[:21], y[:21], tokens[:21]), eval_batch_size=4,
                          callbacks=[StopOnRank1()] if mode == "stop" else None)
    result = trainer.fit(epochs=1)
    torch.save({"state": model.state_dict(), "metrics": result.metrics, "steps": result.steps,
                "stopped": result.stopped}, os.path.join(run_dir, f"{mode}{rank}.pt"))
'''


def items_job(run_dir):
    run_dir.mkdir()
    script = run_dir / "items.py"
    script.write_text(ITEMS_SCRIPT)
    torchrun(script, [str(run_dir), "3"], [run_dir / f"stop{r}.pt" for r in (0, 1)])


def test_token_weighted_steps_over_two_ranks_equal_one_process_over_all_tokens(runs):
    run_dir = runs["root"] / "items"
    ranks, stopped = ([torch.load(run_dir / f"{mode}{r}.pt", weights_only=True) for r in (0, 1)]
                      for mode in ("train", "stop"))
    saved = torch.load(run_dir / "data.pt", weights_only=True)
    # By hand: each optimizer step's batch is the 32 samples both ranks take (16 each, rank r
    # the r-th of every pair: the sampler's split), the loss the mean over all their tokens.
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    final = ranks[0]["state"]
    x, y, n = saved["x"], saved["y"], saved["tokens"]
    for start in range(0, 64, 32):
        idx = torch.arange(start, start + 32)
        per_sample = torch.nn.functional.cross_entropy(model(x[idx]), y[idx], reduction="none")
        ((per_sample * n[idx]).sum() / n[idx].sum()).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        opt.step()
        opt.zero_grad()
    for name, value in model.state_dict().items():
        torch.testing.assert_close(final[name], value, rtol=1e-5, atol=1e-6)
    # Evaluation: each rank its share of the 21 samples, the sums met: the mean over all tokens.
    with torch.no_grad():
        per_sample = torch.nn.functional.cross_entropy(model(x[:21]), y[:21], reduction="none")
    expected = ((per_sample * n[:21]).sum() / n[:21].sum()).item()
    assert ranks[0]["metrics"] == ranks[1]["metrics"] and ranks[0]["metrics"]["loss"] == pytest.approx(expected, rel=1e-5)
    # A stop that only rank 1's callback asks for stops both ranks at the same step.
    assert [r["steps"] for r in stopped] == [1, 1] and stopped[0]["stopped"] == "another rank's callback asked to stop"


MIXED_DTYPES = r'''
import os, sys, torch
from torch import nn
from autotune import Tuner

rank, out = int(os.environ["RANK"]), sys.argv[1]

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        # bf16 weights beside fp32 ones, as a half-precision model with fp32 norms
        self.a, self.norm, self.b = nn.Linear(8, 16).to(torch.bfloat16), nn.LayerNorm(16), nn.Linear(16, 2)
    def forward(self, x):
        return self.b(self.norm(self.a(x.to(torch.bfloat16)).float()))

g = torch.Generator().manual_seed(rank)
batches = [(torch.randn(16, 8, generator=g), torch.randint(0, 2, (16,), generator=g)) for _ in range(4)]
g = torch.Generator().manual_seed(99)  # the same on every rank: gradients the ranks hold alike
own = (torch.randn(16, 8, generator=g), torch.randint(0, 2, (16,), generator=g))
OWN_AT = 2  # before this step, the loop backpropagates a batch of its own into the gradients (held back)
loss = lambda model, batch: nn.functional.cross_entropy(model(batch[0]), batch[1])
''' + COUNT_AGREEMENTS + r'''
with Tuner(Net(), lambda p: torch.optim.SGD(p, lr=0.5), device="cpu", monitor=False,
           run_dir=os.path.join(out, "run")) as tuner:
    for i, batch in enumerate(batches):
        if i == OWN_AT:
            loss(tuner.model, own).backward()
        tuner.step(batch, loss)
    tuned = dict(tuner.model.state_dict())
plain = nn.parallel.DistributedDataParallel(Net())  # torch's own DDP, which buckets by dtype
optimizer = torch.optim.SGD(plain.parameters(), lr=0.5)
for i, (x, y) in enumerate(batches):
    optimizer.zero_grad()
    if i == OWN_AT:
        loss(plain, own).backward()  # alike on both ranks: averaged, as it was
    nn.functional.cross_entropy(plain(x), y).backward()  # DDP averages the gradients over the ranks
    optimizer.step()
if rank == 0:
    torch.save({"tuned": tuned, "plain": plain.module.state_dict()},
               os.path.join(out, "weights.pt"))
with open(os.path.join(out, f"rank{rank}.done"), "w") as f:
    f.write(str(agreements))
'''


def test_a_model_with_bf16_and_fp32_parameters_trains_under_torchrun_as_plain_ddp(tmp_path):
    # One flat gradient buffer in the first parameter's dtype could not hold fp32 gradients beside
    # bf16 ones: the bucket is one buffer per dtype.
    script = tmp_path / "mixed.py"
    script.write_text(MIXED_DTYPES)
    torchrun(script, [str(tmp_path)], [tmp_path / f"rank{r}.done" for r in (0, 1)])
    # The steps' agreements: the first in full (nothing agreed before it), the step after the
    # loop's own backward in full too (gradients held back), the others in the gradients' all-reduce.
    assert [int((tmp_path / f"rank{r}.done").read_text()) for r in (0, 1)] == [2, 2]
    weights = torch.load(tmp_path / "weights.pt", weights_only=True)
    for name, plain in weights["plain"].items():
        # The whole batch in one micro-batch on both sides: the same sums, so the same weights (bf16 ones
        # included) up to the order of a two-rank sum.
        tuned = weights["tuned"][name]
        assert tuned.dtype == plain.dtype and torch.allclose(tuned.float(), plain.float(), rtol=0, atol=1e-6), \
            (name, (tuned - plain).abs().max())
