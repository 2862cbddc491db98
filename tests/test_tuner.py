"""Tuner: a loop the user keeps, with real OOMs (RLIMIT_AS, in subprocesses) and its state round trip."""

import concurrent.futures
import json
import re

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from autotune import Tuner
from autotune.observe.report import summarize
from tests.conftest import journal, run_python, skip_if_uncalibrated

LOOP = """
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from autotune import Tuner
from autotune.memory.limits import calibrate_headroom, cap_address_space, lift_address_space_cap

torch.manual_seed(0)
g = torch.Generator().manual_seed(0)
N, WIDTH, HEAVY_FROM = 640, 16384, 576  # the last tenth of the epoch costs 4x the memory (long sequences)
data = TensorDataset(torch.randn(N, 32, generator=g), torch.randint(0, 4, (N,), generator=g), torch.arange(N))
model = nn.Sequential(nn.Linear(32, WIDTH), nn.ReLU(), nn.Linear(WIDTH, 4))
x = data[:2][0].requires_grad_()  # threads and arenas warmed up at a tiny size (see test_trainer_oom.py)
torch.autograd.grad(nn.functional.cross_entropy(model(x), data[:2][1]), x)
pending, committed = [], []

class RecordingSGD(torch.optim.SGD):  # which samples each completed optimizer step trained on
    def step(self, closure=None):
        committed.extend(pending)
        pending.clear()
        return super().step(closure)

    def zero_grad(self, set_to_none=True):
        pending.clear()
        super().zero_grad(set_to_none)

def step_fn(model, micro):
    x, y, ids = micro
    if pending and int(ids[0]) == pending[0]:
        # A retry starts at the batch's first sample again: the failed attempt trained nothing
        # (Tuner.step drops its gradients itself, not through this optimizer's zero_grad).
        pending.clear()
    pending.extend(ids.tolist())
    if bool((ids >= HEAVY_FROM).any()):
        x, y = x.repeat(4, 1), y.repeat(4)  # 4x the activations, the same mean loss and gradient
    return nn.functional.cross_entropy(model(x), y)

optimizer = RecordingSGD(model.parameters(), lr=0.05, momentum=0.9)
loader = DataLoader(data, batch_size=128, shuffle=False)
losses = []
if PLAIN:  # the hand-written loop it replaces, with no cap
    for epoch in range(2):
        for batch in loader:
            loss = step_fn(model, batch)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
    outcome = {"committed": committed, "losses": losses}
else:
    def probe(size):  # a batch of `size` heavy samples: 128 must not fit, 64 must
        try:
            step_fn(model, data[HEAVY_FROM + torch.arange(size) % (N - HEAVY_FROM)]).backward()
        finally:
            model.zero_grad(set_to_none=True)

    with Tuner(model, optimizer, device="cpu", run_dir=RUN_DIR, monitor=False) as tuner:
        momentum = sum(p.numel() * 4 for p in model.parameters())  # SGD's buffers, at its first step
        calibration = calibrate_headroom(probe, fits=64, fails=128, extra_bytes=momentum)
        if calibration.headroom_bytes is None:
            save({"uncalibrated": str(calibration)})
            raise SystemExit(0)
        pending.clear()  # the probes' samples trained nothing
        cap_address_space(calibration.headroom_bytes)
        for epoch in range(2):
            for batch in loader:
                losses.append(tuner.step(batch, step_fn).item())
        lift_address_space_cap()
        outcome = {"committed": committed, "losses": losses, "ooms": tuner.ooms, "steps": tuner.step_count,
                   "micro_batch_size": tuner.micro_batch_size, "samples_seen": tuner.samples_seen}
torch.save(model.state_dict(), RUN_DIR + "/weights.pt")
save(outcome)
"""


def _loop(tmp_path, name, plain):
    run_dir = tmp_path / name
    run_dir.mkdir()
    proc, result = run_python(f"PLAIN={plain}\nRUN_DIR={str(run_dir)!r}\n" + LOOP, run_dir)
    assert proc.returncode == 0, proc.stderr[-3000:]
    skip_if_uncalibrated(result)
    return result, run_dir


@pytest.mark.slow
def test_a_custom_loop_survives_a_late_memory_jump_with_the_plain_loops_weights(tmp_path):
    with concurrent.futures.ThreadPoolExecutor(2) as pool:  # two interpreters at once
        (plain, plain_dir), (tuned, tuned_dir) = pool.map(lambda plain: _loop(tmp_path, "plain" if plain else "tuned",
                                                                              plain), (True, False))
    assert tuned["ooms"] >= 1 and tuned["micro_batch_size"] < 128
    assert tuned["steps"] == 10 and tuned["samples_seen"] == 1280
    assert sorted(tuned["committed"]) == sorted(plain["committed"]) == sorted(list(range(640)) * 2)
    records = journal(tuned_dir)
    first_oom = next(r for r in records if r["kind"] == "oom")
    assert first_oom["step"] == 4 and first_oom["micro_batch_size"] == 128  # the batch with the heavy samples
    a = torch.load(plain_dir / "weights.pt", weights_only=True)
    b = torch.load(tuned_dir / "weights.pt", weights_only=True)
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(torch.tensor(tuned["losses"]), torch.tensor(plain["losses"]), rtol=1e-5, atol=1e-6)
    summary = summarize(tuned_dir)  # `autotune report` reads a Tuner's run
    assert summary["status"] == "finished" and summary["ooms"]["survived"] == tuned["ooms"]


def _problem(seed=0):
    torch.manual_seed(seed)
    data = TensorDataset(torch.randn(96, 8), torch.randint(0, 3, (96,)))
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3)), data


def _tuner(model, tmp_path, name, **kw):
    return Tuner(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), loss_fn=nn.functional.cross_entropy,
                 device="cpu", run_dir=tmp_path / name, monitor=False, **kw)


def test_state_dict_continues_a_custom_loop_exactly(tmp_path):
    model, data = _problem()
    batches = list(DataLoader(data, batch_size=16))
    with _tuner(model, tmp_path, "whole", micro_batch_size=8,
                scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, 2, 0.5)) as whole:
        for batch in batches:
            whole.step(batch)
    expected = {k: v.clone() for k, v in model.state_dict().items()}

    model, _ = _problem()
    with _tuner(model, tmp_path, "first", micro_batch_size=8,
                scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, 2, 0.5)) as first:
        for batch in batches[:3]:
            first.step(batch)
        torch.save(first.state_dict(), tmp_path / "mine.pt")  # the user's own checkpoint
    model, _ = _problem(seed=1)  # other weights: the checkpoint must bring them back
    with _tuner(model, tmp_path, "second", micro_batch_size=8,
                scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, 2, 0.5)) as second:
        second.load_state_dict(torch.load(tmp_path / "mine.pt", weights_only=True))
        assert second.step_count == 3 and second.micro_batch_size == 8
        for batch in batches[3:]:
            second.step(batch)
        assert second.scheduler.last_epoch == 6
    for key, value in model.state_dict().items():
        # Float tolerance, not bit equality: on a loaded machine MKL may run a GEMM on fewer threads,
        # which sums in another order (1.5e-8 apart, seen with two busy loops beside the suite).
        torch.testing.assert_close(value, expected[key], rtol=1e-6, atol=1e-7)


def test_state_dict_brings_the_random_streams_back(tmp_path):
    # A resumed run's dropout masks and shuffles are the uninterrupted run's only if the random
    # states come back with the weights.
    model, data = _problem()
    with _tuner(model, tmp_path, "rng") as tuner:
        tuner.step(next(iter(DataLoader(data, batch_size=16))))
        state = tuner.state_dict()
        expected = torch.rand(4), torch.randint(0, 1000, (4,))
        tuner.load_state_dict(state)
        assert torch.equal(torch.rand(4), expected[0]) and torch.equal(torch.randint(0, 1000, (4,)), expected[1])


def test_a_failed_attempt_leaves_nothing_in_its_retry(tmp_path):
    # Batch 2's third micro-batch of 8 is refused by the allocator (real: a tensor no machine can
    # hold) after two micro-batches went through backward: their gradients and losses must not
    # reach the retry at 4, or the weights and the batch's loss differ from a hand loop's.
    from autotune.policies import HalveOnOOM

    model, data = _problem()
    batches = list(DataLoader(data, batch_size=32))
    reference = _problem()[0]
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    expected = []
    for x, y in batches:
        loss = nn.functional.cross_entropy(reference(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        expected.append(loss.item())
    calls = []

    def step_fn(module, micro):
        x, y = micro
        calls.append(len(x))
        if tuner.step_count == 2 and calls[-3:] == [8, 8, 8] and len(calls) == 3:
            torch.empty(1 << 62, dtype=torch.uint8)  # DefaultCPUAllocator: can't allocate memory
        return nn.functional.cross_entropy(module(x), y)

    with _tuner(model, tmp_path, "retry", micro_batch_size=8, policies=[HalveOnOOM()]) as tuner:
        losses = []
        for batch in batches:
            calls.clear()
            losses.append(tuner.step(batch, step_fn).item())
        assert tuner.ooms == 1 and tuner.micro_batch_size == 4
    assert losses == pytest.approx(expected, rel=1e-5)
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_gradients_the_loop_holds_go_into_the_step(tmp_path):
    # A loop that accumulates a batch's gradients by hand before `Tuner.step` (Accelerate's
    # accumulate does): the step is over both batches' gradients, once each.
    model, data = _problem()
    x, y = data.tensors
    reference = _problem()[0]
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    nn.functional.cross_entropy(reference(x[:16]), y[:16]).backward()
    nn.functional.cross_entropy(reference(x[16:32]), y[16:32]).backward()
    optimizer.step()
    with Tuner(model, torch.optim.SGD(model.parameters(), lr=0.1), loss_fn=nn.functional.cross_entropy,
               device="cpu", run_dir=tmp_path / "held", monitor=False, micro_batch_size=8) as tuner:
        nn.functional.cross_entropy(model(x[:16]), y[:16]).backward()
        tuner.step((x[16:32], y[16:32]))
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


def test_a_tuner_that_loads_another_jobs_checkpoint_counts_as_its_own_job(tmp_path):
    # A checkpoint of two ranks (issue 33) loaded by a Tuner alone: its counters, and so its next
    # checkpoints, are of this job's one rank, or a later resume would re-split for a change never made.
    model, data = _problem()
    with _tuner(model, tmp_path, "two", micro_batch_size=8) as tuner:
        tuner.step(next(iter(DataLoader(data, batch_size=16))))
        state = tuner.state_dict()
    state["progress"] = {**state["progress"], "world": 2, "epoch_world": 2}
    model, _ = _problem()
    with _tuner(model, tmp_path, "one", micro_batch_size=8) as tuner:
        tuner.load_state_dict(state)
        assert tuner.step_count == 1
        assert tuner.state_dict()["progress"]["world"] == 1


def test_accumulate_keeps_earlier_gradients_through_a_retry(tmp_path):
    # Two batches into one optimizer step, the second retried after (injected) OOMs: the
    # gradient is the sum of both batches' exactly once.
    model, data = _problem()
    x, y = data.tensors
    reference = _problem()[0]
    for part in (slice(0, 32), slice(32, 64)):
        (nn.functional.cross_entropy(reference(x[part]), y[part]) / 2).backward()
    tuner = Tuner(model, device="cpu", run_dir=tmp_path / "run", monitor=False,
                  reliefs=False, inject_oom=0.6, seed=3)

    def half_mean(module, micro):
        return nn.functional.cross_entropy(module(micro[0]), micro[1], reduction="sum") / 64

    tuner.accumulate((x[:32], y[:32]), half_mean)
    tuner.accumulate((x[32:64], y[32:64]), half_mean)
    tuner.close()
    assert tuner.ooms >= 1
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6)


def test_the_tuners_run_is_on_the_record(tmp_path):
    model, data = _problem()
    tuner = _tuner(model, tmp_path, "run", inject_oom=0.5, seed=2)
    for batch in DataLoader(data, batch_size=32):
        loss = tuner.step(batch)
    assert loss.ndim == 0 and not loss.requires_grad
    tuner.close()
    tuner.close()  # idempotent
    kinds = [r["kind"] for r in journal(tmp_path / "run")]
    assert kinds[0] == "fit_start" and kinds[-1] == "fit_end" and "oom" in kinds
    lines = (tmp_path / "run" / "steps.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 2, 3]
    with pytest.raises(RuntimeError, match="closed"):
        tuner.step(next(iter(DataLoader(data, batch_size=32))))


def test_an_oom_says_once_the_size_the_batch_is_retried_at(tmp_path, capsys):
    """Each OOM's line on stderr names the size that failed and the one the same batch goes on at (the
    journal's next step ran at it), once per pair; "a smaller micro-batch" named none."""
    model, data = _problem()
    with _tuner(model, tmp_path, "run", inject_oom=0.5, seed=2) as tuner:
        for batch in DataLoader(data, batch_size=32):
            tuner.step(batch)
    said = re.findall(r"out of memory at micro-batch (\d+) on cpu; retrying the same batch at micro-batch (\d+) ",
                      capsys.readouterr().err)
    ooms = [r["micro_batch_size"] for r in journal(tmp_path / "run") if r["kind"] == "oom"]
    assert said and len(said) == len(set(said)) and len(said) <= len(ooms), (said, ooms)
    assert all(int(retry) < int(failed) and int(failed) in ooms for failed, retry in said), (said, ooms)
    # the size named is where the batch went on: a later OOM's size, or the size a step completed at
    completed = {json.loads(line)["micro_batch_size"] for line in (tmp_path / "run" / "steps.jsonl").read_text().splitlines()}
    assert all(int(retry) in completed or int(retry) in ooms for _, retry in said), (said, ooms, completed)


def test_bad_tuner_arguments_name_the_problem(tmp_path):
    model, data = _problem()
    with pytest.raises(ValueError, match="step_fn"):
        Tuner(model, device="cpu", run_dir=tmp_path / "a", monitor=False).step(data[:4])
    with pytest.raises(ValueError, match="micro_batch_size .8. cannot exceed batch_size .4."):
        Tuner(model, device="cpu", run_dir=tmp_path / "b", micro_batch_size=8, batch_size=4)
    with pytest.raises(ValueError, match="not both"):
        Tuner(model, device="cpu", run_dir=tmp_path / "c", loss_fn=nn.functional.mse_loss, step_fn=lambda m, b: 0)
    with pytest.raises(TypeError, match="model must be"):
        Tuner(lambda x: x)


def test_a_relief_dropped_for_a_smaller_micro_batch_is_journaled_and_its_policy_told(tmp_path):
    # At an OOM one policy halves the micro-batch and another asks for a relief: the smaller size
    # goes first (reliefs are the last resort), so the relief is dropped: said in the journal, and
    # the policy that asked hears it was not carried out (it may ask again).
    import dataclasses
    from typing import ClassVar

    from autotune.common.actions import UseAutocast
    from autotune.common.events import Event
    from autotune.policies.halve_on_oom import HalveOnOOM
    from autotune.decisions.policy import PolicyBase

    @dataclasses.dataclass
    class AsksForAutocast(PolicyBase):
        name: ClassVar[str] = "asks_for_autocast"
        events: ClassVar[frozenset] = frozenset({Event.OOM})
        told: list = dataclasses.field(default_factory=list)

        def decide(self, event, snap):
            return [UseAutocast(reason="out of memory")]

        def action_suppressed(self, action, why):
            self.told.append((type(action).__name__, why))

    failures = [16]  # the first forward, at the whole batch, runs out of memory

    def step_fn(model, micro):
        if failures and len(micro[0]) == failures[0]:
            failures.pop()
            raise torch.OutOfMemoryError("CPU out of memory (a test's): DefaultCPUAllocator: can't allocate memory")
        return nn.functional.cross_entropy(model(micro[0]), micro[1])

    asks = AsksForAutocast()
    with Tuner(nn.Linear(4, 2), step_fn=step_fn, device="cpu", policies=[HalveOnOOM(), asks], monitor=False,
               run_dir=tmp_path) as tuner:
        tuner.step((torch.randn(16, 4), torch.randint(0, 2, (16,))))
        assert tuner.micro_batch_size == 8 and tuner.reliefs == [] and tuner.step_count == 1
    (dropped,) = [r for r in journal(tmp_path) if r["kind"] == "relief_dropped"]
    assert dropped["relief"] == "use_autocast" and "smaller micro-batch (8)" in dropped["why"]
    assert asks.told == [("UseAutocast", dropped["why"])]


def test_outputs_come_back_in_sample_order_across_micro_batches_and_a_retry(tmp_path):
    # A torchvision-style loop reads acc@1 off the logits: at micro-batch 8 of 32, with an OOM
    # after two micro-batches of batch 2, the logits handed back are the whole batch's, once each.
    from autotune import StepResult
    from autotune.policies import HalveOnOOM

    model, data = _problem()
    batches = list(DataLoader(data, batch_size=32))
    calls = []

    def step_fn(module, micro):
        x, y = micro
        logits = module(x)
        calls.append(len(x))
        if tuner.step_count == 1 and len(calls) == 3:
            torch.empty(1 << 62, dtype=torch.uint8)  # DefaultCPUAllocator: can't allocate memory
        return StepResult(nn.functional.cross_entropy(logits, y), outputs={"logits": logits, "n": len(x)})

    with _tuner(model, tmp_path, "outputs", micro_batch_size=8, policies=[HalveOnOOM()]) as tuner:
        for x, y in batches:
            calls.clear()
            before = {k: v.clone() for k, v in model.state_dict().items()}
            tuner.step((x, y), step_fn)
            reference = _problem()[0]
            reference.load_state_dict(before)
            with torch.no_grad():
                expected = reference(x)
            out = tuner.outputs
            torch.testing.assert_close(out["logits"], expected, rtol=1e-5, atol=1e-6)
            assert not out["logits"].requires_grad
            assert out["n"] == [len(x) // (len(out["n"]))] * len(out["n"])  # not a tensor: one per micro-batch
        assert tuner.ooms == 1 and tuner.micro_batch_size == 4
    plain = Tuner(model, torch.optim.SGD(model.parameters(), lr=0.1), loss_fn=nn.functional.cross_entropy,
                  device="cpu", run_dir=tmp_path / "plain", monitor=False)
    plain.step(batches[0])
    assert plain.outputs is None  # a bare loss hands nothing back
    plain.close()


def test_evaluate_survives_ooms_with_its_own_micro_batch_and_leaves_training_alone(tmp_path):
    # nanoGPT's estimate_loss through the Tuner: eval_fn returns the micro-batch's mean loss; pieces
    # over 8 samples are refused by the allocator (real: a tensor no machine holds), so the batch of
    # 32 runs at 8 after two halvings, and its mean loss and logits are the whole batch's.
    model, data = _problem()
    x, y = data.tensors[0][:32], data.tensors[1][:32]
    sizes = []

    def eval_fn(module, micro):
        inputs, targets = micro
        sizes.append(len(inputs))
        assert not torch.is_grad_enabled() and not module.training
        if len(inputs) > 8:
            torch.empty(1 << 62, dtype=torch.uint8)  # DefaultCPUAllocator: can't allocate memory
        logits = module(inputs)
        return nn.functional.cross_entropy(logits, targets), logits

    with _tuner(model, tmp_path, "eval", micro_batch_size=16) as tuner:
        tuner.step((x, y))
        # The training micro-batch as the step left it (a policy may grow it from 16 when the step's
        # memory shows room: that made this test flaky when it asserted 16).
        training_micro = tuner.micro_batch_size
        loss, logits = tuner.evaluate((x, y), eval_fn)
        assert sizes == [32, 16, 8, 8, 8, 8] and tuner.micro_batch_size == training_micro and model.training
        with torch.no_grad():
            expected = model.eval()(x)
        model.train()
        torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(loss, nn.functional.cross_entropy(expected, y), rtol=1e-5, atol=1e-6)
        sizes.clear()
        tuner.evaluate((x, y), eval_fn)
        assert sizes == [8, 8, 8, 8]  # its micro-batch is remembered between calls
    kinds = [json.loads(line)["kind"] for line in (tmp_path / "eval" / "events.jsonl").read_text().splitlines()]
    assert kinds.count("eval_oom") == 2 and "oom" not in kinds
