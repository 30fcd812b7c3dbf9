"""`verify`: recompute every checksum and check coverage, so damage is found before a load needs it.

One process, no process group, memory bounded by a few MiB (whole checksum
tiles, or pages in older checkpoints); every problem is listed at once.
"""

from __future__ import annotations

import os
import pickle
from collections.abc import Callable
from typing import Any

import crc32c

from ...errors import CorruptCheckpointError, IncompleteCheckpointError
from ...layout import Block
from ...layout.coverage import analyze
from ...storage import Folder, RandomAccess
from ..format.checksums import bad_page, frame_crc
from ..format.manifest import ChunkEntry, dtype_from_name
from ..format.tiles import payload_tiles
from .opening import open_checkpoint

_BLOCK = 4 << 20  # contiguous tiles are read and checked this many bytes at a time

__all__ = ["verify"]


def verify(
    path: str | os.PathLike,
    progress: Callable[[int], None] | None = None,
    *,
    raise_on_error: bool = True,
    storage_options: dict[str, Any] | None = None,
) -> list[str]:
    """Check a whole checkpoint; raise, listing every problem found, unless it is sound.

    Recomputes every checksum (shardwise checkpoints), checks that every
    tensor's chunks cover it exactly once, and that every record is readable.
    `progress(n)` is called with the bytes checked so far, as they are.

    Raises `IncompleteCheckpointError` when the save never committed, else
    `CorruptCheckpointError`; the message lists every problem and the
    exception's `problems` holds them, one line each. A path that holds no
    checkpoint at all raises `FileNotFoundError`.

    `raise_on_error=False` is the reporting form: the same problems are
    returned instead of raised (empty: the checkpoint is sound), for callers
    that show or count them. A sound checkpoint returns `[]` either way.
    """
    kind, problems = _find_problems(path, progress, storage_options)
    if problems and raise_on_error:
        count = f"{len(problems)} problem{'s' if len(problems) > 1 else ''}"
        raise kind(f"{path} fails verification, {count}: " + "; ".join(problems), problems=problems)
    return problems


def _find_problems(
    path: str | os.PathLike,
    progress: Callable[[int], None] | None,
    storage_options: dict[str, Any] | None = None,
) -> tuple[type[CorruptCheckpointError | IncompleteCheckpointError], list[str]]:
    """(the error that fits, every problem found) for `verify`."""
    try:
        ckpt = open_checkpoint(path, storage_options=storage_options)
    except IncompleteCheckpointError as e:
        return IncompleteCheckpointError, [str(e)]
    except FileNotFoundError as e:
        if e.filename is None:
            raise  # the reader found no checkpoint there: nothing is damaged, nothing to verify
        return CorruptCheckpointError, [f"{path}: {e}"]  # a file the checkpoint needs is gone
    except (OSError, ValueError, pickle.UnpicklingError) as e:  # unreadable metadata or manifest
        return CorruptCheckpointError, [f"{path}: {e}"]
    problems = []
    for key in ckpt.tensor_keys():
        md = ckpt.tensor_metadata(key)
        blocks = [Block(tuple(c.offsets), tuple(c.sizes)) for c in md.chunks]
        found = analyze(list(dict.fromkeys(b for b in blocks if not b.is_empty())), tuple(md.size))
        if found.out_of_bounds or found.overlap or found.hole is not None:
            what = (
                f"chunk {found.out_of_bounds} is out of bounds"
                if found.out_of_bounds
                else f"chunks {found.overlap[0]} and {found.overlap[1]} overlap"
                if found.overlap
                else f"element {found.hole} is in no chunk"
            )
            problems.append(f"'{key}': {what} (shape {tuple(md.size)})")
    if ckpt.manifest is None:
        for key in ckpt.tensor_keys():  # stock: no checksums; check every record reads
            try:
                ckpt.read(key)
            except (OSError, ValueError) as e:
                problems.append(f"'{key}': {e}")
            if progress:
                progress(ckpt.tensor_nbytes(key))
        return CorruptCheckpointError, problems
    metadata = ckpt.folder.where(".metadata")
    try:
        if crc32c.crc32c(ckpt.folder.read(".metadata")) != ckpt.manifest.metadata_crc32c:
            problems.append(
                f"{metadata} does not match the manifest's checksum: damaged, or a save was "
                "interrupted between its two records; stock DCP readers see something else "
                "than shardwise readers"
            )
    except OSError as e:
        problems.append(f"{metadata}: {e}")
    page = ckpt.manifest.page_size
    for key, entry in ckpt.manifest.tensors.items():
        itemsize = dtype_from_name(entry.dtype).itemsize
        for chunk in entry.chunks:
            problems += _verify_chunk(ckpt.folder, key, chunk, itemsize, page, progress)
    for key in ckpt.manifest.objects:
        try:
            ckpt.object_bytes(key)
        except (OSError, CorruptCheckpointError) as e:
            problems.append(str(e))
    return CorruptCheckpointError, problems


def _verify_chunk(
    folder: Folder,
    key: str,
    chunk: ChunkEntry,
    itemsize: int,
    page: int,
    progress: Callable[[int], None] | None,
) -> list[str]:
    path = folder.where(chunk.file)
    where = f"'{key}' chunk at {chunk.offsets}"
    record_start, record_length = chunk.record
    record_end = record_start + record_length
    if chunk.payload is None:  # stored through a transform (e.g. zstd): one checksum over it
        try:
            data = _read(folder, chunk.file, record_length, record_start)
        except OSError as e:
            return [f"{where}: {e}"]
        if progress:
            progress(len(data))
        if len(data) != record_length or crc32c.crc32c(data) != chunk.crcs[0]:
            return [f"{where}: bytes {record_start}..{record_end} of {path} fail their checksum"]
        return []
    start, length = chunk.payload
    try:
        f = folder.open(chunk.file)
        try:
            head = f.pread(start - record_start, record_start)
            tail = f.pread(record_end - start - length, start + length)
            if frame_crc(head, tail) != chunk.frame:
                return [
                    f"{where}: the torch.save record framing in {path} "
                    f"(bytes {record_start}..{record_end}) fails its checksum"
                ]
            if chunk.tile is not None:
                problem = _verify_tiles(f, path, where, chunk, itemsize, progress)
            else:
                problem = _verify_pages(f, path, where, chunk, page, progress)
        finally:
            f.close()
    except OSError as e:
        return [f"{where}: {e}"]
    return [] if problem is None else [problem]


def _read(folder: Folder, name: str, n: int, offset: int) -> bytes:
    f = folder.open(name)
    try:
        return f.pread(n, offset)
    finally:
        f.close()


def _verify_pages(
    f: RandomAccess,
    path: str,
    where: str,
    chunk: ChunkEntry,
    page: int,
    progress: Callable[[int], None] | None,
) -> str | None:
    """Format versions 1 and 2: one crc32c per `page` bytes of the payload."""
    assert chunk.payload is not None
    start, length = chunk.payload
    for i in range(len(chunk.crcs)):
        lo = start + i * page
        data = f.pread(min(page, length - i * page), lo)
        if len(data) != min(page, length - i * page):
            return f"{where}: {path} is truncated at byte {lo + len(data)}"
        if bad_page(data, i * page, page, chunk.crcs) is not None:
            return f"{where}: bytes {lo}..{lo + len(data)} of {path} fail their checksum"
        if progress:
            progress(len(data))
    return None


def _verify_tiles(
    f: RandomAccess,
    path: str,
    where: str,
    chunk: ChunkEntry,
    itemsize: int,
    progress: Callable[[int], None] | None,
) -> str | None:
    """Format version 3: one crc32c per tile. Tiles that follow each other in the
    payload (all those the writer makes) are read `_BLOCK` bytes at a time; a tile
    of any other shape run by run."""
    assert chunk.payload is not None and chunk.tile is not None
    start = chunk.payload[0]
    batch: list[tuple[int, int, int]] = []  # (index, payload offset, length), back to back

    def check_batch() -> str | None:
        if not batch:
            return None
        lo, hi = batch[0][1], batch[-1][1] + batch[-1][2]
        data = memoryview(f.pread(hi - lo, start + lo))
        if len(data) != hi - lo:
            return f"{where}: {path} is truncated at byte {start + lo + len(data)}"
        for index, at, n in batch:
            if crc32c.crc32c(data[at - lo : at - lo + n]) != chunk.crcs[index]:
                return (
                    f"{where}: bytes {start + at}..{start + at + n} of {path} fail their checksum"
                )
        if progress:
            progress(len(data))
        batch.clear()
        return None

    for index, spans in payload_tiles(chunk.sizes, itemsize, chunk.tile):
        if len(spans) == 1:
            at, n = spans[0]
            if batch and (batch[-1][1] + batch[-1][2] != at or at + n - batch[0][1] > _BLOCK):
                problem = check_batch()
                if problem:
                    return problem
            batch.append((index, at, n))
            continue
        problem = check_batch()
        if problem:
            return problem
        crc = 0
        for at, n in spans:
            data = f.pread(n, start + at)
            if len(data) != n:
                return f"{where}: {path} is truncated at byte {start + at + len(data)}"
            crc = crc32c.crc32c(data, crc)
            if progress:
                progress(n)
        if crc != chunk.crcs[index]:
            lo, hi = start + spans[0][0], start + spans[-1][0] + spans[-1][1]
            return f"{where}: bytes {lo}..{hi} of {path} fail their checksum"
    return check_batch()
