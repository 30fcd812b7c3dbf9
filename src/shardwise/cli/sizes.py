"""Byte sizes as people write them ("256MiB", "2GiB", "5G") and read them ("1.5 GiB")."""

from __future__ import annotations

from ..errors import InvalidArgumentError

__all__ = ["format_size", "parse_size"]

_UNITS = {"k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}


def parse_size(text: str) -> int:
    """`"256MiB"`, `"2GiB"`, `"5G"`, `"1024"` -> bytes (binary units)."""
    t = text.strip().lower().removesuffix("b").removesuffix("i")
    try:
        return int(float(t[:-1]) * _UNITS[t[-1]]) if t and t[-1] in _UNITS else int(t)
    except ValueError:
        raise InvalidArgumentError(
            f"not a size: {text!r} (examples: 256MiB, 2GiB, 1048576)"
        ) from None


def format_size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"
