"""Holes in a save: the regions of a tensor no chunk covers, found and named.

A hole would read back as whatever memory the reader allocated, so the engine's
plan (`planning`) and `Writer`'s global plan refuse them, naming the first
uncovered region as the slice that selects it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from ...layout import Block
from ...layout.coverage import analyze

__all__ = ["first_hole", "holes_in_plans", "region"]


def first_hole(
    boxes: list[tuple[tuple[int, ...], tuple[int, ...]]], shape: tuple[int, ...]
) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """A region (offsets, sizes) that no box covers, grown from the first uncovered
    element `coverage.analyze` finds; None when the boxes cover the shape or overlap.
    `boxes` are in bounds. For the refusal path: O(boxes x ndim) per dimension."""
    ndim = len(shape)
    if not ndim:
        return ((), ()) if not boxes else None
    solid = [b for b in boxes if math.prod(b[1])]
    point = analyze([Block(o, s) for o, s in solid], shape).hole if solid else (0,) * ndim
    if point is None:
        return None
    lo, hi = list(point), [p + 1 for p in point]
    for d in range(ndim):
        lo[d], hi[d] = _extent(solid, lo, hi, d, shape[d])
    return tuple(lo), tuple(h - lo_ for lo_, h in zip(lo, hi))


def _extent(
    solid: list[tuple[tuple[int, ...], tuple[int, ...]]],
    lo: list[int],
    hi: list[int],
    d: int,
    size: int,
) -> tuple[int, int]:
    """How far the uncovered region [lo, hi) can grow along dim `d`: up to the nearest
    box on each side among those it meets in every other dim."""
    start, end = 0, size
    for offsets, sizes in solid:
        if all(
            offsets[e] < hi[e] and lo[e] < offsets[e] + sizes[e] for e in range(len(lo)) if e != d
        ):
            if offsets[d] >= hi[d]:
                end = min(end, offsets[d])
            else:  # the region is uncovered, so a box meeting it elsewhere ends before it
                start = max(start, offsets[d] + sizes[d])
    return start, end


def holes_in_plans(plans: Sequence[Any]) -> list[str]:
    """The tensors a DCP global plan (every rank's `SavePlan`, after the planner's
    dedup) leaves partly unwritten, each with its first uncovered region. Stock DCP
    checks coverage only across ranks; `Writer` refuses holes in a one-process
    save too. Overlaps are the planner's own check (`_validate_global_plan`)."""
    found: dict[str, tuple[tuple[int, ...], set[tuple[tuple[int, ...], tuple[int, ...]]]]] = {}
    for plan in plans:
        for item in plan.items:
            data = item.tensor_data
            if data is None:
                continue
            shape = tuple(data.size)
            boxes = found.setdefault(item.index.fqn, (shape, set()))[1]
            boxes.add((tuple(data.chunk.offsets), tuple(data.chunk.sizes)))
    problems = []
    for key, (shape, boxes) in found.items():
        volume = sum(math.prod(sizes) for _offsets, sizes in boxes)
        if volume < math.prod(shape):
            hole = region(first_hole(sorted(boxes), shape))
            problems.append(
                f"'{key}': elements {hole} are written by no rank (the chunks "
                f"planned cover {volume} of its {math.prod(shape)} elements); every element "
                "must be saved"
            )
    return problems


def region(found: tuple[tuple[int, ...], tuple[int, ...]] | None) -> str:
    """`[4:6, 0:8]`: a region as the slice that selects it."""
    if found is None:
        return "(somewhere: the chunks also overlap)"
    offsets, sizes = found
    return "[" + ", ".join(f"{o}:{o + n}" for o, n in zip(offsets, sizes)) + "]"
