"""Sharded checkpoints (folders written with torch.distributed.checkpoint), in one process: DCP
runs without a process group, so the folder's layout, listing, pruning, replacing and refusing
are tested here; two ranks writing their own shards and resuming are in test_sharded.py."""

import pytest
import torch

from autotune.run_folder.checkpoint import Checkpointer
from autotune.run_folder.checkpoint_files import Checkpoints
from autotune.ranks.distributed import Solo
from autotune.ranks.sharded import Sharded
from autotune.ranks.whole_model import Replicated, Single
from autotune.run_folder.sharded_checkpoint import IN_DCP, REST, join, split

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")  # one process: meant


class ShardedLayout(Single):
    """Alone, with a sharded model's checkpoint answers (`Sharded`'s own: one rank, every shard)."""

    reads_shards, prepare_checkpoint, write_checkpoint = (Sharded.reads_shards, Sharded.prepare_checkpoint,
                                                          Sharded.write_checkpoint)


class ShardedSolo(Solo):
    """A process alone whose checkpoints are written as a sharded model's (one rank, every shard)."""

    def __init__(self):
        super().__init__()
        self.job = ShardedLayout()


class Journal:
    path = None  # a journal that writes no file (a rank other than 0's)

    def __init__(self):
        self.records = []

    def write(self, kind, step, epoch, **fields):
        self.records.append({"kind": kind, "step": step, **fields})


def state(step: int) -> dict:
    weight = torch.arange(6.0).reshape(2, 3) + step
    return {"model": {"w": weight, "b": torch.full((2,), float(step))},
            "optimizer": {"state": {"w": {"momentum_buffer": weight * 2, "step": torch.tensor(float(step))}},
                          "param_groups": [{"lr": 0.1, "betas": (0.9, 0.99), "params": ["w", "b"]}]},
            "step": step, "rng": {"torch": torch.get_rng_state()}}


def template() -> dict:
    # The state now, into whose tensors a checkpoint is read: zeros of the same shapes.
    return split_tensors_to_zeros(state(0))


def split_tensors_to_zeros(value):
    if isinstance(value, torch.Tensor):
        return torch.zeros_like(value)
    if isinstance(value, dict):
        return {key: split_tensors_to_zeros(item) for key, item in value.items()}
    return value


def assert_same(a, b):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and torch.equal(a, b), (a, b)
    elif isinstance(a, (dict, list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), (a, b)
        for x, y in zip(a.items() if isinstance(a, dict) else a, b.items() if isinstance(b, dict) else b):
            assert_same(x, y)
    else:
        assert a == b, (a, b)


def test_split_and_join_give_back_the_state_and_leave_only_plain_data_beside_the_tensors():
    tensors, rest = split(state(3))
    assert set(tensors) == {"model/w", "model/b", "optimizer/state/w/momentum_buffer", "optimizer/state/w/step"}
    assert rest["model"] == {"w": IN_DCP, "b": IN_DCP}
    assert rest["optimizer"]["param_groups"][0]["betas"] == (0.9, 0.99)  # tuples stay tuples
    assert torch.equal(rest["rng"]["torch"], torch.get_rng_state())  # outside model/optimizer: in rest.pt
    joined = join(rest, tensors)
    assert_same(joined, state(3))


def test_a_sharded_checkpoint_is_a_folder_that_reads_back_into_the_template(tmp_path):
    checkpoints = Checkpoints(tmp_path, keep=2)
    path, _ = checkpoints.save_sharded(state(1), 1, is_main=True)
    assert path.name == "step-000000001" and {p.name for p in path.iterdir()} == {".metadata", "__0_0.distcp", REST, "SHA256SUMS"}
    places = template()
    loaded = checkpoints.load(path, template=lambda: places, ranks=Solo())
    assert_same(loaded, state(1))
    assert loaded["model"]["w"] is places["model"]["w"]  # read in place, as into a sharded model's DTensors


def test_folders_and_files_are_listed_by_step_and_pruned_alike(tmp_path):
    checkpoints = Checkpoints(tmp_path, keep=3)
    checkpoints.save({"step": 1}, 1)
    for step in (2, 3, 4):
        checkpoints.save_sharded(state(step), step, is_main=True)
    (tmp_path / ".step-000000005.tmp").mkdir()  # a run killed while writing step 5's
    (tmp_path / "step-000000006").write_text("not a folder")  # a file without .pt: not a checkpoint
    assert [p.name for p in checkpoints.paths()] == ["step-000000004", "step-000000003", "step-000000002"]
    assert not (tmp_path / "step-000000001.pt").exists()  # the oldest went, file or folder
    checkpoints.clear_unfinished(5)
    assert not (tmp_path / ".step-000000005.tmp").exists()


def test_saving_a_step_again_replaces_its_folder(tmp_path):
    checkpoints = Checkpoints(tmp_path)
    checkpoints.save_sharded(state(1), 7, is_main=True)
    path, _ = checkpoints.save_sharded(state(2), 7, is_main=True)
    assert [p.name for p in tmp_path.iterdir()] == ["step-000000007"]  # nothing left aside
    assert checkpoints.load(path, template=template, ranks=Solo())["step"] == 2


def test_a_sharded_checkpoint_with_code_in_it_is_refused_and_the_one_before_is_loaded(tmp_path):
    class Evil:
        def __reduce__(self):
            return (print, ("pwned",))

    checkpoints = Checkpoints(tmp_path)
    checkpoints.save_sharded(state(1), 1, is_main=True)
    checkpoints.save_sharded({**state(2), "callbacks": Evil()}, 2, is_main=True)
    loaded, path = checkpoints.load_latest(template=template, ranks=Solo())
    assert path.name == "step-000000001" and loaded["step"] == 1


def test_a_checkpoint_of_another_model_is_an_error_naming_what_has_no_place(tmp_path):
    checkpoints = Checkpoints(tmp_path)
    path, _ = checkpoints.save_sharded(state(1), 1, is_main=True)
    smaller = template()
    del smaller["model"]["b"]
    with pytest.raises(ValueError, match="holds model/b, which this model and optimizer have no place for"):
        checkpoints.load(path, template=lambda: smaller, ranks=Solo())


class ReplicatedPair(Solo):
    """Rank 0 of two whose model is replicated (DDP): its checkpoints are one file."""

    world = 2

    def __init__(self):
        super().__init__()
        self.job = Replicated(torch.device("cpu"))


def test_a_replicated_job_that_finds_a_sharded_checkpoint_says_so_instead_of_starting_afresh(tmp_path):
    Checkpoints(tmp_path).save_sharded(state(1), 1, is_main=True)
    checkpointer = Checkpointer(tmp_path, keep=3, every=None, interval=None, ranks=ReplicatedPair(),
                                journal=Journal())
    with pytest.raises(ValueError, match="step-000000001 is a sharded checkpoint .* shard=True"):
        checkpointer.resume(lambda s: None, None, torch.device("cpu"), template=template)


def test_a_process_alone_reads_a_sharded_checkpoint_whole(tmp_path):
    # A sharded job that lost its other nodes goes on in one process (issue 33): DCP reads every
    # shard into the template's whole tensors.
    Checkpoints(tmp_path).save_sharded(state(1), 1, is_main=True)
    checkpointer = Checkpointer(tmp_path, keep=3, every=None, interval=None, ranks=Solo(), journal=Journal())

    class Progress:
        step = epoch = position = samples_seen = 1

    loaded = []
    checkpointer.resume(loaded.append, Progress(), torch.device("cpu"), template=template)
    assert_same(loaded[0], state(1))


def test_the_checkpointer_writes_a_sharded_models_checkpoint_as_a_folder_and_resumes_from_it(tmp_path):
    journal = Journal()
    checkpointer = Checkpointer(tmp_path, keep=3, every=None, interval=None, ranks=ShardedSolo(), journal=journal)
    (tmp_path / ".step-000000004.tmp").mkdir(parents=True)
    (tmp_path / ".step-000000004.tmp" / "__3_0.distcp").write_text("a fourth rank's, from a killed job")
    path = checkpointer.save("test", lambda: state(4), 4, 0, background=True)  # sharded: written now, here
    assert {p.name for p in path.iterdir()} == {".metadata", "__0_0.distcp", REST, "SHA256SUMS"}
    assert journal.records[-1]["kind"] == "checkpoint" and "background" not in journal.records[-1]

    class Progress:
        step = epoch = position = samples_seen = 4

    loaded = []
    checkpointer.resume(loaded.append, Progress(), torch.device("cpu"), template=template)
    assert_same(loaded[0], state(4))
    assert journal.records[-1]["kind"] == "resume" and journal.records[-1]["path"] == str(path)
