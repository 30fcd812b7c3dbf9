"""Before a read executor reads: every data file opened once and checked long enough,
and every chunk's payload located (from the manifest, or a stock record's head)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

from ...errors import CorruptCheckpointError
from ...storage import Folder, RandomAccess
from ..format.manifest import StoredChunk
from ..format.record_read import HEAD_BYTES, RecordLayout, read_record_layout
from .read_requests import ChunkRead, GatherRead, RecordRead, end_of

__all__ = ["locate", "open_files"]

_Ranges = dict[str, list[tuple[int, int]]]


def open_files(
    folder: Folder,
    reads: Sequence[ChunkRead | RecordRead | GatherRead],
    files: dict[str, RandomAccess],
    ends: dict[str, tuple[int, int, str]],
) -> None:
    """Open every file read, once, into `files`; refuse a missing one, or one too short
    for a range. `ends`: the gathers' last record in each file, and its key."""
    last: dict[str, tuple[int, int, str]] = {}  # name -> (start, end, key) of its last range
    for r in reads:
        if isinstance(r, GatherRead):
            continue
        name = r.info.relative_path
        seen = last.get(name)
        if seen is None or end_of(r.info) > seen[1]:
            last[name] = (r.info.offset, end_of(r.info), r.name)
    for name, (start, end, key) in ends.items():
        seen = last.get(name)
        if seen is None or end > seen[1]:
            last[name] = (start, end, key)
    for name, (start, end, key) in last.items():
        try:
            f = files[name] = folder.open(name)
        except FileNotFoundError as e:
            raise CorruptCheckpointError(f"data file {folder.where(name)} is missing") from e
        size = f.size()
        if end > size:
            raise CorruptCheckpointError(
                f"'{key}': bytes {start}..{end} of {folder.where(name)} lie past its end "
                f"({size} bytes): the file is truncated"
            )


def locate(
    folder: Folder, files: dict[str, RandomAccess], reads: list[ChunkRead]
) -> dict[int, RecordLayout]:
    """Where each chunk's payload is, by `id` of its read: from its manifest entry, else
    (stock records) from the record's head, all heads fetched at once on a store.
    Transformed chunks have none."""
    layouts: dict[int, RecordLayout] = {}
    heads: _Ranges = defaultdict(list)
    pending: list[ChunkRead] = []
    for r in reads:
        info = r.info
        if info.transform_descriptors:
            continue
        if isinstance(info, StoredChunk) and info.payload is not None:
            at, n = info.payload
            layouts[id(r)] = RecordLayout(at, n, r.dtype, r.shape, True)
        else:
            pending.append(r)
            heads[info.relative_path].append(
                (info.offset, info.offset + min(info.length, HEAD_BYTES))
            )
    if not pending:
        return layouts
    if folder.wants_prefetch:
        folder.prefetch(heads)
    try:
        found: dict[tuple[str, int], RecordLayout] = {}
        for r in pending:
            name, at = r.info.relative_path, r.info.offset
            layout = found.get((name, at))
            if layout is None:
                layout = found[(name, at)] = _record_layout(folder, files, r)
            layouts[id(r)] = layout
    finally:
        if folder.wants_prefetch:
            folder.release()
    return layouts


def _record_layout(folder: Folder, files: dict[str, RandomAccess], r: ChunkRead) -> RecordLayout:
    where = folder.where(r.info.relative_path)
    try:
        layout = read_record_layout(files[r.info.relative_path], r.info.offset, r.info.length)
    except ValueError as e:
        raise CorruptCheckpointError(f"'{r.name}' in {where}: {e}") from e
    if layout.shape != r.shape:
        raise CorruptCheckpointError(
            f"'{r.name}' in {where}: the record holds shape {layout.shape}, its chunk is {r.shape}"
        )
    return layout
