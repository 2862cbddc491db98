"""Parameter checks shared by policies: one wording for every bad value."""

from __future__ import annotations

from typing import Any


def check_int(owner: str, name: str, value: Any, minimum: int) -> None:
    """Raise ValueError unless `value` is an int (not a bool) >= `minimum`."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{owner}: {name} must be an integer >= {minimum}, got {value!r}")


def check_fraction(owner: str, name: str, value: Any, *, zero_ok: bool = False) -> None:
    """Raise ValueError unless `value` is a number in (0, 1] (or [0, 1] with `zero_ok`)."""
    low_ok = (lambda v: v >= 0) if zero_ok else (lambda v: v > 0)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (low_ok(value) and value <= 1):
        raise ValueError(f"{owner}: {name} must be in {'[0' if zero_ok else '(0'}, 1], got {value!r}")
