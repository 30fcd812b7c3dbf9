"""Many sections of one ndim decoded at once, with `ChunkTable`'s checks, as one array.

A load of 100,000 small tensors reads 100,000 sections of a few rows each; a
`ChunkTable` per section costs about 20 µs and a dozen objects. Here a group of
sections is joined and checked with a few numpy passes: every rule
`ChunkTable.__init__` applies to a section (lengths, impossible values, negative
counts and boxes, frames held by rows their writers keep, the checksums counted)
is applied per section, and a section failing any is only marked: its caller
decodes it alone, as a `ChunkTable`, which names what is wrong.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .chunk_table import _LIMIT, row_width

__all__ = ["Rows", "decode"]


@dataclass
class Rows:
    """The rows of a group of sections: row `i` is row `i - start[sec[i]]` of section
    `sec[i]`; `columns` its version 4 columns, `crc_at` where its writer keeps its
    checksums (-1: in the section), `first` its first checksum held in the section (0:
    none). `ok[s]`: section `s` passed every check (its rows are meaningful only then)."""

    columns: np.ndarray
    crc_at: np.ndarray
    first: np.ndarray
    sec: np.ndarray
    start: np.ndarray
    count: np.ndarray
    ok: np.ndarray


def decode(sections: list[tuple[bytes, int]], ndim: int, version: int) -> Rows:
    """Sections (their bytes, their row count) of tensors of `ndim` dimensions, of a
    manifest of `version`."""
    width, old = row_width(ndim, version), row_width(ndim, 4)
    heads, tails, counts, fits, lengths = [], [], [], [], []
    for data, rows in sections:
        head = rows * width * 8
        fit = len(data) >= head and (len(data) - head) % 4 == 0
        fits.append(fit)
        counts.append(rows if fit else 0)
        if fit:
            heads.append(data[:head])
            tails.append(data[head:])
        lengths.append((len(data) - head) // 4 if fit else 0)
    n = len(sections)
    count = np.asarray(counts, dtype=np.int64)
    start = np.zeros(n, dtype=np.int64)
    np.cumsum(count[:-1], out=start[1:])
    full = np.frombuffer(b"".join(heads), dtype="<i8").reshape(-1, width)
    crcs = np.frombuffer(b"".join(tails), dtype="<u4")
    sec = np.repeat(np.arange(n), count)
    columns = full[:, :old]
    crc_at = full[:, old] if width > old else np.full(len(full), -1, dtype=np.int64)
    kept = crc_at >= 0
    held = columns[:, old - 2]  # checksums counted: in the section unless kept
    bad = (held < 0) | (kept & (columns[:, old - 3] != 0))  # a kept row holds no frame
    if len(full):
        bad |= (full.min(axis=1) < -1) | (full.max(axis=1) >= _LIMIT)
        if ndim:
            bad |= columns[:, : 2 * ndim].min(axis=1) < 0
    inline = np.where(kept, 0, held)
    bad |= inline > len(crcs)  # never a valid count: its sums below stay exact
    inline = np.where(bad, 0, inline)
    ok = np.asarray(fits, dtype=bool) & ~(np.bincount(sec, weights=bad, minlength=n) > 0)
    ok &= np.bincount(sec, weights=inline, minlength=n) == np.asarray(lengths, dtype=np.int64)
    before = np.cumsum(inline) - inline  # checksums of the group's rows before each row
    tail = np.zeros(n, dtype=np.int64)
    np.cumsum(np.asarray(lengths[:-1], dtype=np.int64), out=tail[1:])
    at = tail[sec] + before - before[start[sec]] if len(sec) else before
    usable = ok[sec] & (inline > 0)
    first = np.where(usable, np.append(crcs, np.uint32(0))[np.where(usable, at, len(crcs))], 0)
    return Rows(columns, crc_at, first.astype(np.uint32), sec, start, count, ok)
