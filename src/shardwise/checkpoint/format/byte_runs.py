"""Which byte ranges of a C-order chunk a sub-box covers: pure math, so ranged reads are testable.

A sub-box of a C-contiguous array is a set of equal runs of bytes along its
last partial dimension; `runs` finds them, and `spans` groups them into the
reads a reader makes. No I/O here: `Reader` moves the bytes.
"""

from __future__ import annotations

import math

import torch

__all__ = ["MERGE_GAP", "SMALL", "c_strides", "few_runs", "list_spans", "nbytes", "runs", "spans"]

MERGE_GAP = 4096  # runs closer than one OS page are read together: a smaller gap saves no I/O
# up to this many runs, plain lists beat tensors: a reshard's part reads are often a few
# rows of a column band, where a dozen tensor ops cost more than the read itself
SMALL = 64


def c_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """Element strides of a C-order array of `shape`."""
    return tuple(math.prod(shape[d + 1 :]) for d in range(len(shape)))


def nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    """Bytes of a C-order array: the one size rule for chunks, tensors and files."""
    return math.prod(shape) * dtype.itemsize


def _folded(shape: tuple[int, ...], offsets: tuple[int, ...], lengths: tuple[int, ...]) -> int:
    """The last dimension a run does not span whole: the trailing dimensions a box
    spans whole fold into one run."""
    k = len(shape) - 1
    while k > 0 and lengths[k] == shape[k] and offsets[k] == 0:
        k -= 1
    return k


def few_runs(
    shape: tuple[int, ...], offsets: tuple[int, ...], lengths: tuple[int, ...], itemsize: int
) -> tuple[list[int], int] | None:
    """`runs` as a list when there are at most `SMALL` runs, else None."""
    ndim = len(shape)
    if ndim == 0:
        return [0], itemsize
    if math.prod(lengths) == 0:
        return [], 0
    k = _folded(shape, offsets, lengths)
    if math.prod(lengths[:k]) > SMALL:
        return None
    strides = c_strides(shape)
    starts = [offsets[k] * strides[k]]
    for d in reversed(range(k)):  # outer dimensions vary slowest
        steps = [i * strides[d] for i in range(offsets[d], offsets[d] + lengths[d])]
        starts = [step + start for step in steps for start in starts]
    return [start * itemsize for start in starts], lengths[k] * strides[k] * itemsize


def list_spans(
    starts: list[int], run: int, gap: int, page: int | None, limit: int
) -> list[tuple[int, int, int, int]]:
    """`spans` of `few_runs`' list."""
    lo, hi = starts, [s + run for s in starts]
    if page is not None:
        lo = [s // page * page for s in lo]
        hi = [min(-(-e // page) * page, limit) for e in hi]
    bounds = [0, *(i + 1 for i in range(len(lo) - 1) if lo[i + 1] - hi[i] >= gap), len(lo)]
    return [(lo[a], hi[b - 1] - lo[a], a, b) for a, b in zip(bounds, bounds[1:])]


def runs(
    shape: tuple[int, ...], offsets: tuple[int, ...], lengths: tuple[int, ...], itemsize: int
) -> tuple[torch.Tensor, int]:
    """`(starts, run_bytes)`: the byte offsets, in C order, of the equal runs that make
    up a sub-box of a C-order array; disjoint, increasing, and no two touching."""
    ndim = len(shape)
    if ndim == 0:
        return torch.zeros(1, dtype=torch.int64), itemsize
    if math.prod(lengths) == 0:
        return torch.zeros(0, dtype=torch.int64), 0
    k = _folded(shape, offsets, lengths)
    strides = c_strides(shape)
    starts = torch.tensor([offsets[k] * strides[k]], dtype=torch.int64)
    for d in reversed(range(k)):  # outer dimensions vary slowest
        steps = torch.arange(offsets[d], offsets[d] + lengths[d], dtype=torch.int64) * strides[d]
        starts = (steps.view(-1, 1) + starts.view(1, -1)).reshape(-1)
    return starts * itemsize, lengths[k] * strides[k] * itemsize


def spans(
    starts: torch.Tensor, run: int, gap: int, page: int | None, limit: int
) -> list[tuple[int, int, int, int]]:
    """Byte spans `(start, length, first run, end run)` to read: runs merged across
    gaps under `gap`, widened to whole `page`s (not past `limit`) when verifying."""
    lo = starts
    hi = starts + run
    if page is not None:
        lo = lo // page * page
        hi = torch.clamp((hi + page - 1) // page * page, max=limit)
    breaks = (lo[1:] - hi[:-1] >= gap).nonzero().flatten() + 1
    bounds = [0, *breaks.tolist(), len(starts)]
    lo_list, hi_list = lo.tolist(), hi.tolist()
    return [(lo_list[a], hi_list[b - 1] - lo_list[a], a, b) for a, b in zip(bounds, bounds[1:])]
