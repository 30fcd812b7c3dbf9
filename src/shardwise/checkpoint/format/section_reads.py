"""The sections a load reads from a version 4 index, as checked bytes, window by window.

A load of 100,000 small tensors reads 100,000 sections. Where each lies is kept
as a few int64 columns (not a tuple of Python integers a section: 13 MiB), and
the windows of adjacent sections are read into one buffer reused for the whole
load (a fresh 8 MiB `bytes` a window left that much of the heap behind each
time); each section is copied out of it, its checksum checked.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence

import crc32c
import numpy as np

from ...errors import CorruptCheckpointError
from ...storage import Folder
from .manifest_entries import IndexRef, TensorEntry
from .record_check import check_name, record_limit

__all__ = ["WINDOW", "section_bytes"]

WINDOW = 8 << 20  # bytes of adjacent sections read at once
_HUGE = 1 << 61  # past any file: larger stored values are cut to it, sums of three stay exact


def section_bytes(
    folder: Folder,
    index: IndexRef,
    keys: Sequence[str],
    tensors: Mapping[str, TensorEntry],
    source: str,
    listing: dict[str, int],
) -> Iterator[tuple[str, TensorEntry, bytes, str]]:
    """The sections of `tensors[key]` for `keys` as bytes matching their checksums, in
    index order, and each one's name in errors: adjacent sections read together, a
    window of at most `WINDOW` bytes (or one section) at a time."""
    check_name(folder, "index", index.file, source, shardwise=True)
    where = folder.where(index.file)
    heads = [tensors[key].section for key in keys]
    assert None not in heads
    try:
        table = np.asarray(heads, dtype=np.int64).reshape(-1, 5)
    except OverflowError:  # crafted: past any file
        table = np.asarray([[min(v, _HUGE) for v in h] for h in heads], dtype=np.int64)  # type: ignore[union-attr]
    del heads
    table = np.minimum(table, _HUGE)
    block = table[:, 0]
    bad = np.flatnonzero(block >= len(index.blocks))
    if len(bad):
        key = keys[int(bad[0])]
        raise CorruptCheckpointError(
            f"{source}: '{key}' names block {tensors[key].section[0]} of its index"  # type: ignore[index]
        )
    blocks = np.minimum(np.asarray([min(b, _HUGE) for b in index.blocks], dtype=np.int64), _HUGE)
    start = blocks[block] + table[:, 1]
    order = np.argsort(start, kind="stable")
    start, length, crc = start[order], table[order, 2], table[order, 4]
    del table, block
    end = start + length
    # no two sections share bytes (no writer makes them so): many keys naming one section
    # would each hold a copy of it before any row is checked
    solid = np.flatnonzero(length > 0)
    clash = np.flatnonzero(start[solid][1:] < end[solid][:-1])
    if len(clash):
        a, b = (keys[int(order[solid[i]])] for i in (clash[0], clash[0] + 1))
        raise CorruptCheckpointError(
            f"{source}: the sections of '{a}' and '{b}' overlap in {where}: damaged or crafted"
        )
    size = listing.get(index.file)  # plain files only: never a link or a folder
    if size is None:
        raise CorruptCheckpointError(
            f"{source}: index file {where} is missing or not a plain file "
            "(links and folders are refused)"
        )
    limit = record_limit(listing, index.file)  # what one window may cost (`record_limit`)
    file = folder.open(index.file)
    buffer = bytearray()
    try:
        i = 0
        while i < len(order):
            j = _window(start, end, i)
            first, last = int(start[i]), int(end[i:j].max())
            if last > size:
                raise CorruptCheckpointError(
                    f"{source}: sections up to byte {last} of {where} ({size} bytes): truncated"
                )
            if last - first > limit:  # past `WINDOW`: the window is its first section alone
                raise CorruptCheckpointError(
                    f"{source}: the section of '{keys[int(order[i])]}' claims {last - first} "
                    f"bytes of {where}, more than the {limit} a record of this folder may "
                    "hold (damaged or crafted: refused, nothing read)"
                )
            if len(buffer) < last - first:
                buffer = bytearray(last - first)
            got = file.readinto([memoryview(buffer)[: last - first]], first) if last > first else 0
            window = memoryview(buffer)[:got]  # short: what lies past it fails its checksum
            spans = zip(start[i:j].tolist(), length[i:j].tolist(), crc[i:j].tolist())
            for (at, n, expected), which in zip(spans, order[i:j].tolist()):
                data = bytes(window[at - first : at - first + n])
                key = keys[which]
                if crc32c.crc32c(data) != expected:
                    raise CorruptCheckpointError(
                        f"{where}: the section of '{key}' does not match its checksum (damaged)"
                    )
                yield key, tensors[key], data, f"{where} '{key}'"
            window.release()
            i = j
    finally:
        file.close()


def _window(start: np.ndarray, end: np.ndarray, i: int) -> int:
    """Where the window from section `i` (sorted by start) ends: before the first later
    section ending more than `WINDOW` bytes past its start (found in doubling steps:
    linear in the window's sections, however many follow)."""
    limit, step = int(start[i]) + WINDOW, 64
    while True:
        over = np.flatnonzero(end[i + 1 : i + 1 + step] > limit)
        if len(over):
            return i + 1 + int(over[0])
        if i + 1 + step >= len(end):
            return len(end)
        step *= 2
