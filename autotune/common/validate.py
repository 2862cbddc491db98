"""Argument and parameter checks shared by the trainer and the policies: one wording for every bad value.

A bool is never taken for a number (`True` is an int in Python, and `max_steps=True` is a slip), and
NaN never passes a bound: every check is written so that a comparison with NaN, which is always
False, fails it. An on/off option takes a bool only (`monitor="no"` is truthy: it would turn it on).

Owns: the argument checks' wording. Touches nothing.
"""

from __future__ import annotations

import math
from typing import Any


def _where(owner: str, name: str) -> str:
    return f"{owner}: {name}" if owner else name


def is_number(value: Any) -> bool:
    """An int or a float, not a bool."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_int(owner: str, name: str, value: Any, minimum: int | None, *, optional: bool = False,
              maximum: int | None = None) -> None:
    """Raise ValueError unless `value` is an int (not a bool) >= `minimum` (any int for None) and <=
    `maximum` (where given; None itself with `optional`)."""
    if optional and value is None:
        return
    if (isinstance(value, bool) or not isinstance(value, int) or (minimum is not None and value < minimum)
            or (maximum is not None and value > maximum)):
        bound = (f" between {minimum} and {maximum}" if minimum is not None and maximum is not None
                 else f" >= {minimum}" if minimum is not None else f" <= {maximum}" if maximum is not None else "")
        raise ValueError(f"{_where(owner, name)} must be an integer{bound}{' or None' if optional else ''}, "
                         f"got {value!r}")


def check_positive(owner: str, name: str, value: Any, *, optional: bool = False) -> None:
    """Raise ValueError unless `value` is a finite number (not a bool) > 0 (or None, with `optional`:
    where None means "never" or "none", inf would only be a second spelling of it)."""
    if optional and value is None:
        return
    if not is_number(value) or not (value > 0 and _fits_a_float(value)):  # NaN: not > 0
        raise ValueError(f"{_where(owner, name)} must be a finite positive number{' or None' if optional else ''}, "
                         f"got {value!r}")


def _fits_a_float(value: float) -> bool:
    """Finite as the float torch and the clock will make of it (10**400 is an int no float holds)."""
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


def is_bool(value: Any) -> bool:
    """A Python bool or a numpy one (`numpy.bool_`, named `bool` in numpy 2), asked without importing numpy."""
    kind = type(value)
    return isinstance(value, bool) or (kind.__module__ == "numpy" and kind.__name__ in ("bool_", "bool"))


def check_bool(owner: str, name: str, value: Any, *, also: str = "") -> None:
    """Raise TypeError unless `value` is True or False (`is_bool`): a string such as "no" is truthy, and
    would turn the option on. `also` names the other forms the caller accepts, for the message."""
    if not is_bool(value):
        raise TypeError(f"{_where(owner, name)} must be True or False{also}, got {value!r}")


def check_callable(owner: str, name: str, value: Any, what: str) -> None:
    """Raise TypeError unless `value` is None or callable; `what` says what it is called with."""
    if value is not None and not callable(value):
        raise TypeError(f"{_where(owner, name)} must be a function {what} or None, got {value!r}")


def check_range(owner: str, name: str, value: Any, low: float, high: float, unit: str = "") -> None:
    """Raise ValueError unless `value` is a number (not a bool) in [low, high]."""
    if not is_number(value) or not low <= value <= high:
        raise ValueError(f"{_where(owner, name)} must be between {low} and {high}{unit}, got {value!r}")


def check_fraction(owner: str, name: str, value: Any, *, zero_ok: bool = False) -> None:
    """Raise ValueError unless `value` is a number in (0, 1] (or [0, 1] with `zero_ok`)."""
    if not is_number(value) or not ((value >= 0 if zero_ok else value > 0) and value <= 1):
        raise ValueError(f"{_where(owner, name)} must be in {'[0' if zero_ok else '(0'}, 1], got {value!r}")
