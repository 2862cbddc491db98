"""FSDP2 under torchrun: two gloo ranks on CPU, a 4-block transformer sharded per block
(`AutoTrainer(shard=True)`). A real OOM on rank 1 only (RLIMIT_AS), in forward or in backward,
inside block 2: no rank is left in an all-gather or reduce-scatter, both retry the same batch
at the same smaller micro-batch, and the weights equal a run without OOMs; the same with the two
ranks launched as two nodes (one torchrun each, a rendezvous on 127.0.0.1). Killed with SIGKILL
on both ranks and resumed from its sharded checkpoint (torch.distributed.checkpoint), a run ends
with the weights of one that was not killed. A Tuner in the user's own loop, on a model they
sharded with fully_shard, does the same. Activation checkpointing applies to a sharded model;
pruning is refused with its reason. Evaluation runs in lockstep through an OOM."""

import json
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from autotune.run_folder import checksums
from tests.conftest import journal, torchrun

pytestmark = pytest.mark.slow

SCRIPT = r'''
import json, os, signal, sys, torch
from torch import nn
from torch.utils.data import TensorDataset
from autotune import AutoTrainer, OutOfMemory
from autotune.memory.limits import cap_address_space, lift_address_space_cap
from autotune.ranks.sharded import full_state, is_sharded

root, names = sys.argv[1], sys.argv[2].split(",")
rank = int(os.environ["RANK"])
HOG = 2**20  # bytes per sample block 2 allocates: activations that grow with the micro-batch
VOCAB, WIDTH, LENGTH = 64, 32, 16
CASES = {  # name: (OOM phase, rank 1 capped, mode, micro-batch, sharded)
    "clean": ("forward", False, "train", None, True),
    "forward": ("forward", True, "train", None, True),
    "two-nodes": ("forward", True, "train", None, True),  # the same, launched as two machines would
    "backward": ("backward", True, "train", None, True),
    "reliefs": ("backward", True, "reliefs", None, True),
    "items-ddp": ("forward", False, "items", None, False),
    "items-split": ("forward", False, "items", 16, True),
    "step-oom": ("forward", False, "step-oom", None, True),
    "errors": ("forward", False, "errors", None, True),
    "tuner": ("forward", True, "tuner", None, True),  # a Tuner in the user's loop, on a model they sharded
    "kill": ("forward", False, "kill", None, True),
    "resume": ("forward", False, "resume", None, True),
}
phase = "forward"

class Hog(torch.autograd.Function):
    """HOG bytes per sample in forward or in backward: a real allocation the cap can refuse."""
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

class Block(nn.Module):
    def __init__(self, index):
        super().__init__()
        self.index = index
        self.norm1, self.attn = nn.LayerNorm(WIDTH), nn.MultiheadAttention(WIDTH, 2, batch_first=True)
        self.norm2 = nn.LayerNorm(WIDTH)
        self.mlp = nn.Sequential(nn.Linear(WIDTH, 4 * WIDTH), nn.GELU(), nn.Linear(4 * WIDTH, WIDTH))
    def forward(self, x):
        h = self.norm1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        if self.index == 2:
            x = Hog.apply(x)
        return x + self.mlp(self.norm2(x))

class Transformer(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(Block(i) for i in range(4))
        self.norm, self.head = nn.LayerNorm(WIDTH), nn.Linear(WIDTH, VOCAB)
    def forward(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))

def loss_fn(logits, targets):
    return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())

def items_step(model, micro):
    """The mean over label tokens (padding is -100: each sample has its own count), and how many."""
    inputs, targets = micro
    logits = model(inputs)
    return (nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100),
            (targets != -100).sum())

class RunsOutOnRank1(torch.optim.SGD):
    """In mode step-oom, rank 1's second step asks for memory no machine has: a real MemoryError there only."""
    def __init__(self, params):
        super().__init__(params, lr=0.1, momentum=0.9)
        self.steps = 0
    def step(self, closure=None):
        self.steps += 1
        if mode == "step-oom" and rank == 1 and self.steps == 2:  # no checkpoint due at 2: the next attempt tells
            bytearray(1 << 60)
        return super().step(closure)

def halve_every_2_steps(optimizer):
    """The learning rate at the checkpoint of step 3 is not the first one: a resume must restore it."""
    return torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)

class KillAtStep5:
    """SIGKILL on both ranks after step 5 (checkpoints at 3 and 6): nothing is saved on the way out."""
    def on_step_end(self, trainer):
        if trainer.step == 5:
            os.kill(os.getpid(), signal.SIGKILL)

def errors(run_dir):
    """What a sharded model autotune cannot train, or a batch it cannot split alike, says."""
    from torch.distributed.fsdp import fully_shard
    from autotune.ranks.sharded import Sharded
    said = {}
    model = Transformer()
    for block in model.blocks:
        fully_shard(block)
    try:
        Sharded(model)  # the root was not sharded
    except ValueError as exc:
        said["root"] = str(exc)
    fully_shard(model)
    try:
        Sharded(model).same_size(16, 64 if rank == 0 else 60)  # rank 1's batch is shorter
    except ValueError as exc:
        said["lengths"] = str(exc)
    from torch.distributed.device_mesh import init_device_mesh
    hybrid = Transformer()  # HSDP: replicated over a mesh dimension of 1, sharded over the other
    fully_shard(hybrid, mesh=init_device_mesh("cpu", (1, 2), mesh_dim_names=("replicate", "shard")))
    try:
        Sharded(hybrid)
    except ValueError as exc:
        said["hsdp"] = str(exc)
    zeros = torch.zeros(8, LENGTH, dtype=torch.long)
    trainer = AutoTrainer(Transformer(), TensorDataset(zeros, zeros), loss_fn=loss_fn, shard=True, progress=False,
                          monitor=False, run_dir=run_dir)
    try:  # one sample for two ranks: rank 1 would have no forward to match rank 0's
        trainer.evaluate(TensorDataset(zeros[:1], zeros[:1]))
    except ValueError as exc:
        said["evaluation"] = str(exc)
    trainer.close()
    os.makedirs(run_dir, exist_ok=True)
    with open(os.path.join(run_dir, f"rank{rank}.json"), "w") as f:
        json.dump(said, f)

def own_loop(run_dir, data):
    """The user's loop: their fully_shard, their optimizer and loader, `Tuner.step` per batch, rank 1 capped."""
    from torch.distributed.fsdp import fully_shard
    from torch.utils.data import DataLoader
    from autotune import Tuner
    from autotune.data.sampler import EpochSampler
    model = Transformer()
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    tuner = Tuner(model, RunsOutOnRank1(model.parameters()), loss_fn=loss_fn, scheduler=halve_every_2_steps,
                  device="cpu", run_dir=run_dir,
                  monitor=False)
    loss_fn(model(data.tensors[0][:2]), data.tensors[1][:2]).backward()  # warm up before the cap
    model.zero_grad(set_to_none=True)
    if rank == 1:
        cap_address_space(40 * 2**20)
    sampler = EpochSampler(len(data), seed=0, rank=rank, world=2)  # AutoTrainer's order, as in the clean case
    for epoch in range(2):
        sampler.set_epoch(epoch)
        for inputs, targets in DataLoader(data, batch_size=64, sampler=sampler):
            tuner.step((inputs, targets))
    lift_address_space_cap()
    weights = full_state(model, None)[0]
    if rank == 0:
        torch.save(weights, os.path.join(run_dir, "final.pt"))
    # A policy may move one rank's size after the last batch's agreement (each rank measures on its own
    # clock): the loop's end takes rank 0's on every rank, as AutoTrainer's fit does.
    micro = tuner.agree_on_micro_batch()
    with open(os.path.join(run_dir, f"rank{rank}.json"), "w") as f:
        json.dump({"micro": micro, "ooms": tuner.ooms, "samples": tuner.samples_seen,
                   "checks": tuner.ranks.job.checks}, f)
    tuner.close()

for name in names:  # the cases one after another in one job: its start-up is paid once
    phase, capped, mode, micro, sharded = CASES[name]
    run_dir = os.path.join(root, "killed" if mode in ("kill", "resume") else name)
    if mode == "errors":
        errors(run_dir)
        continue
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, VOCAB, (512, LENGTH + 1), generator=g)
    eval_tokens = torch.randint(0, VOCAB, (129, LENGTH + 1), generator=g)
    targets = tokens[:, 1:].clone()
    if mode == "items":  # sample i keeps its first 1 + i % LENGTH labels: micro-batches hold unequal counts
        targets[torch.arange(LENGTH)[None, :] > (torch.arange(512) % LENGTH)[:, None]] = -100
    data = TensorDataset(tokens[:, :-1], targets)
    if mode == "tuner":
        own_loop(run_dir, data)
        continue
    model = Transformer()
    trainer = AutoTrainer(model, data, batch_size=64, device="cpu", shard=sharded, micro_batch_size=micro,
                          **({"step_fn": items_step} if mode == "items" else {"loss_fn": loss_fn}),
                          optimizer=RunsOutOnRank1, scheduler=halve_every_2_steps, run_dir=run_dir,
                          progress=False, monitor=False, checkpoint_interval=None, checkpoint_every=3,
                          callbacks=[KillAtStep5()] if mode == "kill" else None)
    assert is_sharded(model) == sharded
    loss_fn(model(tokens[:2, :-1]), tokens[:2, 1:]).backward()  # warm up before the cap
    model.zero_grad(set_to_none=True)
    if mode == "reliefs":  # on every rank, as an agreed relief is carried out
        from autotune.common.actions import CheckpointActivations, PruneChannels
        assert trainer.tuner.carry_out(CheckpointActivations("test"))
        assert not trainer.tuner.carry_out(PruneChannels(0.25, "test"))  # refused, journaled, nothing changed
    if capped and rank == 1:
        cap_address_space(40 * 2**20)  # 64 samples x 1 MiB cannot be had; 32 can
    try:
        result = trainer.fit(epochs=2, resume=mode == "resume")
    except OutOfMemory as exc:  # step-oom: every rank stops with the same error, none waits in an exchange
        with open(os.path.join(run_dir, f"rank{rank}.json"), "w") as f:
            json.dump({"error": str(exc), "steps": trainer.step}, f)
        trainer.close()
        continue
    said = {}
    if name in ("clean", "forward"):  # 129 samples: rank 0's share ends a round later than rank 1's
        said["eval"] = trainer.evaluate(TensorDataset(eval_tokens[:, :-1], eval_tokens[:, 1:]))["loss"]
        said["eval_micro"] = trainer.evaluator.micro_batch_size
    lift_address_space_cap()
    weights = full_state(model, None)[0] if sharded else model.state_dict()
    if rank == 0:
        torch.save(weights, os.path.join(run_dir, "final.pt"))
        if "eval" in said:  # the same evaluation by hand, the whole model in one process
            whole = Transformer().eval()
            whole.load_state_dict(weights)
            with torch.no_grad():
                said["eval_by_hand"] = loss_fn(whole(eval_tokens[:, :-1]), eval_tokens[:, 1:]).item()
    with open(os.path.join(run_dir, f"rank{rank}.json"), "w") as f:
        json.dump({"micro": result.micro_batch_size, "ooms": result.ooms, "samples": result.samples_seen,
                   "steps": result.steps, "checks": trainer.ranks.job.checks if sharded else None, **said}, f)
    trainer.close()
'''


def job(tmp_path, names, expect_success=True, nodes=1):
    # One torchrun job running `names` in turn; each case writes into tmp_path/<case> (kill, resume: killed).
    script = tmp_path / f"{names[0]}.py"
    script.write_text(SCRIPT)
    folders = [tmp_path / ("killed" if name in ("kill", "resume") else name) for name in names]
    return torchrun(script, [str(tmp_path), ",".join(names)], [folders[-1] / f"rank{r}.json" for r in (0, 1)],
                    timeout=240, expect_success=expect_success, nodes=nodes, folders=folders)


def outcome(tmp_path, name):
    run_dir = tmp_path / name
    ranks = [json.loads((run_dir / f"rank{r}.json").read_text()) for r in (0, 1)]
    return ranks, torch.load(run_dir / "final.pt", weights_only=True), run_dir


def kill_then_resume(tmp_path):
    proc = job(tmp_path, ["kill"], expect_success=False)
    assert proc.returncode != 0 and not (tmp_path / "killed" / "rank0.json").exists()  # nothing written past the kill
    job(tmp_path, ["resume"])


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every case of this file in two jobs at once: most of a job's time is its interpreters starting."""
    tmp = tmp_path_factory.mktemp("sharded")
    names = ["errors", "clean", "forward", "backward", "reliefs", "items-ddp", "items-split", "step-oom", "tuner"]
    with ThreadPoolExecutor(3) as pool:
        for done in [pool.submit(job, tmp, names), pool.submit(kill_then_resume, tmp),
                     pool.submit(job, tmp, ["two-nodes"], nodes=2)]:
            done.result()
    said = {name: [json.loads((tmp / name / f"rank{r}.json").read_text()) for r in (0, 1)]
            for name in ("step-oom", "errors")}
    return {name: outcome(tmp, name) for name in [*names, "killed", "two-nodes"] if name not in said} | said


def assert_same_weights(weights, reference):
    assert weights.keys() == reference.keys()
    for key in reference:
        torch.testing.assert_close(weights[key], reference[key], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("case", ["forward", "backward", "two-nodes"])
def test_an_oom_on_one_rank_of_a_sharded_model_is_survived_by_both(runs, case):
    clean_ranks, clean_weights, _ = runs["clean"]
    ranks, weights, run_dir = runs[case]
    assert clean_ranks[0]["ooms"] == 0 and clean_ranks[0]["micro"] == 64
    assert ranks[0]["micro"] == ranks[1]["micro"] < 64  # the same new size on both ranks
    assert ranks[0]["ooms"] == ranks[1]["ooms"] >= 1  # both saw the agreed failure
    assert ranks[0]["samples"] == ranks[1]["samples"] == clean_ranks[0]["samples"] == 1024  # every sample once
    # Every rank made as many checks as the other: none was left in an exchange the other skipped.
    assert ranks[0]["checks"] == ranks[1]["checks"] > clean_ranks[0]["checks"]
    assert_same_weights(weights, clean_weights)
    assert any(r["kind"] == "oom" for r in journal(run_dir))  # journaled once, by rank 0


@pytest.mark.parametrize("case", ["clean", "forward"])
def test_a_sharded_model_is_evaluated_in_lockstep_through_an_oom_on_one_rank(runs, case):
    # 129 samples: rank 0 runs one forward more than rank 1, which runs a spare one (figures dropped).
    ranks, _, run_dir = runs[case]
    assert ranks[0]["eval"] == ranks[1]["eval"]
    assert ranks[0]["eval"] == pytest.approx(ranks[0]["eval_by_hand"], rel=1e-5)  # every sample once, no spare
    assert ranks[0]["eval_micro"] == ranks[1]["eval_micro"] == (64 if case == "clean" else 32)
    assert [r["micro_batch_size"] for r in journal(run_dir) if r["kind"] == "eval_oom"] == ([] if case == "clean"
                                                                                              else [64])


def test_a_tuner_in_the_users_own_loop_on_a_model_they_sharded_survives_an_oom_on_one_rank(runs):
    ranks, weights, run_dir = runs["tuner"]
    assert ranks[0]["micro"] == ranks[1]["micro"] < 64 and ranks[0]["ooms"] == ranks[1]["ooms"] >= 1
    assert ranks[0]["checks"] == ranks[1]["checks"] and ranks[0]["samples"] == 1024
    assert_same_weights(weights, runs["clean"][1])  # AutoTrainer's clean run: the same order, no OOM


def test_sigkill_of_both_ranks_then_resume_ends_with_the_uninterrupted_weights(runs):
    ranks, weights, run_dir = runs["killed"]
    resumes = [r for r in journal(run_dir) if r["kind"] == "resume" and r["found"]]
    assert resumes and resumes[0]["step"] == 3  # the checkpoint of step 3
    assert len(resumes) == 1, resumes
    assert ranks[0]["steps"] == ranks[1]["steps"] == 8
    assert_same_weights(weights, runs["clean"][1])
    # Sharded checkpoints: a folder per step, each rank's half of the shards in its own file, no whole model.
    folders = sorted((run_dir / "checkpoints").iterdir())
    assert [f.name for f in folders] == ["step-000000003", "step-000000006", "step-000000008"]
    for folder in folders:
        files = {f.name: f.stat().st_size for f in folder.iterdir()}
        assert files.keys() == {".metadata", "__0_0.distcp", "__1_0.distcp", "rest.pt", "SHA256SUMS"}
        assert files["__0_0.distcp"] == files["__1_0.distcp"] > 2 * files["rest.pt"]
        checksums.verify(folder)  # every rank's shards are summed by rank 0, as they are on disk


def test_activation_checkpointing_works_on_a_sharded_model_and_pruning_is_refused_with_its_reason(runs):
    ranks, weights, run_dir = runs["reliefs"]
    records = journal(run_dir)
    assert [r["blocks"] for r in records if r["kind"] == "relief"] == [["blocks.0", "blocks.1", "blocks.2", "blocks.3"]]
    refused = [r for r in records if r["kind"] == "relief_failed"]
    assert refused and refused[0]["relief"] == "pruning" and "sharded with FSDP2" in refused[0]["reason"]
    assert ranks[0]["micro"] == ranks[1]["micro"] and ranks[0]["samples"] == 1024
    assert_same_weights(weights, runs["clean"][1])  # recomputed activations: the same arithmetic, OOM or not


def test_items_weighting_on_a_sharded_model_equals_ddp_at_any_micro_batch(runs):
    # A step that returns (mean over label tokens, tokens): each rank's micro-batches hold unequal
    # counts, and FSDP2 reduce-scatters before any rank knows the others' (see Ranks.divide_by_items).
    ddp = runs["items-ddp"][1]
    assert_same_weights(runs["items-split"][1], ddp)


def test_an_oom_in_one_ranks_optimizer_step_stops_every_rank_with_the_same_error(runs):
    # Rank 1 cannot go on and runs no exchange of the next attempt: it fails the others' first check.
    # (Rank 0's second step went through, rank 1's did not: their step counts differ, as under DDP.)
    for outcome_ in runs["step-oom"]:
        assert "rank 1: out of memory in optimizer.step()" in outcome_["error"], runs["step-oom"]


def test_what_a_sharded_run_cannot_do_is_a_clear_error_on_every_rank(runs):
    for said in runs["errors"]:  # on every rank
        assert "must be fully_shard-ed at its root too" in said["root"]
        assert "every rank's batch must hold as many samples" in said["lengths"] and "60 to 64" in said["lengths"]
        assert "sharded over a 2-D device mesh (HSDP" in said["hsdp"]
        assert said["evaluation"].startswith("evaluation of a sharded model needs a sample on every rank, and a rank's share is empty")
