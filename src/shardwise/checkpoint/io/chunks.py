"""Reading stored chunks: what a read asks for, and the bytes of chunks read into
their targets.

The requests every reader hands the read executor, as plain data; a box of one
stored chunk read and verified (where checksums decide which bytes are read);
whole chunks of one file read by one `preadv` per span straight into their
targets; parts of many small chunks gathered a window at a time, copied from
scratch into their targets as words; parts of one-tile chunks that several
pieces share read once per chunk.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, fields

import crc32c
import numpy as np
import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo

from ...errors import CorruptCheckpointError
from ...storage import Folder, RandomAccess
from ..format import (
    MERGE_GAP,
    ArchiveLayout,
    Boxes,
    StoredChunk,
    Unsettled,
    bad_page,
    bad_tile,
    bad_tile_in_box,
    byte_view,
    dtype_from_name,
    enclosing_box,
    few_runs,
    file_of,
    list_spans,
    row_strides,
    runs,
    spans,
)

__all__ = [
    "BATCH",
    "ChunkRead",
    "GAP",
    "GatherRead",
    "PendingChunk",
    "Placed",
    "ArchiveRead",
    "SMALL",
    "Whole",
    "Window",
    "as_whole",
    "box_ranges",
    "check_archive",
    "check_whole",
    "end_of",
    "extents",
    "first_bad",
    "gather",
    "read_box",
    "read_span",
    "read_whole",
    "whole_spans",
    "windows",
    "words_of",
]


# -----------------------------------------------------------------------------
# What a read asks for, as plain data: the requests every reader hands the read executor.
#
# `ChunkRead` is a box of one stored chunk bound for a target tensor; `ArchiveRead`
# a stored record's bytes (an object, a transformed chunk, framing bytes) bound
# for a callback; `GatherRead` the parts of many small chunks bound for one
# target, as arrays (`format.table`). Planners (the load engine, `Reader`'s translation of DCP's
# `ReadItem`s, the offline tools) make them; `io.read` runs them.
# -----------------------------------------------------------------------------


@dataclass
class ChunkRead:
    """The box `offsets`/`lengths` of a stored chunk (of `shape` and `dtype`, stored as
    `info` says: a `StoredChunk` adds its payload and checksums) into `target`: a
    detached tensor, or a call that gives one just before the read (DCP's
    `resolve_tensor`); `done` is told once the target holds it."""

    name: str
    info: _StorageInfo
    shape: tuple[int, ...]
    dtype: torch.dtype
    offsets: tuple[int, ...]
    lengths: tuple[int, ...]
    target: torch.Tensor | Callable[[], torch.Tensor]
    done: Callable[[torch.Tensor], None] | None = None


@dataclass
class PendingChunk(StoredChunk):
    """A stored chunk whose checksums its writer keeps, fetched by the rank that reads
    it when it reads (`format.index.Unsettled`): `crcs` is None until then, set by the
    read executor before any of its bytes is checked (`io.read`)."""

    unsettled: Unsettled | None = None

    @classmethod
    def planned(cls, unsettled: Unsettled, dtype: str, page_size: int) -> PendingChunk:
        c = StoredChunk.of(unsettled.entry, dtype, page_size)
        out = cls(**{f.name: getattr(c, f.name) for f in fields(StoredChunk)}, unsettled=unsettled)
        out.crcs = None  # none fetched: never read as "no checksums to check"
        return out


@dataclass
class ArchiveRead:
    """A stored record's bytes (an object's; a transformed chunk's, or any byte range, to
    verify), read whole, checked against its checksum, its stream extensions undone
    unless not to `decode`, handed to `use`."""

    name: str
    info: _StorageInfo
    use: Callable[[bytes], None]
    decode: bool = True


@dataclass
class GatherRead:
    """The parts `boxes` of small stored chunks (plain, one checksum tile each) into one
    target, given as its memory: `words`, flat, `factor` words an element, of `shape`
    in elements (`io.chunks.words_of`)."""

    name: str
    words: np.ndarray
    factor: int
    shape: tuple[int, ...]
    boxes: Boxes


def end_of(info: _StorageInfo) -> int:
    """Where a stored record ends in its file."""
    return int(info.offset + info.length)


# -----------------------------------------------------------------------------
# Reading a box of a stored chunk, verified: where checksums decide which bytes are read.
#
# A sub-box of a C-order payload is a set of equal runs of bytes (`format.checksums`).
# What is read around them depends on the chunk's checksums:
#
# - tiles (format version 3): the tile-aligned box enclosing the request is read,
#   as runs, and every tile in it verified (`format.checksums`), so a column band of a
#   row-wise chunk costs the band widened to whole tiles;
# - pages (versions 1 and 2): each run is widened to whole `page_size` pages and
#   every page read is verified;
# - none (stock checkpoints, or `verify=False`): exactly the runs.
#
# Runs closer than `MERGE_GAP` are read as one span (a smaller gap saves no I/O).
# Every function here raises `CorruptCheckpointError` naming the tensor, the file
# and the byte range on a short read or a failed checksum. No process group.
# -----------------------------------------------------------------------------


def _checked(chunk: StoredChunk | None, verify: bool) -> list[int] | None:
    """The checksums a read of `chunk` verifies: none for stock chunks or `verify=False`."""
    return chunk.crcs if verify and chunk is not None and chunk.payload is not None else None


def verifies(chunk: StoredChunk | None, verify: bool) -> bool:
    """Whether a read of `chunk` checks checksums, known before they are fetched (a
    `PendingChunk`'s are, by the read executor, before any of its reads runs)."""
    return (
        verify
        and chunk is not None
        and chunk.payload is not None
        and (chunk.crcs is not None or isinstance(chunk, PendingChunk))
    )


def crc_count(chunk: StoredChunk) -> int:
    """How many checksums `chunk` has (a `PendingChunk`'s: its row's count, checked)."""
    if chunk.crcs is not None:
        return len(chunk.crcs)
    if isinstance(chunk, PendingChunk) and chunk.unsettled is not None:
        return chunk.unsettled.count
    return 0


def _box_to_read(
    chunk: StoredChunk | None,
    layout: ArchiveLayout,
    offsets: tuple[int, ...],
    lengths: tuple[int, ...],
    verify: bool,
) -> tuple[tuple[int, ...], tuple[int, ...], int | None]:
    """(offsets, lengths, page): the box actually read for a request, and the page its
    runs widen to. Tiled chunks read the tile-aligned enclosing box; paged ones the
    box itself widened to pages; unchecked ones exactly the box."""
    if chunk is None or not verifies(chunk, verify):
        return offsets, lengths, None
    if chunk.tile is None:
        return offsets, lengths, chunk.page_size
    box_offsets, box_lengths = enclosing_box(layout.shape, chunk.tile, offsets, lengths)
    return box_offsets, box_lengths, None


def _spans(
    layout: ArchiveLayout, offsets: tuple[int, ...], lengths: tuple[int, ...], page: int | None
) -> tuple[torch.Tensor, int, list[tuple[int, int, int, int]]]:
    """(run starts, run bytes, spans) of a box of the payload: what `_read_runs` reads."""
    starts, run = runs(layout.shape, offsets, lengths, layout.dtype.itemsize)
    if not len(starts):
        return starts, run, []
    return starts, run, spans(starts, run, MERGE_GAP, page, layout.payload_length)


def box_ranges(
    chunk: StoredChunk | None,
    layout: ArchiveLayout,
    offsets: tuple[int, ...],
    lengths: tuple[int, ...],
    verify: bool,
) -> list[tuple[int, int]]:
    """The `(start, end)` file byte ranges `read_box` reads for the same request, so
    that a remote folder can fetch them all at once beforehand."""
    offsets, lengths, page = _box_to_read(chunk, layout, tuple(offsets), tuple(lengths), verify)
    at = layout.payload_offset
    if lengths == layout.shape:
        return [(at, at + layout.payload_length)] if math.prod(lengths) else []
    return [(at + s, at + s + n) for s, n, _, _ in _spans(layout, offsets, lengths, page)[2]]


def read_box(
    file: RandomAccess,
    path: str,
    name: str,
    chunk: StoredChunk | None,
    layout: ArchiveLayout,
    offsets: tuple[int, ...],
    lengths: tuple[int, ...],
    dest: torch.Tensor,
    verify: bool,
) -> tuple[torch.Tensor, int]:
    """Read the box `offsets`/`lengths` of the C-order payload `layout` locates in `file`.

    Returns a tensor holding the box (`dest` itself when the box could be read
    straight into it: contiguous, on the CPU, of the stored dtype; else a tensor
    the caller copies from) and the number of bytes read. `chunk` carries the
    checksums (None for a stock checkpoint: nothing to verify); `verify=False`
    reads exactly the box.
    """
    offsets, lengths = tuple(offsets), tuple(lengths)
    crcs = _checked(chunk, verify)
    direct = (
        tuple(dest.shape) == lengths
        and dest.is_contiguous()
        and dest.device.type == "cpu"
        and dest.dtype == layout.dtype
    )
    box_offsets, box_lengths, page = _box_to_read(chunk, layout, offsets, lengths, verify)
    if crcs is None or chunk is None or chunk.tile is None:  # exact runs, or widened to pages
        out = dest if direct else torch.empty(lengths, dtype=layout.dtype)
        return out, _read_runs(file, path, name, layout, offsets, lengths, out, page, crcs)
    exact = box_offsets == offsets and box_lengths == lengths
    if exact:
        box = dest if direct else torch.empty(lengths, dtype=layout.dtype)
    else:
        box = torch.empty(box_lengths, dtype=layout.dtype)
    n = _read_runs(file, path, name, layout, box_offsets, box_lengths, box, None, None)
    if math.prod(lengths):  # an empty box reads nothing, so has nothing to verify
        bad = bad_tile_in_box(
            byte_view(box),
            layout.shape,
            layout.dtype.itemsize,
            chunk.tile,
            crcs,
            box_offsets,
            box_lengths,
        )
        if bad is not None:
            at = layout.payload_offset
            raise _failed(name, path, at + bad.start, at + bad.end)
    if exact:
        return box, n
    inside = tuple(slice(o - b, o - b + k) for o, b, k in zip(offsets, box_offsets, lengths))
    return box[inside], n


def check_whole(payload: memoryview | bytes, chunk: StoredChunk, path: str, name: str) -> None:
    """Verify a chunk's whole payload, already in memory (a batched read), against its
    tiles or pages; a chunk without checksums passes."""
    if chunk.payload is not None and len(payload) != chunk.payload[1]:
        at, n = chunk.payload
        raise CorruptCheckpointError(
            f"'{name}': short read of bytes {at}..{at + n} of {path} "
            f"({len(payload)} bytes there): truncated"
        )
    bad = first_bad(payload, chunk)
    if bad is not None and chunk.payload is not None:
        raise _failed(name, path, chunk.payload[0] + bad[0], chunk.payload[0] + bad[1])


def first_bad(payload: memoryview | bytes, chunk: StoredChunk) -> tuple[int, int] | None:
    """The payload byte range `(start, end)` of the first tile (or page) of a whole
    payload that fails its checksum, else None: `check_whole` without the raise."""
    if chunk.crcs is None or chunk.payload is None:
        return None
    if chunk.tile is not None:
        itemsize = dtype_from_name(chunk.dtype).itemsize
        bad = bad_tile(payload, chunk.sizes, itemsize, chunk.tile, chunk.crcs)
        return None if bad is None else (bad.start, bad.end)
    k = bad_page(payload, 0, chunk.page_size, chunk.crcs)
    return None if k is None else (k, k + min(chunk.page_size, len(payload) - k))


def check_archive(data: memoryview | bytes, chunk: StoredChunk, path: str, name: str) -> None:
    """Verify a transformed chunk's stored record (its one checksum), read whole."""
    if chunk.crcs and crc32c.crc32c(data) != chunk.crcs[0]:
        raise _failed(name, path, chunk.offset, chunk.offset + chunk.length)


def _failed(name: str, path: str, lo: int, hi: int) -> CorruptCheckpointError:
    return CorruptCheckpointError(f"'{name}': bytes {lo}..{hi} of {path} fail their checksum")


def _read_runs(
    file: RandomAccess,
    path: str,
    name: str,
    layout: ArchiveLayout,
    offsets: tuple[int, ...],
    lengths: tuple[int, ...],
    out: torch.Tensor,
    page: int | None,
    pages: list[int] | None,
) -> int:
    """Read the box into `out` (contiguous, of the box's shape), each span widened to
    whole `page`s and its pages verified when `pages` is given; the bytes read.

    A whole chunk, or a span that is exactly one run, is read straight into
    `out`; a span of several runs is read once and the runs gathered from it
    with one copy.
    """
    if lengths == layout.shape:  # the whole chunk, the common case: one read
        if not out.numel():
            return 0
        view = byte_view(out)
        _pread_into(file, view, layout.payload_offset, path, name)
        if pages is not None and page is not None:
            _check_pages(view, 0, page, pages, layout, name, path)
        return len(view)
    few = few_runs(layout.shape, offsets, lengths, layout.dtype.itemsize)
    if few is not None:
        return _read_few_runs(file, path, name, layout, few, out, page, pages)
    starts, run, reads = _spans(layout, offsets, lengths, page if pages is not None else None)
    if not reads:
        return 0
    rows = out.reshape(-1).view(torch.uint8).view(len(starts), run)
    dest = rows.numpy().data.cast("B")
    total = 0
    for span_start, span_len, first, last in reads:
        buf = None
        if last - first == 1 and span_len == run:  # one run: straight into its place
            view = dest[first * run : last * run]
        else:
            buf = torch.empty(span_len, dtype=torch.uint8)
            view = byte_view(buf)
        _pread_into(file, view, layout.payload_offset + span_start, path, name)
        total += span_len
        if pages is not None and page is not None:
            _check_pages(view, span_start, page, pages, layout, name, path)
        if buf is not None:  # several runs read as one span: gather them with one copy
            torch.index_select(
                buf.unfold(0, run, 1), 0, starts[first:last] - span_start, out=rows[first:last]
            )
    return total


def _read_few_runs(
    file: RandomAccess,
    path: str,
    name: str,
    layout: ArchiveLayout,
    found: tuple[list[int], int],
    out: torch.Tensor,
    page: int | None,
    pages: list[int] | None,
) -> int:
    """`_read_runs` for at most `SMALL` runs, with lists and memoryviews."""
    starts, run = found
    if not starts:
        return 0
    checked = page if pages is not None else None
    dest = byte_view(out)
    total = 0
    for span_start, span_len, first, last in list_spans(
        starts, run, MERGE_GAP, checked, layout.payload_length
    ):
        one = last - first == 1 and span_len == run  # one run: straight into its place
        view = dest[first * run : last * run] if one else memoryview(bytearray(span_len))
        _pread_into(file, view, layout.payload_offset + span_start, path, name)
        total += span_len
        if pages is not None and page is not None:
            _check_pages(view, span_start, page, pages, layout, name, path)
        if not one:  # several runs read as one span: each copied into its place
            for i in range(first, last):
                at = starts[i] - span_start
                dest[i * run : (i + 1) * run] = view[at : at + run]
    return total


def _pread_into(file: RandomAccess, view: memoryview, at: int, path: str, name: str) -> None:
    got = file.readinto([view], at)
    if got != len(view):
        raise CorruptCheckpointError(
            f"'{name}': short read of bytes {at}..{at + len(view)} of {path} "
            f"({got} bytes there): truncated"
        )


def _check_pages(
    data: memoryview,
    start: int,
    page: int,
    pages: list[int],
    layout: ArchiveLayout,
    name: str,
    path: str,
) -> None:
    """Verify the pages in `data`, which begins at payload offset `start` (page-aligned)."""
    k = bad_page(data, start, page, pages)
    if k is not None:
        lo = layout.payload_offset + start + k
        raise _failed(name, path, lo, lo + min(page, len(data) - k))


# -----------------------------------------------------------------------------
# Whole stored chunks of one file read by one `preadv` each span, straight into their targets.
#
# The fast path of every load: a target piece that is exactly a stored chunk takes
# the chunk's payload bytes in its own memory (when it is contiguous, on the CPU
# and of the stored dtype; else scratch it is copied from: a pinned stand-in for
# a device target, `io.device`). Chunks closer than
# `GAP` in a file share one read, the small frames between them landing in
# scratch. Each payload is then verified against its checksums by the same
# functions a ranged read uses (`io.chunks.check_whole`).
# -----------------------------------------------------------------------------

GAP = 64 << 10  # chunks closer than this in a file are read by one preadv, gap and all

_SPAN_IOVECS = 1024

Whole = tuple[ChunkRead, ArchiveLayout]

Placed = tuple[ChunkRead, torch.Tensor, torch.Tensor]  # read, its target, what took the bytes


def whole_spans(batch: list[Whole], limit: int) -> list[tuple[int, int, list[Whole]]]:
    """Whole chunks of one file as `(start, end, chunks)` spans, by offset: neighbours
    within `GAP` share one while it stays within `limit` bytes (what one staging slab
    holds, for device targets), a chunk far from (or overlapping: damaged) the last
    starts the next."""
    batch = sorted(batch, key=lambda b: b[1].payload_offset)
    out = []
    start = 0
    while start < len(batch):
        end = start
        lo = pos = batch[start][1].payload_offset
        while end < len(batch) and end - start < (_SPAN_IOVECS - 1) // 2:
            at, n = batch[end][1].payload_offset, batch[end][1].payload_length
            if end > start and (at < pos or at - pos > GAP or at + n - lo > limit):
                break
            pos = at + n
            end += 1
        out.append((lo, pos, batch[start:end]))
        start = end
    return out


def read_span(
    file: RandomAccess,
    where: str,
    span: list[Whole],
    lo: int,
    resolve: Callable[[ChunkRead], torch.Tensor],
    verify: bool,
    scratch: Callable[[torch.Tensor, ArchiveLayout], torch.Tensor],
) -> tuple[int, list[Placed]]:
    """Read one span (`resolve` gives each chunk's target), verify each payload; the
    bytes read, and where each chunk's bytes went (its target, or `scratch` — a
    stand-in for a device target — to copy from)."""
    buffers: list[memoryview] = []
    placed: list[tuple[ChunkRead, torch.Tensor, torch.Tensor, memoryview]] = []
    pos = lo
    for read, layout in span:
        at = layout.payload_offset
        if at > pos:
            buffers.append(memoryview(bytearray(at - pos)))
        target = resolve(read)
        direct = (
            target.device.type == "cpu" and target.is_contiguous() and target.dtype == layout.dtype
        )
        dest = target if direct else scratch(target, layout)
        view = byte_view(dest) if dest.numel() else memoryview(b"")
        if layout.payload_length < len(view):  # `format.archive` refuses it: never trusted here
            raise CorruptCheckpointError(
                f"'{read.name}' in {where}: its payload holds {layout.payload_length} bytes, "
                f"its chunk needs {len(view)}"
            )
        buffers.append(view)
        placed.append((read, target, dest, view))
        pos = at + len(view)  # exactly the chunk's bytes: the target's size, not the record's
    got = file.readinto(buffers, lo) if pos > lo else 0
    if got != pos - lo:
        raise CorruptCheckpointError(f"{where}: short read of bytes {lo}..{pos}: truncated")
    for read, _target, _dest, view in placed:
        if verify and isinstance(read.info, StoredChunk):
            _check(read.name, read.info, view, where)
    return got, [(read, target, dest) for read, target, dest, _view in placed]


def _check(name: str, chunk: StoredChunk, view: memoryview, where: str) -> None:
    crcs = chunk.crcs
    if crcs is not None and len(crcs) == 1 and chunk.tile in (None, chunk.sizes):
        if crc32c.crc32c(view) == crcs[0]:  # one tile or page: the whole payload
            return
    check_whole(view, chunk, where, name)


# -----------------------------------------------------------------------------
# Parts of one-tile chunks read as whole chunks, once per chunk, on the whole-chunk path.
#
# Verifying, a part of a chunk costs the checksum tiles it touches, and a chunk of
# up to 256 KiB is one tile (`format.checksums`): a part of it reads the whole payload
# anyway. A reshard reads many such parts (a column band of each row chunk of
# every tensor): one `read_box` each, a dozen steps per part for a few hundred
# bytes, and a chunk read again for each of this rank's pieces it overlaps. So
# such parts become one whole-chunk read per chunk into scratch, batched with its
# file's neighbours into one `preadv` and verified once (`io.chunks`), whose
# `done` copies each part's box into its target: the same bytes read, the same
# checks, a fraction of the steps.
# -----------------------------------------------------------------------------


def read_whole(read: ChunkRead, layout: ArchiveLayout, verify: bool) -> bool:
    """Whether part `read` reads its whole chunk anyway: verifying a one-tile chunk,
    into a tensor on the CPU (a device target keeps its staged path)."""
    info = read.info
    return (
        verify
        and isinstance(info, StoredChunk)
        and crc_count(info) == 1
        and info.tile == tuple(layout.shape)
        and read.done is None
        and isinstance(read.target, torch.Tensor)
        and read.target.device.type == "cpu"
    )


def as_whole(parts: list[ChunkRead], layout: ArchiveLayout) -> ChunkRead:
    """One read of the whole chunk `parts` (all `read_whole`) are parts of, into scratch;
    its `done` copies each part's box into that part's target."""
    first = parts[0]

    def done(chunk: torch.Tensor) -> None:
        for part in parts:
            box = tuple(slice(o, o + n) for o, n in zip(part.offsets, part.lengths))
            target = part.target
            assert isinstance(target, torch.Tensor)
            target.copy_(chunk[box])

    scratch = torch.empty(layout.shape, dtype=layout.dtype)
    zero = (0,) * len(layout.shape)
    return ChunkRead(
        first.name, first.info, first.shape, first.dtype, zero, layout.shape, scratch, done
    )


# -----------------------------------------------------------------------------
# Parts of chunks copied from scratch into their targets as words, many at a time.
#
# The chunks a window read lie in one scratch buffer (`io.chunks`), each payload
# where its file had it (so not aligned to its element size). A target is viewed
# as flat words (`words_of`: an element is one word, or two for complex128); so
# is the scratch, from each byte offset a payload may start at. Every small part
# (up to `SMALL` words) becomes word indices, built for all parts at once with
# numpy, at most `BATCH` words at a time, and each target takes one fancy-indexed
# copy a batch: a few numpy calls a target instead of a few torch calls a part. A
# larger part is one strided copy of its own (its words from first to last are in
# the scratch, whole chunk or not).
# -----------------------------------------------------------------------------

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
        if len(source) != span:  # never: `io.chunks` read its chunk's bytes; never unchecked
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


# -----------------------------------------------------------------------------
# Parts of many small stored chunks gathered into their targets, a window at a time.
#
# A reshard onto another layout reads, on each rank, parts of many small chunks:
# loading by columns what was saved by rows takes a band of every row chunk of
# every tensor (32,000 parts a rank for 1,000 tensors of 32 chunks). Verifying,
# each part reads its whole chunk anyway (one checksum tile). One read request,
# one scratch tensor and one copy a part cost about 50 µs of Python each; here a
# window of parts (`GatherRead`s, at most `WINDOW` bytes of chunks) costs a few
# numpy calls a target:
#
# * the distinct chunks are read whole, neighbours in a file by one `preadv` (gaps
#   into one junk buffer), each payload into a 16-byte-aligned slot of one scratch
#   buffer, and each verified against its checksum;
# * the parts go from scratch into their targets as words (`io.chunks`).
#
# Host memory: the window's scratch (its chunks, at least one target's) and
# `io.chunks`'s index arrays.
# -----------------------------------------------------------------------------

WINDOW = 8 << 20  # bytes of chunks a window reads into scratch

_IOVECS = 511  # chunks a preadv fills (each with a gap before it: under IOV_MAX)

_WORDS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def words_of(target: torch.Tensor) -> tuple[np.ndarray, int] | None:
    """`target`'s memory as a flat array of words and the words an element takes; None
    when it has no such view (not a plain, contiguous, non-empty CPU tensor)."""
    size = target.element_size()
    word = min(size, 8)
    if (
        target.device.type != "cpu"
        or target.layout != torch.strided
        or not target.dim()
        or not target.numel()
        or not target.is_contiguous()
        or target.is_conj()
        or target.is_neg()
        or target.is_quantized
        or size % word
        or word not in _WORDS
    ):
        return None
    try:
        return target.detach().view(_WORDS[word]).numpy().reshape(-1), size // word
    except (RuntimeError, TypeError):  # a dtype with no integer view
        return None


def extents(reads: list[GatherRead]) -> dict[str, tuple[int, int, str]]:
    """Each data file the gathers read: the record that ends last in it (start, end) and
    its key, as `io.read.open_files` names a file too short for it."""
    if not reads:
        return {}
    files = np.concatenate([r.boxes.file for r in reads])
    record = np.concatenate([r.boxes.record for r in reads])
    owner = np.repeat(np.arange(len(reads)), [len(r.boxes.crc) for r in reads])
    end = record.sum(axis=1)
    order = np.lexsort((end, files[:, 2], files[:, 1], files[:, 0]))  # by file, then end
    ranked = files[order]
    last = order[np.append((ranked[1:] != ranked[:-1]).any(axis=1), True)]
    return {
        file_of(*files[i].tolist()): (int(record[i, 0]), int(end[i]), reads[owner[i]].name)
        for i in last.tolist()
    }


def windows(
    reads: list[GatherRead],
    folder: Folder,
    files: dict[str, RandomAccess],
    verify: bool,
    count: Callable[[int], None],
) -> list[Window]:
    """`reads` in windows, each a read job (`Window.ranges`, `Window.run`) that reads
    from `files` once they are open. The reads go in the order their first chunks are
    stored (a file holds its tensors in key order, a state dict need not), so that a
    window's chunks lie side by side."""
    reads = sorted(reads, key=lambda r: (*r.boxes.file[0].tolist(), int(r.boxes.payload[0, 0])))
    out: list[Window] = []
    start = 0
    while start < len(reads):
        end, size = start, 0
        while end < len(reads) and (end == start or size < WINDOW):
            size += int(reads[end].boxes.payload[:, 1].sum())
            end += 1
        out.append(Window(reads[start:end], folder, files, verify, count))
        start = end
    return out


class Window:
    """Gathers whose chunks are read together into one scratch buffer."""

    def __init__(
        self,
        reads: list[GatherRead],
        folder: Folder,
        files: dict[str, RandomAccess],
        verify: bool,
        count: Callable[[int], None],
    ) -> None:
        self.reads, self.folder, self.files, self.verify, self.count = (
            reads,
            folder,
            files,
            verify,
            count,
        )
        boxes = [r.boxes for r in reads]
        self.owner = np.repeat(np.arange(len(reads)), [len(b.crc) for b in boxes])
        stored = np.column_stack(
            [np.concatenate([b.file for b in boxes]), np.concatenate([b.payload for b in boxes])]
        )
        self.chunks, first, inverse = _distinct(stored)
        inverse = inverse.reshape(-1)
        self.crcs = np.concatenate([b.crc for b in boxes])[first].tolist()
        self.first = self.owner[first].tolist()  # a read of each chunk, for errors
        skip = np.zeros(len(self.chunks), dtype=np.int64)  # payload bytes not read, at its start
        if not verify:  # each chunk from its parts' first byte to their last, no more
            skip = _needed(reads, boxes, inverse, self.chunks)
        self.spans = _chunk_spans(self.chunks, GAP if verify else MERGE_GAP)
        self.slot, self.dense, self.total = _slots(self.chunks, self.spans)
        # where each part's chunk's payload starts in scratch, in bytes (before the
        # scratch when its first bytes are not read: they are never indexed)
        self.at = (self.slot - skip)[inverse]
        self.ranges: dict[str, list[tuple[int, int]]] = {}
        for a, b in self.spans:
            lo, hi = int(self.chunks[a, 3]), int(self.chunks[b - 1, 3:5].sum())
            self.ranges.setdefault(self._name(a), []).append((lo, hi))

    def _name(self, i: int) -> str:
        return file_of(*self.chunks[i, :3].tolist())

    def run(self) -> None:
        scratch = np.empty(self.total, dtype=np.uint8)
        view = scratch.data
        offsets, lengths, slots = (
            self.chunks[:, 3].tolist(),
            self.chunks[:, 4].tolist(),
            self.slot.tolist(),
        )
        for (a, b), dense in zip(self.spans, self.dense):
            name = self._name(a)
            lo, hi = offsets[a], offsets[b - 1] + lengths[b - 1]
            file = self.files[name]
            if dense:  # gaps and all, straight into place
                got, wanted = file.readinto([view[slots[a] : slots[a] + hi - lo]], lo), hi - lo
            else:
                got, wanted = _read_apart(file, view, offsets[a:b], lengths[a:b], slots[a:b])
            self.count(got)
            if got != wanted:
                where = self.folder.where(name)
                raise CorruptCheckpointError(f"{where}: short read of bytes {lo}..{hi}: truncated")
            if self.verify:
                self._check(view, range(a, b), offsets, lengths, slots, name)
        gather(self.reads, self.owner, self.at, scratch)

    def _check(
        self,
        view: memoryview,
        chunks: range,
        offsets: list[int],
        lengths: list[int],
        slots: list[int],
        name: str,
    ) -> None:
        for i in chunks:
            if crc32c.crc32c(view[slots[i] : slots[i] + lengths[i]]) != self.crcs[i]:
                lo, hi = offsets[i], offsets[i] + lengths[i]
                raise CorruptCheckpointError(
                    f"'{self.reads[self.first[i]].name}': bytes {lo}..{hi} of "
                    f"{self.folder.where(name)} fail their checksum"
                )


def _distinct(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The distinct rows of `rows` in order (by column), where each first is, and which
    distinct row each row is: `np.unique(axis=0)`, a fraction of its cost."""
    order = np.lexsort(rows.T[::-1])
    ranked = rows[order]
    new = np.ones(len(rows), dtype=bool)
    new[1:] = (ranked[1:] != ranked[:-1]).any(axis=1)
    inverse = np.empty(len(rows), dtype=np.int64)
    inverse[order] = np.cumsum(new) - 1
    return ranked[new], order[new], inverse


def _needed(
    reads: list[GatherRead], boxes: list[Boxes], inverse: np.ndarray, chunks: np.ndarray
) -> np.ndarray:
    """Narrow each chunk's range (`chunks[:, 3:5]`) to the bytes its parts need, from
    the first to the last; the bytes skipped at each chunk's start."""
    itemsize = np.repeat([r.words.itemsize * r.factor for r in reads], [len(b.crc) for b in boxes])
    sizes, inner, lengths = (np.concatenate([getattr(b, f) for b in boxes]) for f in _BOX)
    strides = row_strides(sizes)
    first = (inner * strides).sum(axis=1) * itemsize
    last = first + (((lengths - 1) * strides).sum(axis=1) + 1) * itemsize
    lo = np.full(len(chunks), np.iinfo(np.int64).max, dtype=np.int64)
    hi = np.zeros(len(chunks), dtype=np.int64)
    np.minimum.at(lo, inverse, first)
    np.maximum.at(hi, inverse, last)
    chunks[:, 3] += lo
    chunks[:, 4] = hi - lo
    return lo


_BOX = ("sizes", "inner", "lengths")


def _chunk_spans(chunks: np.ndarray, gap: int) -> list[tuple[int, int]]:
    """Runs of chunks (sorted by file, then offset) one read takes: same file, in
    order, gaps under `gap`."""
    n = len(chunks)
    end = chunks[:, 3] + chunks[:, 4]
    cut = np.ones(n, dtype=bool)
    space = chunks[1:, 3] - end[:-1]
    cut[1:] = (chunks[1:, :3] != chunks[:-1, :3]).any(axis=1) | (space < 0) | (space >= gap)
    bounds = np.append(np.flatnonzero(cut), n).tolist()
    return list(zip(bounds, bounds[1:]))


def _slots(chunks: np.ndarray, spans: list[tuple[int, int]]) -> tuple[np.ndarray, list[bool], int]:
    """Where each chunk's payload lands in scratch, whether each span is read as one
    range (dense: gaps at most as large as the payloads; its payloads where the file
    has them, aligned or not), the bytes. Apart, each payload is 16-byte aligned."""
    slot = np.empty(len(chunks), dtype=np.int64)
    dense, pos = [], 0
    for a, b in spans:
        at, n = chunks[a:b, 3], chunks[a:b, 4]
        length = int(at[-1] + n[-1] - at[0])
        if length <= 2 * int(n.sum()) + 4096:
            slot[a:b] = pos + (at - at[0])
            dense.append(True)
        else:
            room = (n + 15) & ~15
            slot[a:b] = pos + np.cumsum(room) - room
            dense.append(False)
            length = int(room.sum())
        pos += (length + 15) & ~15
    return slot, dense, max(16, pos)


def _read_apart(
    file: RandomAccess, view: memoryview, at: list[int], n: list[int], slots: list[int]
) -> tuple[int, int]:
    """Read chunks `at`/`n` of one span into their slots, the gaps into junk: one `preadv`
    a `_IOVECS` chunks. The bytes read and asked for, gaps included."""
    junk, got, wanted = memoryview(bytearray(GAP)), 0, 0
    for first in range(0, len(at), _IOVECS):
        buffers: list[memoryview] = []
        pos = lo = at[first]
        for i in range(first, min(first + _IOVECS, len(at))):
            if at[i] > pos:
                buffers.append(junk[: at[i] - pos])
            buffers.append(view[slots[i] : slots[i] + n[i]])
            pos = at[i] + n[i]
        read = file.readinto(buffers, lo)
        got, wanted = got + read, wanted + pos - lo
        if read != pos - lo:
            break
    return got, wanted
