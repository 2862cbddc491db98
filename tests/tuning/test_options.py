"""autotune/tuning/options.py, step/options.py, common/options.py: the options travel as one record,
built once from the public keywords, while the public signatures and the argument docs stay as they were."""

import ast
import dataclasses
import inspect
import re
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

import autotune
from autotune import AutoTrainer, Tuner
from autotune.common.options import build, keywords
from autotune.step.options import StepOptions
from autotune.tuning.options import TunerOptions

# The public constructors' signatures at fc45e96, before the options record: name, kind, default, annotation.
# Users call them with keywords; a record inside must not change a keyword, a default or a kind (an option
# added since is a new keyword-only parameter with a default).
SIGNATURES = {
    "AutoTrainer": """
    model POSITIONAL_OR_KEYWORD - :: nn.Module
    dataset POSITIONAL_OR_KEYWORD - :: Dataset | DataLoader
    loss_fn KEYWORD_ONLY None :: LossFn | None
    step_fn KEYWORD_ONLY None :: StepFn | None
    optimizer KEYWORD_ONLY None :: torch.optim.Optimizer | OptimizerFactory | None
    scheduler KEYWORD_ONLY None :: Any
    batch_size KEYWORD_ONLY 32 :: int
    micro_batch_size KEYWORD_ONLY None :: int | str | None
    keep_effective_batch KEYWORD_ONLY True :: bool
    device KEYWORD_ONLY None :: str | torch.device | None
    policies KEYWORD_ONLY 'default' :: str | Path | Sequence[Policy] | None
    memory_cap KEYWORD_ONLY None :: float | int | str | None
    inject_oom KEYWORD_ONLY None :: float | None
    shuffle KEYWORD_ONLY True :: bool
    seed KEYWORD_ONLY 0 :: int
    num_workers KEYWORD_ONLY 0 :: int
    collate_fn KEYWORD_ONLY None :: Callable[[list], Any] | None
    split_fn KEYWORD_ONLY None :: SplitFn | None
    run_dir KEYWORD_ONLY None :: str | Path | None
    checkpoint_every KEYWORD_ONLY None :: int | None
    checkpoint_interval KEYWORD_ONLY 900.0 :: float | None
    keep_checkpoints KEYWORD_ONLY 3 :: int
    progress KEYWORD_ONLY True :: bool
    monitor KEYWORD_ONLY True :: bool
    monitor_interval KEYWORD_ONLY 0.5 :: float
    tensorboard KEYWORD_ONLY False :: bool | str | Path
    precision KEYWORD_ONLY 'fp32' :: str
    clip_grad_norm KEYWORD_ONLY None :: float | None
    clip_grad_value KEYWORD_ONLY None :: float | None
    scheduler_interval KEYWORD_ONLY 'step' :: str
    scheduler_metric KEYWORD_ONLY None :: str | None
    eval_dataset KEYWORD_ONLY None :: Dataset | DataLoader | None
    eval_every KEYWORD_ONLY None :: int | str | None
    eval_batch_size KEYWORD_ONLY None :: int | None
    metrics KEYWORD_ONLY None :: Mapping[str, Metric] | None
    callbacks KEYWORD_ONLY None :: Sequence[Any] | None
    compile KEYWORD_ONLY False :: bool | dict[str, Any]
    memory_snapshot KEYWORD_ONLY False :: bool | int
    shard KEYWORD_ONLY False :: bool
    on_nonfinite KEYWORD_ONLY 'skip' :: str
    max_nonfinite_steps KEYWORD_ONLY 50 :: int | None
    data_stall_seconds KEYWORD_ONLY None :: float | None
    stop_signals KEYWORD_ONLY None :: Sequence[int | str] | None""",
    "Tuner": """
    model POSITIONAL_OR_KEYWORD - :: nn.Module
    optimizer POSITIONAL_OR_KEYWORD None :: torch.optim.Optimizer | OptimizerFactory | None
    loss_fn KEYWORD_ONLY None :: LossFn | None
    step_fn KEYWORD_ONLY None :: StepFn | None
    scheduler KEYWORD_ONLY None :: Any
    micro_batch_size KEYWORD_ONLY None :: int | None
    batch_size KEYWORD_ONLY None :: int | None
    keep_effective_batch KEYWORD_ONLY True :: bool
    device KEYWORD_ONLY None :: str | torch.device | None
    policies KEYWORD_ONLY 'default' :: str | Path | Sequence[Policy] | None
    memory_cap KEYWORD_ONLY None :: float | int | str | None
    precision KEYWORD_ONLY 'fp32' :: str
    clip_grad_norm KEYWORD_ONLY None :: float | None
    clip_grad_value KEYWORD_ONLY None :: float | None
    scheduler_interval KEYWORD_ONLY 'step' :: str
    split_fn KEYWORD_ONLY None :: SplitFn | None
    run_dir KEYWORD_ONLY None :: str | Path | None
    monitor KEYWORD_ONLY True :: bool
    monitor_interval KEYWORD_ONLY 0.5 :: float
    tensorboard KEYWORD_ONLY False :: bool | str | Path
    inject_oom KEYWORD_ONLY None :: float | None
    seed KEYWORD_ONLY 0 :: int
    compile KEYWORD_ONLY False :: bool | dict[str, Any]
    reliefs KEYWORD_ONLY True :: bool
    progress KEYWORD_ONLY False :: bool
    memory_snapshot KEYWORD_ONLY False :: bool | int
    shard KEYWORD_ONLY False :: bool
    on_nonfinite KEYWORD_ONLY 'skip' :: str
    max_nonfinite_steps KEYWORD_ONLY 50 :: int | None
    _wiring KEYWORD_ONLY <private> :: Wiring""",
    "AutoTuneTrainer": """
    args VAR_POSITIONAL - :: Any
    tuner_options KEYWORD_ONLY None :: dict[str, Any] | None
    kwargs VAR_KEYWORD - :: Any""",
    "AutoTuneStrategy": """
    device POSITIONAL_OR_KEYWORD None :: str | torch.device | None
    tuner_options KEYWORD_ONLY None :: dict[str, Any] | None
    kwargs VAR_KEYWORD - :: Any""",
    "AutoTuneDDPStrategy": """
    tuner_options KEYWORD_ONLY None :: dict[str, Any] | None
    kwargs VAR_KEYWORD - :: Any""",
}
# What the Tuner trains, passed as it is beside the record; and the host's private wiring.
NOT_OPTIONS = {"model", "optimizer", "loss_fn", "step_fn", "scheduler", "_wiring"}
# AutoTrainer's own defaults, documented as its own (its `trainer=` docs): a bar by default, a batch of 32.
TRAINERS_DEFAULTS = {"batch_size": 32, "progress": True}


INTEGRATIONS = {"AutoTuneTrainer": "transformers", "AutoTuneStrategy": "lightning", "AutoTuneDDPStrategy": "lightning"}


def _described(cls) -> str:
    lines = []
    for p in inspect.signature(cls).parameters.values():
        default = "-" if p.default is p.empty else "<private>" if p.name.startswith("_") else repr(p.default)
        lines.append(f"    {p.name} {p.kind.name} {default} :: {p.annotation}")
    return "\n" + "\n".join(lines)


def _described_in_source(name: str) -> str:
    # An integration's __init__ read from its source, as inspect.signature shows it (importing
    # transformers or lightning takes seconds; the signature is all this test reads).
    tree = ast.parse((Path(autotune.__file__).parent / "integrations" / f"{INTEGRATIONS[name]}.py").read_text())
    cls = next(node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == name)
    init = next(node for node in cls.body if isinstance(node, ast.FunctionDef) and node.name == "__init__").args
    positional = init.posonlyargs + init.args
    defaults = [None] * (len(positional) - len(init.defaults)) + init.defaults
    params = [(a, "POSITIONAL_OR_KEYWORD", d) for a, d in zip(positional, defaults)][1:]  # without self
    params += [(init.vararg, "VAR_POSITIONAL", None)] if init.vararg else []
    params += [(a, "KEYWORD_ONLY", d) for a, d in zip(init.kwonlyargs, init.kw_defaults)]
    params += [(init.kwarg, "VAR_KEYWORD", None)] if init.kwarg else []
    return "\n" + "\n".join(f"    {a.arg} {kind} {'-' if d is None else ast.unparse(d)} :: {ast.unparse(a.annotation)}"
                             for a, kind, d in params)


@pytest.mark.parametrize("name", SIGNATURES)
def test_the_public_signatures_are_those_before_the_record(name):
    described = _described_in_source(name) if name in INTEGRATIONS else _described({"AutoTrainer": AutoTrainer,
                                                                                     "Tuner": Tuner}[name])
    before, now = SIGNATURES[name].strip().splitlines(), described.strip().splitlines()
    # Every parameter as it was, in its order; one added later is a keyword-only one with a default (an option).
    assert [line for line in now if line in before] == before
    assert all(" KEYWORD_ONLY " in line and " KEYWORD_ONLY - " not in line for line in now if line not in before)


def test_every_keyword_of_the_tuner_is_an_option_with_the_tuners_default():
    options = {option.name: option.default for option in keywords(TunerOptions)}
    params = inspect.signature(Tuner).parameters
    assert set(options) == set(params) - NOT_OPTIONS, "a Tuner keyword without a field, or a field without a keyword"
    assert {name: params[name].default for name in options} == options


def test_autotrainer_takes_the_options_with_the_tuners_defaults_but_its_own():
    options = {option.name: option.default for option in keywords(TunerOptions)}
    params = inspect.signature(AutoTrainer).parameters
    taken = {name: params[name].default for name in options if name in params}
    assert taken == {name: TRAINERS_DEFAULTS.get(name, default) for name, default in options.items() if name in taken}


def _args(cls) -> dict[str, str]:
    # The Args section of a class's docstring: each name, once, with its text on one line.
    found: dict[str, str] = {}
    name = None
    for line in cls.__doc__.split("\n    Args:\n", 1)[1].splitlines():
        if m := re.match(r"^        (\w+): (.*)$", line):
            name = m.group(1)
            assert name not in found, f"{cls.__name__}: {name} documented twice"
            found[name] = m.group(2)
        elif line.strip():
            found[name] += " " + line.strip()
    return found


@pytest.mark.parametrize("cls", [AutoTrainer, Tuner], ids=lambda c: c.__name__)
def test_every_argument_is_documented_once_and_each_option_by_its_field(cls):
    args = _args(cls)
    assert set(args) == set(inspect.signature(cls).parameters) - {"_wiring"}
    for option in keywords(TunerOptions):
        if option.name in args:
            wanted = option.trainer if cls is AutoTrainer and option.trainer else option.doc
            assert args[option.name] == wanted, option.name


def test_a_field_missing_from_the_constructor_is_an_error_naming_it():
    given = {option.name: option.default for option in keywords(TunerOptions)}
    assert build(TunerOptions, given) == TunerOptions()
    del given["clip_grad_value"]
    with pytest.raises(TypeError, match=r"StepOptions\.clip_grad_value is not a keyword .* add `clip_grad_value`"):
        build(TunerOptions, given)


def _data():
    return TensorDataset(torch.randn(8, 4), torch.randint(0, 2, (8,)))


def test_autotrainer_forwards_every_option_it_takes_to_the_record(tmp_path):
    def split(batch, size):  # any splitter: only its identity is checked
        return [tuple(t[i:i + size] for t in batch) for i in range(0, len(batch[0]), size)]

    chosen = dict(batch_size=4, micro_batch_size=2, device="cpu", policies="conservative", memory_cap=2**30,
                  run_dir=tmp_path / "run", monitor=False, monitor_interval=2.0, progress=False, shard=True,
                  tensorboard=tmp_path / "tb", keep_effective_batch=False, split_fn=split, scheduler_interval="epoch",
                  precision="bf16", clip_grad_norm=1.0, clip_grad_value=2.0, inject_oom=0.25, seed=7, on_nonfinite="stop", max_nonfinite_steps=3)
    with AutoTrainer(nn.Linear(4, 2), _data(), loss_fn=nn.functional.cross_entropy, **chosen) as trainer:
        options = trainer.tuner.options
        got = {**dataclasses.asdict(options), **dataclasses.asdict(options.step)}
        assert got == {**got, **chosen, "device": torch.device("cpu")}
        # What the rooms below were built with: the one record, not a copy of each keyword.
        assert trainer.core.options is options.step and trainer.tuner.stepper.options is options.step
        assert (trainer.core.keep_effective_batch, trainer.core.inject_oom, trainer.core.precision,
                trainer.tuner.stepper.max_nonfinite_steps, trainer.tuner.stepper.clip_grad_value) == (False, 0.25, "bf16", 3, 2.0)
    # Every option AutoTrainer took at fc45e96 was chosen above but two, the next test's.
    took = {line.split()[0] for line in SIGNATURES["AutoTrainer"].strip().splitlines()}
    assert took & {option.name for option in keywords(TunerOptions)} - set(chosen) == {"compile", "memory_snapshot"}


@pytest.mark.parametrize("keyword, value, error", [
    ("compile", "yes", "compile='yes': pass True/False"),  # a torch.compile'd model takes seconds to set up
    ("memory_snapshot", 3, "memory_snapshot=True needs a CUDA device"),  # CUDA only
])
def test_autotrainer_forwards_what_the_tuner_checks(tmp_path, keyword, value, error):
    with pytest.raises((TypeError, ValueError), match=error):
        AutoTrainer(nn.Linear(4, 2), _data(), loss_fn=nn.functional.cross_entropy, device="cpu", monitor=False,
                    run_dir=tmp_path, **{keyword: value})


def test_the_tuner_reads_the_injection_rate_from_the_environment_once(tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOTUNE_INJECT_OOM", "0.125")
    with Tuner(nn.Linear(4, 2), device="cpu", monitor=False, run_dir=tmp_path / "a") as tuner:
        assert tuner.options.step.inject_oom == tuner.core.inject_oom == 0.125


@pytest.mark.parametrize("given, environment", [(2, None), (None, "x")], ids=["keyword", "environment"])
def test_a_bad_injection_rate_is_refused_before_the_run_folder_is_written(tmp_path, monkeypatch, given, environment):
    # It was read when the step core was built, after the run lock and the journal: the folder stayed behind.
    if environment is not None:
        monkeypatch.setenv("AUTOTUNE_INJECT_OOM", environment)
    with pytest.raises(ValueError, match="is not a probability in \\[0, 1\\)"):
        Tuner(nn.Linear(4, 2), device="cpu", monitor=False, run_dir=tmp_path / "run", inject_oom=given)
    assert not (tmp_path / "run").exists()


def test_the_rooms_take_the_step_options_with_the_tuners_defaults():
    from autotune.common.progress import Progress
    from autotune.ranks.distributed import Solo
    from autotune.step.core import StepCore
    from autotune.step.optimizer_step import OptimizerStep

    model = nn.Linear(2, 2)
    stepper = OptimizerStep(model, None, None, device=torch.device("cpu"), ranks=Solo(), counters=Progress())
    core = StepCore(model, stepper, loss_fn=None, step_fn=lambda m, b: m(b).sum(), device=torch.device("cpu"),
                    ranks=Solo())
    assert core.options == stepper.options == StepOptions()
    assert (stepper.max_nonfinite_steps, stepper.on_nonfinite, core.precision, core.inject_oom) == (50, "skip", "fp32", 0.0)
