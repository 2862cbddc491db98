"""The job's strategy (job.py): Single, Replicated and Sharded each answer all of the Protocol, with
the Protocol's parameters, so the loop can call the one in use without asking which it is; every
answer is a behaviour, and each does what its model's layout needs. The process (process.py):
Solo and Ranks answer all of theirs, and a process is not its own strategy."""

import inspect

import pytest
import torch

from autotune.common.oom import UnsafePruning
from autotune.ranks.distributed import Ranks, Solo
from autotune.ranks.job import Job
from autotune.ranks.process import Process
from autotune.ranks.sharded import Sharded
from autotune.ranks.whole_model import Replicated, Single

STRATEGIES = [Single, Replicated, Sharded]


def _methods(cls):
    return {name for name, value in vars(cls).items() if callable(value) and not name.startswith("_")}


def _same_parameters(protocol, cls, name):
    wanted = [p for p in inspect.signature(getattr(protocol, name)).parameters if p != "self"]
    got = [p for p in inspect.signature(getattr(cls, name)).parameters if p != "self"]
    return len(got) == len(wanted), (cls.__name__, name, got, wanted)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_each_strategy_answers_the_whole_protocol(strategy):
    methods = _methods(Job)
    assert len(methods) >= 20  # the Protocol is read at all
    missing = [name for name in methods if not callable(getattr(strategy, name, None))]
    assert missing == [], (strategy.__name__, missing)
    for name in methods:
        same, why = _same_parameters(Job, strategy, name)
        assert same, why


def test_the_job_is_asked_nothing_but_behaviour():
    # No flag for a caller to branch on: the Protocol has methods only, and so do the strategies'
    # classes (Replicated's `bucket` and Sharded's checks are their own instances' state).
    assert not getattr(Job, "__annotations__", {})
    for strategy in STRATEGIES:
        data = [name for name, value in vars(strategy).items() if not name.startswith("_") and not callable(value)]
        assert data == [], (strategy.__name__, data)


def test_the_processes_answer_the_whole_process_protocol():
    methods = _methods(Process)
    assert len(methods) >= 20
    for process in (Solo(), Ranks(rank=1, world=2, local_rank=1)):
        missing = [name for name in methods | set(Process.__annotations__) if not hasattr(process, name)]
        assert missing == [], (type(process).__name__, missing)
        for name in methods:
            same, why = _same_parameters(Process, type(process), name)
            assert same, why


def test_a_process_is_not_its_own_strategy():
    solo, ranks = Solo(), Ranks(rank=0, world=2, local_rank=0)
    assert isinstance(solo.job, Single) and isinstance(ranks.job, Replicated)
    job_only = _methods(Job) - _methods(Process)
    assert not [name for name in job_only if hasattr(solo, name)], "Solo answers the job's questions itself"


class Writer:
    """A run folder that says which way it was asked to write (ranks/job.py's CheckpointWriter)."""

    def __init__(self):
        self.calls = []

    def clear_unfinished(self, step):
        self.calls.append(("clear", step))

    def write_whole(self, state, step):
        self.calls.append(("whole", step))
        return "file"

    def write_shards(self, state, step, is_main):
        self.calls.append(("shards", step, is_main))
        return "folder"


def _sharded():
    # Its answers below touch none of what __init__ sets up (a process group, FSDP2's hooks).
    return object.__new__(Sharded)


def test_each_strategy_writes_and_reads_its_checkpoint_as_its_model_is_held():
    single, replicated, sharded = Single(), Replicated(torch.device("cpu")), _sharded()
    for rank, is_main in ((0, True), (1, False)):
        writers = [Writer() for _ in range(3)]
        written = []
        for job, writer in zip((single, replicated, sharded), writers):
            job.prepare_checkpoint(writer, 5, is_main)
            written.append(job.write_checkpoint(writer, {}, 5, is_main))
        if is_main:
            assert written == ["file", "file", "folder"]
            assert [w.calls for w in writers] == [[("whole", 5)], [("whole", 5)], [("clear", 5), ("shards", 5, True)]]
        else:  # rank 1: a replicated model is rank 0's to write; every rank writes its shards
            assert written[1:] == [None, "folder"]
            assert [w.calls for w in writers[1:]] == [[], [("shards", 5, False)]]
    template = object()
    assert single.reads_shards(template) is template and sharded.reads_shards(template) is template
    assert replicated.reads_shards(template) is None  # it says so (checkpoint_files.NOT_SHARDED), not starts afresh


def test_each_strategy_runs_forwards_prunes_and_weighs_items_as_its_layout_allows():
    single, replicated, sharded = Single(), Replicated(torch.device("cpu")), _sharded()
    batches = [[1, 2], [3]]

    def each(batch):
        return len(batch)

    def in_rounds(batches):
        return -1  # told apart from the sum

    assert single.evaluate(batches, each, in_rounds) == replicated.evaluate(batches, each, in_rounds) == 3
    assert sharded.evaluate(batches, each, in_rounds) == -1
    for job in (single, replicated):
        job.require_free_forwards("Tuner.evaluate", "unsharded")
        job.check_prunable()
        assert job.items_reference(7) == 7
    with pytest.raises(NotImplementedError, match="Tuner.evaluate under FSDP2 .* unsharded"):
        sharded.require_free_forwards("Tuner.evaluate", "unsharded")
    with pytest.raises(UnsafePruning, match="sharded with FSDP2"):
        sharded.check_prunable()
    assert sharded.items_reference(7) == 1  # FSDP2 sums before any rank knows the others' items
    tried = []
    assert single.check_finite_late(lambda: tried.append("single") or True) is True
    assert replicated.check_finite_late(lambda: tried.append("replicated") or True) is False
    assert sharded.check_finite_late(lambda: tried.append("sharded") or True) is False
    assert tried == ["single"]


def test_without_its_own_buffers_a_job_lets_the_ranks_agree_in_full():
    # reduce_with_news: None where the news cannot ride in a gradient all-reduce of autotune's.
    for job in (Single(), Replicated(torch.device("cpu")), _sharded()):
        assert job.reduce_with_news(True, 1, None, 2) is None
        assert job.gradients_untouched() is False
        held = [(torch.nn.Parameter(torch.zeros(1)), torch.ones(1))]
        assert job.held_into_buffers(held) is held  # added after the reduction


def test_a_replicated_jobs_held_gradients_go_into_its_buffers_before_the_reduction():
    from autotune.ranks.gradient_bucket import GradientBucket

    params = [torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(2))]
    job = Replicated(torch.device("cpu"), GradientBucket(params))
    job.zero_grad(None)
    assert job.gradients_untouched()
    held = [(p, p.grad) for p in params]  # views of the buffers, set aside (tuning/batch.py)
    for p in params:
        p.grad = None
    held[0][1].add_(1.0)
    params[0].grad = torch.full((3,), 2.0)  # the attempt's, written beside the buffer
    assert job.held_into_buffers(held) == []
    assert params[0].grad.tolist() == [3.0, 3.0, 3.0] and params[0].grad is held[0][1]
    assert params[1].grad is held[1][1]
    assert not job.gradients_untouched()
