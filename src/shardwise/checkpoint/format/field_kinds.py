"""What a leaf field of `shardwise.json` may hold: the checks and the kinds built on them.

Each check is a plain predicate, so the fast path (`fast_entries`) applies the
same rules as the tables without building a field path.
"""

from __future__ import annotations

import base64
import binascii
import functools
from collections.abc import Callable
from typing import Any

import torch

from .field_table import leaf


def is_int(v: Any) -> bool:
    return type(v) is int  # not bool, not float: JSON `true` or `1.5` is no size


def is_nonneg(v: Any) -> bool:
    return type(v) is int and v >= 0


def is_crc(v: Any) -> bool:
    return type(v) is int and 0 <= v < 4294967296


def list_of(ok: Callable[[Any], bool]) -> Callable[[Any], bool]:
    return lambda v: isinstance(v, list) and all(ok(x) for x in v)


# The lists every chunk has, checked inline: a manifest of 100,000 chunks checks 10^6 integers.
def is_nonneg_list(v: Any) -> bool:
    return type(v) is list and all(type(x) is int and x >= 0 for x in v)


def is_crc_list(v: Any) -> bool:
    return type(v) is list and all(type(x) is int and 0 <= x < 4294967296 for x in v)


def is_str(v: Any) -> bool:
    return isinstance(v, str)


def is_range(v: Any) -> bool:
    return type(v) is list and len(v) == 2 and is_nonneg(v[0]) and is_nonneg(v[1])


def is_file_name(v: Any) -> bool:
    """A plain name inside the checkpoint folder, never a path out of it."""
    return (
        isinstance(v, str)
        and v not in ("", ".", "..")
        and "/" not in v
        and "\\" not in v
        and "\0" not in v
    )


def is_dtype_name(v: Any) -> bool:
    return isinstance(v, str) and _known_dtype(v)


@functools.lru_cache(maxsize=256)
def _known_dtype(v: str) -> bool:
    return isinstance(getattr(torch, v, None), torch.dtype)


def is_base64(v: Any) -> bool:
    try:
        return isinstance(v, str) and bool(base64.b64decode(v, validate=True))
    except binascii.Error:
        return False


NONNEG = leaf("a non-negative integer", is_nonneg)
POSITIVE = leaf("a positive integer", lambda v: is_int(v) and v > 0)
CRC = leaf("a crc32c: an integer in [0, 2**32)", is_crc)
INDEX = leaf("a list of non-negative integers", is_nonneg_list, tuple)
CRCS = leaf("a list of crc32c", is_crc_list)
RANGE = leaf("[offset, length]: non-negative integers", is_range, tuple)
RANGE_OR_NULL = leaf(
    "[offset, length] or null",
    lambda v: v is None or is_range(v),
    lambda v: None if v is None else tuple(v),
)
FILE = leaf("a file name (no `/`, no `..`)", is_file_name)
TRANSFORM = leaf("a non-empty list of strings", lambda v: list_of(is_str)(v) and bool(v))
STR_OR_NULL = leaf("a string or null", lambda v: v is None or is_str(v))
