"""The stored rows each piece of a load overlaps, their checksums fetched in groups.

From format version 5 a collective save's writers keep each chunk's checksums in
their own data files (`format.writer_checksums`). A load needs those of the rows
it reads, and fetching them row by row would cost one read per row (1,000 per
rank, each a request on an object store); fetched for many sections at once,
they cost one read per data file and group.
"""

from __future__ import annotations

from collections.abc import Iterator

from ..format.chunk_table import ChunkTable
from ..format.writer_checksums import resolve_rows
from .inventory import Piece
from .stored_view import Covering
from .whole_rows import WholeRows

__all__ = ["GROUP", "fetched"]

# sections whose rows' checksums are fetched together: up to this many rows in all
# (their tables held at once: 8 MiB of FSDP sections at 1,024 ranks)
GROUP = 1 << 16


def fetched(
    sections: Iterator[tuple[str, Covering]],
    held: dict[str, list[Piece]],
    whole: WholeRows | None = None,
) -> Iterator[tuple[str, Covering, list[list[int] | None]]]:
    """Each section with the rows each of its pieces overlaps (None: not sectioned),
    sections of up to `GROUP` rows at a time, the checksums of those rows that their
    writers keep fetched for the group at once (`writer_checksums`), with those of the
    rows `whole` took since: a read per data file and group, not one a row."""
    group: list[tuple[str, Covering, list[list[int] | None]]] = []
    rows = 0
    for key, stored in sections:
        table = None if stored.sectioned is None else stored.sectioned.table
        group.append((key, stored, [_rows(table, p) for p in held[key]]))
        rows += 0 if table is None else len(table)
        if rows >= GROUP:
            yield from _fetch(group, whole)
            group, rows = [], 0
    yield from _fetch(group, whole)


def _rows(table: ChunkTable | None, piece: Piece) -> list[int] | None:
    return None if table is None else table.overlapping(piece.offsets, piece.sizes)


def _fetch(
    group: list[tuple[str, Covering, list[list[int] | None]]], whole: WholeRows | None
) -> list[tuple[str, Covering, list[list[int] | None]]]:
    tables = [(stored.sectioned.table, r) for _k, stored, found in group for r in found if r]  # type: ignore[union-attr]
    if whole is None:
        resolve_rows(tables)
    else:
        resolve_rows(tables, whole.fetching(), whole.fetch)
    return group
