"""Byte quantities for people: formatting for logs and messages."""

from __future__ import annotations


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
