"""rewind.py: a failed attempt leaves no trace in the random streams or the model's buffers."""

import json

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from autotune import Tuner
from autotune.step.rewind import Rewind


def _cnn(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Dropout(0.3),
                         nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Dropout(0.2), nn.Linear(8, 4))


def _batches():
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(96, 3, 8, 8, generator=g), torch.randint(0, 4, (96,), generator=g))
    return list(DataLoader(data, batch_size=32))


def _train(tmp_path, name, fail_at=None, keep_effective_batch=True):
    """Six batches of 32 at micro-batch 8 with the same seeds; `fail_at=(step, micro)`: that micro-batch's
    forward runs, then the allocator refuses (real: a tensor no machine holds), once."""
    model = _cnn()
    calls = []

    def step_fn(module, micro):
        x, y = micro
        out = module(x)  # BatchNorm's statistics updated, dropout's masks drawn: then the failure
        calls.append(tuner.step_count)
        if fail_at is not None and (tuner.step_count, calls.count(tuner.step_count)) == fail_at and not failed:
            failed.append(True)
            torch.empty(1 << 62, dtype=torch.uint8)  # DefaultCPUAllocator: can't allocate memory
        return nn.functional.cross_entropy(out, y)

    failed: list[bool] = []
    torch.manual_seed(7)  # dropout's stream, alike in both runs
    with Tuner(model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), step_fn=step_fn,
               device="cpu", run_dir=tmp_path / name, monitor=False, micro_batch_size=8, policies=None,
               keep_effective_batch=keep_effective_batch) as tuner:
        tuner.recovery.retries_same_size = True  # the retry at the same split (CUDA's default; CPU's is off)
        for _ in range(2):
            for batch in _batches():
                tuner.step(batch)
        ooms = tuner.ooms
    return model, ooms


def test_an_oom_retried_at_the_same_split_ends_bit_equal_to_a_run_without_it(tmp_path):
    # The failed attempt ran two micro-batches' forwards (and one backward) before the refusal:
    # without the rewind its running statistics count twice and the retry draws new dropout masks.
    plain, none = _train(tmp_path, "plain")
    retried, ooms = _train(tmp_path, "retried", fail_at=(2, 2))
    assert (none, ooms) == (0, 1)
    kinds = [json.loads(line)["kind"] for line in (tmp_path / "retried" / "events.jsonl").read_text().splitlines()]
    assert "oom_retry" in kinds  # retried at the same micro-batch, not a smaller one
    for (name, a), b in zip(plain.state_dict().items(), retried.state_dict().values()):
        assert torch.equal(a, b), name
    assert int(retried[1].num_batches_tracked) == 2 * 3  # once per optimizer batch (norm_stats.py): 2 epochs x 3


def test_without_keep_effective_batch_the_chunks_stepped_before_the_failure_keep_their_statistics(tmp_path):
    # Each micro-batch is its own optimizer step: the failed one is rewound to its own start, the
    # steps before it are not.
    plain, _ = _train(tmp_path, "plain", keep_effective_batch=False)
    retried, ooms = _train(tmp_path, "retried", fail_at=(5, 1), keep_effective_batch=False)
    assert ooms == 1
    for (name, a), b in zip(plain.state_dict().items(), retried.state_dict().values()):
        assert torch.equal(a, b), name


def test_only_the_buffers_a_forward_writes_are_copied_each_attempt():
    class WithMask(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = nn.BatchNorm1d(4)
            self.register_buffer("mask", torch.ones(1000, 1000))  # read, never written (a GPT's causal mask)
            self.register_buffer("seen", torch.zeros((), dtype=torch.long))

        def forward(self, x):
            return self.norm(x) * self.mask[0, :4]

    model = WithMask()
    rewind = Rewind(model, torch.device("cpu"))
    x = torch.randn(8, 4)
    rewind.keep()  # the first attempt: every buffer copied once
    model(x)
    rewind.keep()  # learned: the norm's statistics moved (or are a norm's), the mask did not
    watched = {id(b) for b in rewind._watched}
    assert id(model.mask) not in watched and id(model.norm.running_mean) in watched
    assert id(model.seen) not in watched
    model.seen += 1  # a buffer written in place for the first time, later
    model(x)
    rewind.keep()
    assert id(model.seen) in {id(b) for b in rewind._watched}
    before = (model.norm.running_mean.clone(), int(model.seen), torch.get_rng_state())
    model(x)
    model.seen += 1
    torch.rand(3)
    rewind.restore()
    assert torch.equal(model.norm.running_mean, before[0]) and int(model.seen) == before[1]
    assert torch.equal(torch.get_rng_state(), before[2])


def test_a_model_that_draws_nothing_stops_keeping_the_random_streams(tmp_path):
    # A copy of the CPU stream is ~10 us of a small step: learned from the first whole attempt.
    for model, draws in ((nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1)), False),
                         (nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.5), nn.Linear(8, 1)), True)):
        with Tuner(model, torch.optim.SGD(model.parameters(), lr=0.1), loss_fn=nn.functional.mse_loss,
                   device="cpu", run_dir=tmp_path / str(draws), monitor=False) as tuner:
            for _ in range(3):
                tuner.step((torch.randn(8, 4), torch.randn(8, 1)))
            assert tuner.core.rewind.streams_move is draws


def test_a_batchnorm_in_eval_at_first_and_trained_later_is_rewound_too(tmp_path):
    # A frozen backbone (its BatchNorm in eval mode) unfrozen after two steps. The first attempt saw
    # its statistics stand still, and BatchNorm's kernel writes them without moving their in-place
    # version: only the rule that keeps every norm's buffers watched puts back what a failed
    # attempt wrote. The batch runs in one piece, so BatchNorm updates them itself in the forward.
    def train(fail_at=None):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 1))
        model[1].eval()
        g = torch.Generator().manual_seed(1)
        batches = [(torch.randn(16, 4, generator=g), torch.randn(16, 1, generator=g)) for _ in range(5)]
        failed = []

        def step_fn(module, micro):
            x, y = micro
            out = module(x)  # the running statistics written, then the failure
            if tuner.step_count == fail_at and not failed:
                failed.append(True)
                torch.empty(1 << 62, dtype=torch.uint8)  # DefaultCPUAllocator: can't allocate memory
            return nn.functional.mse_loss(out, y)

        with Tuner(model, torch.optim.SGD(model.parameters(), lr=0.1), step_fn=step_fn, device="cpu",
                   run_dir=tmp_path / f"run{fail_at}", monitor=False, policies=None) as tuner:
            tuner.recovery.retries_same_size = True  # the retry at the same size (CUDA's default)
            for i, batch in enumerate(batches):
                if i == 2:
                    model[1].train()  # unfrozen
                tuner.step(batch)
            assert tuner.ooms == (fail_at is not None)
        return model

    plain, retried = train(), train(fail_at=3)
    assert int(plain[1].num_batches_tracked) == 3
    for (name, a), b in zip(plain.state_dict().items(), retried.state_dict().values()):
        assert torch.equal(a, b), name


def test_an_attempt_rolled_back_leaves_no_trace_and_one_committed_settles_batchnorm(tmp_path):
    # StepCore.attempt's own two ends, without the batch loop: the side state is the attempt's.
    model = _cnn()
    x, y = _batches()[0]
    with Tuner(model, torch.optim.SGD(model.parameters(), lr=0.0), loss_fn=nn.functional.cross_entropy,
               device="cpu", run_dir=tmp_path / "run", monitor=False, policies=None, micro_batch_size=32) as tuner:
        tuner.step((x, y))  # a whole attempt first: rewind.py has learned what moves
        before = {name: b.clone() for name, b in model.named_buffers()}
        stream = torch.get_rng_state()
        attempt = tuner.core.attempt((x, y), 32, 0, 8)  # four micro-batches: BatchNorm's sums, dropout's draws
        assert len(attempt.losses.parts) == 4 and not torch.equal(torch.get_rng_state(), stream)
        attempt.roll_back()
        assert not attempt.losses.parts and not tuner.core.norms.active
        assert torch.equal(torch.get_rng_state(), stream)
        for name, b in model.named_buffers():
            assert torch.equal(b, before[name]), name
        model.zero_grad()
        tuner.core.attempt((x, y), 32, 0, 8).commit()
    # Committed: the first BatchNorm's statistics moved once, toward the whole batch's (lr 0: the
    # weights as they were; the second BatchNorm's input was normalised per micro-batch).
    whole = _cnn()
    whole.load_state_dict({**whole.state_dict(), **before})
    with torch.no_grad():
        whole.train()(x)
    for (name, a), b in zip(model[1].named_buffers(), whole[1].buffers()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)
    assert int(model[1].num_batches_tracked) == 2 and not torch.equal(model[1].running_mean, before["1.running_mean"])
