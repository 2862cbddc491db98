"""Argument and parameter checks shared by the trainer and the policies: one wording for every bad value.

A bool is never taken for a number (`True` is an int in Python, and `max_steps=True` is a slip).

Owns: the argument checks' wording. Touches nothing.
"""

from __future__ import annotations

from typing import Any


def _where(owner: str, name: str) -> str:
    return f"{owner}: {name}" if owner else name


def is_number(value: Any) -> bool:
    """An int or a float, not a bool."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_int(owner: str, name: str, value: Any, minimum: int | None, *, optional: bool = False) -> None:
    """Raise ValueError unless `value` is an int (not a bool) >= `minimum` (any int for None; None
    itself with `optional`)."""
    if optional and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or (minimum is not None and value < minimum):
        bound = "" if minimum is None else f" >= {minimum}"
        raise ValueError(f"{_where(owner, name)} must be an integer{bound}{' or None' if optional else ''}, "
                         f"got {value!r}")


def check_positive(owner: str, name: str, value: Any, *, optional: bool = False) -> None:
    """Raise ValueError unless `value` is a number (not a bool) > 0 (or None, with `optional`)."""
    if optional and value is None:
        return
    if not is_number(value) or value <= 0:
        raise ValueError(f"{_where(owner, name)} must be a positive number{' or None' if optional else ''}, "
                         f"got {value!r}")


def check_range(owner: str, name: str, value: Any, low: float, high: float, unit: str = "") -> None:
    """Raise ValueError unless `value` is a number (not a bool) in [low, high]."""
    if not is_number(value) or not low <= value <= high:
        raise ValueError(f"{_where(owner, name)} must be between {low} and {high}{unit}, got {value!r}")


def check_fraction(owner: str, name: str, value: Any, *, zero_ok: bool = False) -> None:
    """Raise ValueError unless `value` is a number in (0, 1] (or [0, 1] with `zero_ok`)."""
    if not is_number(value) or not ((value >= 0 if zero_ok else value > 0) and value <= 1):
        raise ValueError(f"{_where(owner, name)} must be in {'[0' if zero_ok else '(0'}, 1], got {value!r}")
