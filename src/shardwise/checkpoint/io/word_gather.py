"""Parts of chunks copied from scratch into their targets as words, many at a time.

The chunks a window read lie in one scratch buffer (`part_gather`), each payload
where its file had it (so not aligned to its element size). A target is viewed
as flat words (`words_of`: an element is one word, or two for complex128); so
is the scratch, from each byte offset a payload may start at. Every small part
(up to `SMALL` words) becomes word indices, built for all parts at once with
numpy, at most `BATCH` words at a time, and each target takes one fancy-indexed
copy a batch: a few numpy calls a target instead of a few torch calls a part. A
larger part is one strided copy of its own (its words from first to last are in
the scratch, whole chunk or not).
"""

from __future__ import annotations

import numpy as np

from ...errors import CorruptCheckpointError
from ..format.row_boxes import row_strides
from .read_requests import GatherRead

__all__ = ["BATCH", "SMALL", "gather"]

BATCH = 1 << 18  # word indices built at once (a few MiB of int64 arrays)
SMALL = 4096  # words: a part up to this is gathered by index, a larger one copied as a box


def gather(reads: list[GatherRead], owner: np.ndarray, at: np.ndarray, scratch: np.ndarray) -> None:
    """Every part from its chunk's payload in `scratch` (starting at byte `at`: before
    the scratch when the payload's first bytes, which no part takes, were not read)
    into its target."""
    ndims = np.asarray([len(r.shape) for r in reads])
    views = _Views(scratch)
    for d in np.unique(ndims).tolist():
        mine = [reads[i] for i in np.flatnonzero(ndims == d).tolist()]
        _gather_rows(mine, at[ndims[owner] == d], views)


class _Views:
    """The scratch as words of each size, from each byte offset below the size (a
    payload where its file has it need not be aligned)."""

    def __init__(self, scratch: np.ndarray) -> None:
        self.scratch = scratch
        self.made: dict[tuple[np.dtype, int], np.ndarray] = {}

    def __call__(self, dtype: np.dtype, skew: int) -> np.ndarray:
        view = self.made.get((dtype, skew))
        if view is None:
            n = (len(self.scratch) - skew) // dtype.itemsize * dtype.itemsize
            view = self.made[(dtype, skew)] = self.scratch[skew : skew + n].view(dtype)
        return view


def _gather_rows(reads: list[GatherRead], at: np.ndarray, views: _Views) -> None:
    """`gather` for reads of one ndim, their parts in order."""
    owner = np.repeat(np.arange(len(reads)), [len(r.boxes.crc) for r in reads])
    factor = np.asarray([r.factor for r in reads])[owner]
    fields = [np.concatenate([getattr(r.boxes, f) for r in reads]) for f in _FIELDS]
    shape = np.asarray([r.shape for r in reads], dtype=np.int64)[owner]
    sizes, inner, lengths, dest = fields
    for a in (sizes, inner, lengths, dest, shape):
        a[:, -1] *= factor  # the last dimension in words
    word = np.asarray([r.words.itemsize for r in reads])[owner]
    skew = at % word
    base = at // word
    src_stride, dst_stride = row_strides(sizes), row_strides(shape)
    src = base + (inner * src_stride).sum(axis=1)
    dst = (dest * dst_stride).sum(axis=1)
    count = lengths.prod(axis=1)
    small = count <= SMALL
    for i in np.flatnonzero(~small).tolist():  # a large part: one strided copy
        words = reads[int(owner[i])].words
        view = views(words.dtype, int(skew[i]))
        span = int(((lengths[i] - 1) * src_stride[i]).sum()) + 1  # its first word to its last
        source = view[src[i] : src[i] + span]
        if len(source) != span:  # never: `part_gather` read its chunk's bytes; never unchecked
            raise CorruptCheckpointError(
                f"'{reads[int(owner[i])].name}': a part lies outside its chunk"
            )
        part = np.lib.stride_tricks.as_strided(
            source,
            shape=tuple(lengths[i].tolist()),
            strides=tuple((src_stride[i] * words.itemsize).tolist()),
            writeable=False,
        )
        out = [slice(x, x + m) for x, m in zip(dest[i].tolist(), lengths[i].tolist())]
        words.reshape(shape[i].tolist())[tuple(out)] = part
    keep = np.flatnonzero(small)
    ends = np.cumsum(count[keep])
    start = 0
    while start < len(keep):  # at most BATCH words (or one part) indexed at once
        before = int(ends[start] - count[keep[start]])
        stop = max(start + 1, int(np.searchsorted(ends, before + BATCH, side="right")))
        part = keep[start:stop]
        s, t, row = _expand(src[part], dst[part], lengths[part], src_stride[part], dst_stride[part])
        # by target, then by the skew of the chunk (one view each)
        key = owner[part][row] * 8 + skew[part][row]
        cuts = (np.flatnonzero(np.diff(key)) + 1).tolist()
        if not (np.diff(key) >= 0).all():
            order = np.argsort(key, kind="stable")
            s, t, key = s[order], t[order], key[order]
            cuts = (np.flatnonzero(np.diff(key)) + 1).tolist()
        for lo, hi in zip([0, *cuts], [*cuts, len(key)]):
            words = reads[int(key[lo]) // 8].words
            words[t[lo:hi]] = views(words.dtype, int(key[lo]) % 8)[s[lo:hi]]
        start = stop


_FIELDS = ("sizes", "inner", "lengths", "dest")


def _expand(
    src: np.ndarray, dst: np.ndarray, lengths: np.ndarray, ss: np.ndarray, ds: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every word of every box, as (source index, target index, its box's row)."""
    row = np.arange(len(src))
    for j in range(lengths.shape[1]):
        n = lengths[row, j]
        rep = np.repeat(np.arange(len(row)), n)
        within = np.arange(len(rep)) - np.repeat(np.cumsum(n) - n, n)
        row = row[rep]
        src = src[rep] + within * ss[row, j]
        dst = dst[rep] + within * ds[row, j]
    return src, dst, row
