"""The chunks a record claims for a tensor: in bounds, and covering it exactly.

Checked before anything is read or allocated (see `record_check`): every chunk
has its tensor's ndim and lies in bounds, and the distinct chunks cover it
exactly (no partial overlap, no hole: nothing a reader returns was left
unfilled), in O(n log n) (`layout.coverage`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from ...errors import CorruptCheckpointError, LayoutError
from ...layout import Block
from ...layout.coverage import analyze

__all__ = ["check_coverage", "checked_ints"]

_LIMIT = 1 << 62  # no real offset, size or length comes near it: int64 arithmetic stays exact
_INT = {int}  # the only type a number in a record may have (`bool` is refused)


def checked_ints(values: Any, what: str, key: str, record: str) -> tuple[int, ...]:
    try:
        out = tuple(values)
    except TypeError:
        out = (values,)
    if not all(type(v) is int and 0 <= v < _LIMIT for v in out):
        raise CorruptCheckpointError(f"{record}: '{key}' has an invalid {what} {values!r}")
    return out


def _whole(shape: Any, offsets: Any, sizes: Any) -> bool:
    """Whether one chunk at `offsets` of `sizes` is all of `shape`, every number valid."""
    try:
        return (
            tuple(sizes) == tuple(shape)
            and set(map(type, shape)) <= _INT
            and (not shape or 0 <= min(shape) and max(shape) < _LIMIT)
            and len(offsets) == len(shape)
            and set(map(type, offsets)) <= _INT
            and not any(offsets)
        )
    except TypeError:
        return False


def check_coverage(
    key: str,
    shape: Sequence[int],
    chunks: Sequence[tuple[tuple[int, ...], tuple[int, ...]]],
    record: str,
    *,
    replicas: bool = True,
    holes: bool = False,
) -> None:
    """The chunks `(offsets, sizes)` of tensor `key` have its ndim, lie in bounds and
    cover it exactly: no partial overlap, no element left out (unless `holes`: a
    per-rank record holds its rank's chunks only). Exact duplicates count as
    replicas unless `replicas` is False (a manifest stores each once)."""
    if len(chunks) == 1 and _whole(shape, *chunks[0]):
        return  # the common case: one chunk holding the whole tensor
    shape = checked_ints(shape, "shape", key, record)
    ndim = len(shape)
    distinct: dict[tuple[int, ...], tuple[int, ...]] = {}
    for offsets, sizes in chunks:
        offsets = checked_ints(offsets, "chunk offset", key, record)
        sizes = checked_ints(sizes, "chunk size", key, record)
        if len(offsets) != ndim or len(sizes) != ndim:
            raise CorruptCheckpointError(
                f"{record}: chunk at offsets {offsets} of '{key}' has {len(sizes)} dimensions, "
                f"the tensor {ndim} (shape {shape})"
            )
        if any(o + s > n for o, s, n in zip(offsets, sizes, shape)):
            raise CorruptCheckpointError(
                f"{record}: chunk at offsets {offsets} sizes {sizes} of '{key}' lies outside "
                f"its shape {shape}"
            )
        seen = distinct.get(offsets)
        distinct[offsets] = sizes
        if seen is not None and (seen != sizes or not replicas):
            raise CorruptCheckpointError(
                f"{record}: '{key}' has two chunks at offsets {offsets} (sizes {seen} and "
                f"{sizes}): damaged or crafted"
            )
    blocks = [(o, s) for o, s in distinct.items() if all(s)]
    problem = _tiles(blocks, shape, holes)
    if problem is None:
        return
    raise CorruptCheckpointError(
        f"{record}: the chunks of '{key}' (shape {shape}) {problem}: damaged or crafted; "
        "refused (nothing a chunk does not hold is ever returned)"
    )


def _tiles(
    blocks: list[tuple[tuple[int, ...], tuple[int, ...]]], shape: tuple[int, ...], holes: bool
) -> str | None:
    """Why non-empty distinct `blocks` fail to tile `shape` exactly, or with `holes`
    overlap (None: they do not).
    The common layouts (one whole chunk, a cut along one dimension) are checked
    directly; anything else by `layout.coverage.analyze`."""
    total = math.prod(shape)
    if total == 0:
        return None  # nothing to cover, and a non-empty block of an empty tensor is out of bounds
    if (len(blocks) == 1 and blocks[0][1] == shape) or (holes and len(blocks) <= 1):
        return None
    cut = {d for _, s in blocks for d in range(len(shape)) if s[d] != shape[d]}
    if len(cut) == 1:
        (d,) = cut
        spans = sorted((o[d], o[d] + s[d]) for o, s in blocks)
        at = 0
        for start, end in spans:
            if start > at and not holes:
                return f"leave elements {at}..{start} of dimension {d} in no chunk"
            if start < at:
                return f"overlap in part at {start} along dimension {d}"
            at = end
        if at == shape[d] or holes:
            return None
        return f"leave elements {at}.. of dimension {d} in no chunk"
    try:
        found = analyze([Block(o, s) for o, s in blocks], shape)
    except (LayoutError, OverflowError, RuntimeError) as e:
        return f"cannot be analysed ({e})"
    if found.overlap is not None:
        a, b = found.overlap
        return f"overlap in part: {a} and {b}"
    if found.hole is not None and not holes:
        return f"leave element {found.hole} in no chunk"
    return None
