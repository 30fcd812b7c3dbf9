"""Byte sizes as people write them ("256MiB", "2GiB", "5G") and read them ("1.5 GiB")."""

from __future__ import annotations

from decimal import Decimal, InvalidOperation
from fractions import Fraction

from ..errors import InvalidArgumentError

__all__ = ["format_size", "parse_size"]

_UNITS = {"k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40}
_MAX_SIZE = 2**63 - 1  # the largest file offset: a larger size means nothing
# a number's own text is short: a longer one (or an exponent past +-40) is refused
# before any exact arithmetic, which would build ints of that many digits
_MAX_DIGITS, _MAX_EXPONENT = 64, 40


def parse_size(text: str) -> int:
    """`"256MiB"`, `"2GiB"`, `"5G"`, `"1024"` -> bytes (binary units).

    A whole number of bytes from 1 to 2**63 - 1, counted exactly ("1.5K" is 1536,
    "0.3K" is refused): never rounded, never infinite. `InvalidArgumentError`
    otherwise: a `ValueError`, which argparse (`type=parse_size`) reports as a
    usage error.
    """
    t = text.strip().lower().removesuffix("b").removesuffix("i")
    unit = _UNITS.get(t[-1:], 1)
    number = t[:-1] if unit > 1 else t
    try:
        value = Decimal(number) if len(number) <= _MAX_DIGITS else None
    except InvalidOperation:
        value = None
    if value is None or not value.is_finite() or abs(value.adjusted()) > _MAX_EXPONENT:
        raise InvalidArgumentError(f"not a size: {text!r} (examples: 256MiB, 2GiB, 1048576)")
    size = Fraction(value) * unit  # exact: Decimal and Fraction never round here
    if size.denominator != 1 or not 1 <= size <= _MAX_SIZE:
        raise InvalidArgumentError(
            f"not a size: {text!r} is {float(size):g} bytes; give a whole number of bytes, "
            "at least 1 and under 8 EiB (examples: 256MiB, 2GiB, 1048576)"
        )
    return int(size)


def format_size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"
