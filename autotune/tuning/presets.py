"""Presets: TOML files that name the policies of a run and their parameters.

::

    # policies/default.toml
    [[policy]]
    use = "halve_on_oom"      # built-in name, entry-point name, or "package.module:Class"
    min_micro_batch = 1

A preset is picked by name (a file shipped in `autotune/presets/`, also visible as the
repository's `policies/` folder) or by path. Unknown presets, policies and keys are
errors that name the culprit and the choices.

Owns: reading presets and building their policies. Touches nothing.
"""

from __future__ import annotations

import importlib
import inspect
import sys
from importlib import metadata
from pathlib import Path
from typing import Any, Sequence

from autotune.decisions.policy import Policy
from autotune.policies import BUILTIN_POLICIES

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on Python 3.10 only
    import tomli as tomllib

PRESET_DIR = Path(__file__).parents[1] / "presets"  # autotune/presets/: package data beside the code
ENTRY_POINT_GROUP = "autotune.policies"


class PresetError(ValueError):
    """A preset or one of its policies is not valid; the message names the file, line, policy and key."""

    def __init__(self, message: str, key: str | None = None):
        super().__init__(message)
        self.key = key


def _line_of(text: str, policy_index: int, key: str | None) -> int | None:
    """The line (1-based) of `key` in the `policy_index`-th [[policy]] table, or of the table itself."""
    tables = [i for i, line in enumerate(text.splitlines()) if line.strip().startswith("[[policy]]")]
    if policy_index >= len(tables):
        return None
    lines = text.splitlines()
    end = tables[policy_index + 1] if policy_index + 1 < len(tables) else len(lines)
    for i in range(tables[policy_index] + 1, end):
        name = lines[i].split("=", 1)[0].strip()
        if key is not None and "=" in lines[i] and name == key:
            return i + 1
    return tables[policy_index] + 1


def preset_names() -> list[str]:
    """Names of the presets shipped with autotune."""
    return sorted(p.stem for p in PRESET_DIR.glob("*.toml"))


def installed_policies() -> dict[str, type]:
    """Built-in policies plus those installed through the `autotune.policies` entry-point group."""
    found = dict(BUILTIN_POLICIES)
    for entry in metadata.entry_points(group=ENTRY_POINT_GROUP):
        found.setdefault(entry.name, entry)  # loaded lazily: a broken plug-in only hurts when used
    return found


def resolve_policy(use: str) -> type:
    """The policy class for `use`: a built-in name, an entry-point name, or `module:Class`."""
    if ":" in use:
        module_name, _, attr = use.partition(":")
        try:
            return getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as exc:
            raise PresetError(f"cannot load policy {use!r}: {exc}") from exc
    if use in BUILTIN_POLICIES:  # built-ins win over plug-ins of the same name: no need to scan the
        return BUILTIN_POLICIES[use]  # installed packages' entry points (~7 ms a scan, 9 in the default preset)
    known = installed_policies()
    if use not in known:
        raise PresetError(f"unknown policy {use!r}; choices: {', '.join(sorted(known))} (or 'package.module:Class')")
    found = known[use]
    return found.load() if isinstance(found, metadata.EntryPoint) else found


def policy_parameters(cls: type) -> dict[str, Any]:
    """The parameters a preset may set on `cls`, with their defaults (`inspect.Parameter.empty` if required)."""
    return {
        name: param.default
        for name, param in inspect.signature(cls).parameters.items()
        if param.kind in (param.POSITIONAL_OR_KEYWORD, param.KEYWORD_ONLY)
    }


def _check_type(where: str, key: str, value: Any, default: Any) -> None:
    # TOML gives ints, floats, strings, bools, lists, tables; catch the common slips
    # (a string where a number belongs) here, and leave value ranges to the policy.
    if default is inspect.Parameter.empty or default is None:
        return
    expected: tuple[type, ...]
    if isinstance(default, bool):
        expected = (bool,)
    elif isinstance(default, int):
        expected = (int,)
    elif isinstance(default, float):
        expected = (int, float)
    else:
        expected = (type(default),)
    if not isinstance(value, expected) or (isinstance(value, bool) and bool not in expected):
        raise PresetError(f"{where}: {key} = {value!r} must be {' or '.join(t.__name__ for t in expected)}", key=key)


def build_policy(spec: dict[str, Any], where: str = "policy") -> Policy:
    """Build one policy from a `[[policy]]` table: `use` plus its parameters."""
    spec = dict(spec)
    use = spec.pop("use", None)
    if not isinstance(use, str):
        raise PresetError(f"{where}: missing 'use = \"policy_name\"'", key=None)
    try:
        cls = resolve_policy(use)
    except PresetError as exc:
        raise PresetError(f"{where}: {exc}", key="use") from exc
    where = f"{where} ({use})"
    params = policy_parameters(cls)
    for key, value in spec.items():
        if key not in params:
            raise PresetError(f"{where}: unknown key {key!r}; choices: {', '.join(params) or '(none)'}", key=key)
        _check_type(where, key, value, params[key])
    try:
        policy = cls(**spec)
    except (TypeError, ValueError) as exc:
        # a policy names the bad parameter first in its message ("grow_back: margin must ...")
        named = next((k for k in spec if f" {k} " in f" {exc} "), None)
        raise PresetError(f"{where}: {exc}", key=named) from exc
    if not isinstance(policy, Policy):
        raise PresetError(f"{where}: {cls.__name__} lacks the Policy interface (name, events, decide, state_dict, load_state_dict)")
    return policy


def load_preset(path: Path) -> list[Policy]:
    """Read a preset file into policies. Errors name the file, the policy and the key."""
    try:
        data = tomllib.loads(path.read_text())
    except OSError as exc:
        raise PresetError(f"cannot read preset {path}: {exc}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise PresetError(f"{path}: not valid TOML: {exc}") from exc
    unknown = set(data) - {"policy"}
    if unknown:
        raise PresetError(f"{path}: unknown top-level key(s) {', '.join(sorted(unknown))}; expected [[policy]] tables")
    specs = data.get("policy", [])
    if not isinstance(specs, list):
        raise PresetError(f"{path}: 'policy' must be an array of tables ([[policy]])")
    policies = []
    text = path.read_text()
    for i, spec in enumerate(specs):
        try:
            policies.append(build_policy(spec, where=f"policy #{i + 1}"))
        except PresetError as exc:
            line = _line_of(text, i, exc.key)
            raise PresetError(f"{path}:{line}: {exc}" if line else f"{path}: {exc}", key=exc.key) from exc
    return policies


def resolve_policies(policies: str | Path | Sequence[Policy] | None) -> list[Policy]:
    """Turn the `policies=` argument of AutoTrainer into policy objects.

    A preset name ("default"), a path to a TOML file, or a list of policy objects; None or an
    empty list: no policies (an OOM at the first size is then an `OutOfMemory` error).
    """
    if policies is None:
        return []
    if isinstance(policies, (str, Path)):
        path = Path(policies)
        if path.suffix == ".toml" or path.exists():
            if not path.is_file():
                raise PresetError(f"preset file {path} does not exist")
            return load_preset(path)
        shipped = PRESET_DIR / f"{policies}.toml"
        if not shipped.is_file():
            raise PresetError(f"unknown preset {str(policies)!r}; choices: {', '.join(preset_names())} or a path to a .toml file")
        return load_preset(shipped)
    policies = list(policies)
    for policy in policies:
        if not isinstance(policy, Policy):
            raise TypeError(f"policies: {policy!r} lacks the Policy interface (name, events, decide, state_dict, load_state_dict)")
    return policies


def policy_table() -> str:
    """The documented table of the built-in policies (docs/policies.md), made from their method
    cards: each file's docstring, whose first paragraph says what the policy does."""
    in_presets: dict[str, list[str]] = {}
    for preset in preset_names():
        for policy in load_preset(PRESET_DIR / f"{preset}.toml"):
            in_presets.setdefault(policy.name, []).append(preset)
    rows = ["| policy | listens to | in presets | does |", "| --- | --- | --- | --- |"]
    for name, cls in BUILTIN_POLICIES.items():
        card = sys.modules[cls.__module__].__doc__ or ""
        summary = " ".join(card.split("\n\n")[0].split()).removeprefix(f"{name}: ")
        events = ", ".join(f"`{event.name}`" for event in sorted(cls.events, key=lambda e: e.name))
        presets = ", ".join(in_presets.get(name, [])) or "none"
        rows.append(f"| `{name}` | {events} | {presets} | {summary} |")
    return "\n".join(rows)


if __name__ == "__main__":
    print(policy_table())
