"""Checksums kept by their writers (format version 5), fetched for the rows a reader takes.

A collective save's writer puts each chunk's frame and tile checksums in its own
data file, after its records (`engine.rank_file`): the index rows then follow
from the plan alone, so a repeated save of one structure routes no checksums to
the keys' owners and exchanges a few bytes per rank (`engine.saving`). A reader
fetches them only for the rows it takes, per data file, the wanted slots in runs
(slots less than `GAP` apart read together): a rank loading its own 1,000 chunks
reads one run of 8 KB of its writer's file, a rank loading a column of every
writer's chunks one run per writer. Nothing is read before its range is checked:
inside a plain data file of the listing (never the index), no two slots
overlapping, so what is read is bounded by the files' real sizes.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ...errors import CorruptCheckpointError
from ...storage import Folder
from .chunk_table import ChunkTable, Fetch, Slot

__all__ = ["GAP", "fetcher", "fetch_checksums", "resolve_rows"]

GAP = 4096  # bytes between two wanted slots of a file below which both are one read


def fetcher(folder: Folder, listing: dict[str, int], index: str) -> Fetch:
    """The fetch of the tables a reader decodes from `folder`'s index file `index`."""

    def fetch(wanted: list[Slot]) -> list[tuple[int, list[int]]]:
        return fetch_checksums(folder, listing, index, wanted)

    return fetch


def fetch_checksums(
    folder: Folder,
    listing: dict[str, int],
    index: str,
    wanted: Sequence[Slot],
) -> list[tuple[int, list[int]]]:
    """The (frame, checksums) of each wanted slot: (data file, crc_at, count, the name
    of its tensor's table, for errors)."""
    by_file: dict[str, list[int]] = {}
    for n, (name, *_rest) in enumerate(wanted):
        by_file.setdefault(name, []).append(n)
    out: list[tuple[int, list[int]]] = [(0, [])] * len(wanted)
    for name, which in by_file.items():
        which.sort(key=lambda n: wanted[n][1])
        runs = _runs(folder, listing, index, name, [wanted[n] for n in which])
        file = folder.open(name)
        try:
            for first, last in runs:
                start = wanted[which[first]][1]
                stop = max(wanted[n][1] + 4 * (1 + wanted[n][2]) for n in which[first:last])
                data = file.pread(stop - start, start)
                if len(data) != stop - start:
                    raise CorruptCheckpointError(
                        f"{wanted[which[first]][3]}: chunk checksums at bytes {start}..{stop} "
                        f"of data file {folder.where(name)} cut short (truncated)"
                    )
                words = np.frombuffer(data, dtype="<u4", count=len(data) // 4).tolist()
                for n in which[first:last]:
                    off, count = wanted[n][1] - start, wanted[n][2]
                    slot = (
                        words[off // 4 : off // 4 + 1 + count]
                        if off % 4 == 0
                        else np.frombuffer(data, dtype="<u4", count=1 + count, offset=off).tolist()
                    )
                    out[n] = (slot[0], slot[1:])
        finally:
            file.close()
    return out


def resolve_rows(pairs: Sequence[tuple[ChunkTable, Sequence[int]]]) -> None:
    """Fetch, in one pass over the files, the checksums of every table's rows whose
    writers keep them (`ChunkTable.resolve` for many tables)."""
    asked: list[tuple[ChunkTable, list[int]]] = []
    wanted: list[Slot] = []
    seen: dict[int, set[int]] = {}
    fetch = None
    for table, rows in pairs:
        done = seen.setdefault(id(table), set())
        fresh = [i for i in rows if i not in done]
        done.update(fresh)
        missing = table.missing(fresh)
        if missing:
            asked.append((table, [i for i, _ in missing]))
            wanted += [w for _, w in missing]
            fetch = fetch or table.fetch
    if not wanted:
        return
    if fetch is None:  # a reader's bug: a version 5 section read without its files
        raise CorruptCheckpointError("chunk checksums kept with data, not read")
    values = fetch(wanted)
    at = 0
    for table, rows in asked:
        table.fill(rows, values[at : at + len(rows)])
        at += len(rows)


def _runs(
    folder: Folder, listing: dict[str, int], index: str, name: str, slots: list[Slot]
) -> list[tuple[int, int]]:
    """The slots (sorted) of data file `name`, checked, as runs of positions read
    together."""
    size = listing.get(name)
    if size is None or name == index:
        what = "the index" if name == index else "missing or not a plain file"
        raise CorruptCheckpointError(
            f"{slots[0][3]}: data file {folder.where(name)} is {what} (it keeps chunk checksums)"
        )
    runs: list[list[int]] = []
    end = -1
    for n, (_name, at, count, where) in enumerate(slots):
        stop = at + 4 * (1 + count)
        if stop > size or at < end:
            raise CorruptCheckpointError(
                f"{where}: chunk checksums at bytes {at}..{stop} of data file "
                f"{folder.where(name)} ({size} bytes) "
                + ("overlap another chunk's" if at < end else "lie past its end")
            )
        if not runs or at - end >= GAP:
            runs.append([n, n + 1])
        else:
            runs[-1][1] = n + 1
        end = stop
    return [(a, b) for a, b in runs]
