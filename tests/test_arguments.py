"""Bad arguments to AutoTrainer and Tuner, as a user passes them: each refused with an error that names the
argument and what it takes, before the run folder is taken; a constructor that fails after taking it lets go
of it and leaves the folder as it found it."""

import fcntl
import math
import os

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from autotune import AutoTrainer, Tuner


def _data():
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(32, 4, generator=g), torch.randint(0, 2, (32,), generator=g))


def _trainer(run_dir, **kwargs):
    kwargs = {"loss_fn": nn.functional.cross_entropy, "batch_size": 16, "device": "cpu", "monitor": False,
              "progress": False, **kwargs}
    return AutoTrainer(nn.Linear(4, 2), _data(), run_dir=run_dir, **kwargs)


def _free(run_dir):
    """Whether no open file holds the run folder's lock: an flock from a descriptor of our own is refused
    while any other holds it, in this process too (a lock belongs to the open file, not the process)."""
    fd = os.open(run_dir, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    finally:
        os.close(fd)


def _step_factory_then_plateau_metric(opt):
    return torch.optim.lr_scheduler.StepLR(opt, 1)


@pytest.mark.parametrize("kwargs", [
    {"memory_cap": "12 parsecs"}, {"policies": "no-such-preset"}, {"policies": 5}, {"compile": {"nope": 1}},
    {"eval_every": 0}, {"eval_batch_size": 0}, {"metrics": 5}, {"scheduler_metric": "loss"}, {"tensorboard": 5},
    {"clip_grad_norm": math.nan}, {"monitor": "no"},
    # Refused after the Tuner took the folder: a factory's scheduler is known once built.
    {"scheduler": _step_factory_then_plateau_metric, "scheduler_metric": "train_loss"},
])
def test_a_refused_trainer_lets_go_of_the_run_folder_and_leaves_it_as_found(tmp_path, kwargs):
    fresh, used = tmp_path / "fresh", tmp_path / "used"
    used.mkdir()
    (used / "notes.txt").write_text("a previous run's")
    for run_dir, before in ((fresh, None), (used, {"notes.txt"})):
        with pytest.raises((ValueError, TypeError)):
            _trainer(run_dir, **kwargs)
        assert _free(run_dir) if run_dir.exists() else True
        assert (set(os.listdir(run_dir)) if run_dir.exists() else None) == before  # no .lock, no empty journal
    t = _trainer(fresh)  # the same process builds one there at once, and trains
    assert t.fit(max_steps=1).steps == 1
    t.close()


def test_a_tuner_that_fails_after_taking_the_folder_lets_go_of_it(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "events.jsonl").write_text("")  # a previous run's (empty) journal: never removed

    def broken(optimizer):
        raise RuntimeError("the scheduler factory failed")

    with pytest.raises(RuntimeError, match="scheduler factory failed"):
        Tuner(nn.Linear(4, 2), loss_fn=nn.functional.cross_entropy, scheduler=broken, device="cpu",
              run_dir=run_dir, monitor=False)
    assert _free(run_dir) and set(os.listdir(run_dir)) == {"events.jsonl"}


def test_a_runs_record_and_its_lock_file_stay_at_close(tmp_path):
    t = _trainer(tmp_path / "run")
    t.fit(max_steps=1)
    t.close()
    assert {".lock", "events.jsonl", "steps.jsonl"} <= set(os.listdir(tmp_path / "run"))  # a run's record stays


@pytest.mark.parametrize("name", ["clip_grad_norm", "clip_grad_value", "checkpoint_interval", "data_stall_seconds"])
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_nan_and_inf_are_refused_naming_the_argument(tmp_path, name, value):
    with pytest.raises(ValueError, match=f"{name} must be a finite positive number or None, got {value!r}"):
        _trainer(tmp_path / "run", **{name: value})


@pytest.mark.parametrize("kwargs, match", [
    ({"policies": 5}, "policies=5: pass a preset name, a path to a TOML preset, a list of policy objects, or None"),
    ({"callbacks": 5}, "callbacks=5: pass a list of callback objects"),
    ({"seed": 2 ** 70}, f"seed must be an integer between {-2 ** 63} and {2 ** 63 - 1}, got {2 ** 70}"),
    ({"compile": {"nope": 1}}, "compile=.*torch.compile takes no 'nope'; its keywords are .*backend"),
])
def test_a_wrong_kind_of_value_names_the_argument_and_what_it_takes(tmp_path, kwargs, match):
    with pytest.raises((TypeError, ValueError), match=match):
        _trainer(tmp_path / "run", **kwargs)


def test_resume_of_the_wrong_type_names_what_it_takes(tmp_path):
    t = _trainer(tmp_path / "run")
    with pytest.raises(TypeError, match=r"resume=1: pass True .*, False .* or the path of a checkpoint"):
        t.fit(resume=1)
    t.close()


@pytest.mark.parametrize("name", ["monitor", "progress", "keep_effective_batch", "shard", "shuffle"])
@pytest.mark.parametrize("value", ["no", "yes", None, 1])
def test_an_on_off_option_takes_a_bool_only(tmp_path, name, value):
    with pytest.raises(TypeError, match=f"{name} must be True or False, got {value!r}"):
        _trainer(tmp_path / "run", **{name: value})


@pytest.mark.parametrize("value", ["no", None, 0])
def test_the_tuners_reliefs_take_a_bool_only(tmp_path, value):
    with pytest.raises(TypeError, match=f"reliefs must be True or False, got {value!r}"):
        Tuner(nn.Linear(4, 2), loss_fn=nn.functional.cross_entropy, device="cpu", run_dir=tmp_path / "run",
              monitor=False, reliefs=value)
    assert not (tmp_path / "run").exists()


def test_the_documented_forms_that_are_not_bools_are_kept(tmp_path):
    # A numpy bool is a bool; memory_snapshot takes a count (CUDA only). tensorboard's folder and compile's dict:
    # their own tests (observe/, step/).
    t = _trainer(tmp_path / "run", monitor=np.bool_(False), shuffle=np.bool_(True), tensorboard=np.bool_(False))
    assert t.fit(max_steps=1).steps == 1
    t.close()
    with pytest.raises(ValueError, match="memory_snapshot=True needs a CUDA device"):
        _trainer(tmp_path / "run", memory_snapshot=5)


@pytest.mark.parametrize("value", ["x", None, 0, -1, 1e9])
def test_monitor_interval_is_checked_with_the_monitor_off_too(tmp_path, value):
    # It failed at step 2 with a TypeError from deep inside (a string), or was taken silently (0, 1e9).
    with pytest.raises(ValueError, match=f"monitor_interval must be between 0.05 and 10.0 s, got {value!r}"):
        _trainer(tmp_path / "run", monitor_interval=value)
    with pytest.raises(ValueError, match="monitor_interval must be between"):
        Tuner(nn.Linear(4, 2), loss_fn=nn.functional.cross_entropy, device="cpu", run_dir=tmp_path / "tuner",
              monitor=False, monitor_interval=value)


@pytest.mark.parametrize("name", ["clip_grad_norm", "clip_grad_value", "checkpoint_interval", "data_stall_seconds"])
def test_an_integer_no_float_holds_is_refused_naming_the_argument(tmp_path, name):
    # math.isfinite(10**400) raised a bare OverflowError; torch would have failed converting it mid-run.
    with pytest.raises(ValueError, match=f"{name} must be a finite positive number or None"):
        _trainer(tmp_path / "run", **{name: 10 ** 400})


@pytest.mark.parametrize("kwargs, match", [
    ({"loss_fn": 5}, "loss_fn must be a function loss_fn\\(outputs, targets\\) or None, got 5"),
    ({"collate_fn": 5}, "collate_fn must be a function collate_fn\\(samples\\) -> batch or None, got 5"),
    ({"split_fn": 5}, "split_fn must be a function split_fn\\(batch, size\\) -> micro-batches or None, got 5"),
    ({"eval_dataset": 5}, "eval_dataset must be a dataset .*, got 5"),
])
def test_what_is_called_or_iterated_later_is_checked_now(tmp_path, kwargs, match):
    # Each was taken, then failed mid-fit ("'int' object is not callable", "object of type 'int' has no len()")
    # after a checkpoint; refused now before the run folder is taken.
    with pytest.raises(TypeError, match=match):
        _trainer(tmp_path / "run", **kwargs)
    assert not (tmp_path / "run").exists()
