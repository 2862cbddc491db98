import inspect

import pytest

from autotune.policies import BUILTIN_POLICIES, HalveOnOOM
from autotune.tuning.presets import PRESET_DIR, PresetError, load_preset, policy_parameters, resolve_policies


def write(tmp_path, text):
    path = tmp_path / "preset.toml"
    path.write_text(text)
    return path


def test_shipped_presets_load():
    names = {name: [p.name for p in resolve_policies(name)] for name in ("default", "conservative", "throughput")}
    assert names["default"] == ["halve_on_oom", "empty_cache_on_pressure", "shrink_on_thrash",
                                "fit_micro_batch", "cache_when_io_bound", "tune_workers",
                                "autocast_near_cap", "checkpoint_near_cap", "prune_near_cap"]  # the ladder, in order
    assert not {"autocast_near_cap", "checkpoint_near_cap", "prune_near_cap"} & set(names["conservative"])
    assert "shrink_on_thrash" not in names["conservative"] and names["conservative"][0] == "halve_on_oom"
    assert {"fit_micro_batch", "cache_when_io_bound", "tune_workers"} <= set(names["throughput"])


def test_default_toml_names_every_parameter_of_its_policies():
    # so that "the defaults in code and in default.toml agree" covers every parameter
    from autotune.tuning.presets import PRESET_DIR, tomllib

    for spec in tomllib.loads((PRESET_DIR / "default.toml").read_text())["policy"]:
        from autotune.tuning.presets import resolve_policy

        assert set(spec) - {"use"} == set(policy_parameters(resolve_policy(spec["use"]))), spec["use"]


def test_the_repository_policies_folder_is_the_shipped_presets():
    from pathlib import Path

    repo_presets = Path(__file__).parents[2] / "policies"
    assert sorted(p.name for p in repo_presets.glob("*.toml")) == sorted(p.name for p in PRESET_DIR.glob("*.toml"))


def test_defaults_in_code_and_default_toml_agree():
    for policy in resolve_policies("default"):
        code_defaults = {k: v for k, v in policy_parameters(type(policy)).items() if v is not inspect.Parameter.empty}
        for key, value in code_defaults.items():
            assert getattr(policy, key) == value, f"{policy.name}.{key}: default.toml says {getattr(policy, key)!r}, code says {value!r}"


def test_a_preset_by_path(tmp_path):
    path = write(tmp_path, '[[policy]]\nuse = "halve_on_oom"\nmin_micro_batch = 4\n')
    (policy,) = resolve_policies(str(path))
    assert isinstance(policy, HalveOnOOM) and policy.min_micro_batch == 4


def test_a_policy_by_module_path(tmp_path):
    path = write(tmp_path, '[[policy]]\nuse = "autotune.policies.halve_on_oom:HalveOnOOM"\n')
    assert isinstance(resolve_policies(path)[0], HalveOnOOM)


def test_policy_objects_pass_through():
    policy = HalveOnOOM(min_micro_batch=2)
    assert resolve_policies([policy]) == [policy]
    with pytest.raises(TypeError, match="Policy interface"):
        resolve_policies([object()])


@pytest.mark.parametrize("text, match", [
    ('[[policy]]\nuse = "halve_on_oomm"\n', r"unknown policy 'halve_on_oomm'; choices: .*halve_on_oom"),
    ('[[policy]]\nuse = "halve_on_oom"\nmin_microbatch = 2\n', r"policy #1 \(halve_on_oom\): unknown key 'min_microbatch'; choices: min_micro_batch"),
    ('[[policy]]\nuse = "halve_on_oom"\nmin_micro_batch = "two"\n', r"min_micro_batch = 'two' must be int"),
    ('[[policy]]\nuse = "halve_on_oom"\nmin_micro_batch = 0\n', r"min_micro_batch must be an integer >= 1"),
    ('[[policy]]\nmin_micro_batch = 2\n', r"missing 'use"),
    ('[[polcy]]\nuse = "halve_on_oom"\n', r"unknown top-level key\(s\) polcy"),
    ('[[policy]\nuse = ', r"not valid TOML"),
    ('[[policy]]\nuse = "no.such.module:Thing"\n', r"cannot load policy 'no.such.module:Thing'"),
])
def test_bad_presets_name_the_problem(tmp_path, text, match):
    path = write(tmp_path, text)
    with pytest.raises(PresetError, match=match) as info:
        load_preset(path)
    assert str(path) in str(info.value)


def test_unknown_preset_names_the_choices():
    with pytest.raises(PresetError, match="unknown preset 'fast'; choices: conservative, default, throughput"):
        resolve_policies("fast")


def test_missing_preset_file_is_an_error(tmp_path):
    with pytest.raises(PresetError, match="does not exist"):
        resolve_policies(str(tmp_path / "nope.toml"))


def test_every_builtin_is_listed_by_its_name():
    for name, cls in BUILTIN_POLICIES.items():
        assert cls.name == name


def test_errors_name_the_line_of_the_bad_key_and_value(tmp_path):
    path = write(tmp_path, '[[policy]]\nuse = "halve_on_oom"\n\n[[policy]]\nuse = "grow_back"\n'
                           'calm_steps = 5\nmargin = 1.5\n')
    with pytest.raises(PresetError, match=r"preset.toml:7: policy #2 \(grow_back\): .*margin must be in \[0, 1\), got 1.5"):
        load_preset(path)
    path = write(tmp_path, '[[policy]]\nuse = "no_such_policy"\n')
    with pytest.raises(PresetError, match=r"preset.toml:2: policy #1: unknown policy 'no_such_policy'"):
        load_preset(path)
