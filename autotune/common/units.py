"""Byte quantities for people: formatting for logs and messages, and an OOM's breakdown in words
(breakdown.py measures it). Imports nothing heavy: `autotune report` uses it without torch.

Owns: byte sizes in words and back. Touches nothing.
"""

from __future__ import annotations

from typing import Any


def format_bytes(n: int | float | None) -> str:
    """Binary units, one decimal ('1.5 GiB'); 'n/a' for None."""
    if n is None:
        return "n/a"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024:
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"


_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
          "t": 1000**4, "tb": 1000**4, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(text: str) -> int:
    """'12GiB', '512 MB', '1.5g', '2048' -> bytes. Decimal units (GB) are powers of 1000,
    binary ones (GiB) powers of 1024. Raises ValueError naming the text."""
    value = text.strip().lower().replace("_", "")
    number = value.rstrip("abcdefghijklmnopqrstuvwxyz").strip()
    unit = value[len(number):].strip() if number else value
    try:
        amount = float(number)
    except ValueError:
        raise ValueError(f"{text!r} is not a size: expected a number and a unit like '12GiB' or '512MB'") from None
    if unit not in _UNITS:
        raise ValueError(f"{text!r}: unknown unit {unit!r}; use B, KB, MB, GB, TB, KiB, MiB, GiB or TiB")
    if amount <= 0:
        raise ValueError(f"{text!r} must be a positive size")
    return int(amount * _UNITS[unit])


def describe_breakdown(breakdown: dict[str, Any]) -> str:
    """One line for messages and the report: the parts, largest first, against the cap."""
    names = ("weights", "gradients", "optimizer_state", "activations_and_temporaries", "libraries", "other")
    parts = sorted(((breakdown[n], n) for n in names if breakdown.get(n) is not None), reverse=True)
    text = ", ".join(f"{name.replace('_', ' ')} {format_bytes(value)}" for value, name in parts)
    cap = f" of a {format_bytes(breakdown['cap'])} cap" if breakdown.get("cap") else ""
    beside = "".join(f"; {label} {format_bytes(breakdown[key])}"
                     for key, label in (("allocator_cache", "allocator cache beside it"),
                                        ("outside_torch", "outside torch on the device"))
                     if breakdown.get(key) is not None)
    return f"held {format_bytes(breakdown['held'])}{cap} ({breakdown['measure']}): {text}{beside}"
