"""Reading a box of a stored chunk, verified: where checksums decide which bytes are read.

A sub-box of a C-order payload is a set of equal runs of bytes (`byte_runs`).
What is read around them depends on the chunk's checksums:

- tiles (format version 3): the tile-aligned box enclosing the request is read,
  as runs, and every tile in it verified (`tiles`), so a column band of a
  row-wise chunk costs the band widened to whole tiles;
- pages (versions 1 and 2): each run is widened to whole `page_size` pages and
  every page read is verified;
- none (stock checkpoints, or `verify=False`): exactly the runs.

Runs closer than `MERGE_GAP` are read as one span (a smaller gap saves no I/O).
Every function here raises `CorruptCheckpointError` naming the tensor, the file
and the byte range on a short read or a failed checksum. No process group.
"""

from __future__ import annotations

import math

import crc32c
import torch

from ...errors import CorruptCheckpointError
from ...storage import RandomAccess
from ..format.byte_runs import MERGE_GAP, few_runs, list_spans, runs, spans
from ..format.checksums import bad_page, byte_view
from ..format.manifest import StoredChunk, dtype_from_name
from ..format.record_read import RecordLayout
from ..format.tiles import bad_tile, bad_tile_in_box, enclosing_box

__all__ = ["box_ranges", "check_record", "check_whole", "first_bad", "read_box"]


def _checked(chunk: StoredChunk | None, verify: bool) -> list[int] | None:
    """The checksums a read of `chunk` verifies: none for stock chunks or `verify=False`."""
    return chunk.crcs if verify and chunk is not None and chunk.payload is not None else None


def _box_to_read(
    chunk: StoredChunk | None,
    layout: RecordLayout,
    offsets: tuple[int, ...],
    lengths: tuple[int, ...],
    verify: bool,
) -> tuple[tuple[int, ...], tuple[int, ...], int | None]:
    """(offsets, lengths, page): the box actually read for a request, and the page its
    runs widen to. Tiled chunks read the tile-aligned enclosing box; paged ones the
    box itself widened to pages; unchecked ones exactly the box."""
    crcs = _checked(chunk, verify)
    if crcs is None or chunk is None:
        return offsets, lengths, None
    if chunk.tile is None:
        return offsets, lengths, chunk.page_size
    box_offsets, box_lengths = enclosing_box(layout.shape, chunk.tile, offsets, lengths)
    return box_offsets, box_lengths, None


def _spans(
    layout: RecordLayout, offsets: tuple[int, ...], lengths: tuple[int, ...], page: int | None
) -> tuple[torch.Tensor, int, list[tuple[int, int, int, int]]]:
    """(run starts, run bytes, spans) of a box of the payload: what `_read_runs` reads."""
    starts, run = runs(layout.shape, offsets, lengths, layout.dtype.itemsize)
    if not len(starts):
        return starts, run, []
    return starts, run, spans(starts, run, MERGE_GAP, page, layout.payload_length)


def box_ranges(
    chunk: StoredChunk | None,
    layout: RecordLayout,
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
    layout: RecordLayout,
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


def check_record(data: memoryview | bytes, chunk: StoredChunk, path: str, name: str) -> None:
    """Verify a transformed chunk's stored record (its one checksum), read whole."""
    if chunk.crcs and crc32c.crc32c(data) != chunk.crcs[0]:
        raise _failed(name, path, chunk.offset, chunk.offset + chunk.length)


def _failed(name: str, path: str, lo: int, hi: int) -> CorruptCheckpointError:
    return CorruptCheckpointError(f"'{name}': bytes {lo}..{hi} of {path} fail their checksum")


def _read_runs(
    file: RandomAccess,
    path: str,
    name: str,
    layout: RecordLayout,
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
    layout: RecordLayout,
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
    layout: RecordLayout,
    name: str,
    path: str,
) -> None:
    """Verify the pages in `data`, which begins at payload offset `start` (page-aligned)."""
    k = bad_page(data, start, page, pages)
    if k is not None:
        lo = layout.payload_offset + start + k
        raise _failed(name, path, lo, lo + min(page, len(data) - k))
