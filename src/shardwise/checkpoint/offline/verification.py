"""`verify`: recompute every checksum and check coverage, so damage is found before a load needs it.

One process, no process group, memory bounded by a few MiB (whole checksum
tiles, or pages in older checkpoints); every problem is listed at once.
"""

from __future__ import annotations

import math
import os
import pickle
from collections.abc import Callable, Iterator
from typing import Any

import crc32c
import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo

from ...errors import CorruptCheckpointError, IncompleteCheckpointError
from ...layout import Block
from ...layout.coverage import analyze
from ...storage import Folder
from ..format import ChunkEntry, StoredChunk, dtype_from_name, frame_crc
from ..io import ArchiveRead, ChunkRead, ReadExecutor
from .opening import open_checkpoint

_BLOCK = 4 << 20  # whole tiles (or pages) are read and checked this many bytes at a time

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

    A stock DCP checkpoint has no checksums: its structure is checked (coverage,
    every data file as long as `.metadata` says, as opening it checks, every tensor
    record readable), its data cannot be (a flipped byte passes; `shardwise verify`
    says so).

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
        if _crc_of(ckpt.folder, ".metadata") != ckpt.manifest.metadata_crc32c:
            problems.append(
                f"{metadata} does not match the manifest's checksum: damaged, or a save was "
                "interrupted between its two records; stock DCP readers see something else "
                "than shardwise readers"
            )
    except OSError as e:
        problems.append(f"{metadata}: {e}")
    page = ckpt.manifest.page_size
    for key, entry in ckpt.manifest.tensors.items():
        for chunk in entry.chunks:
            problems += _verify_chunk(ckpt.folder, key, chunk, entry.dtype, page, progress)
    for key in ckpt.manifest.objects:
        try:
            ckpt.object_bytes(key)
        except (OSError, CorruptCheckpointError) as e:
            problems.append(str(e))
    return CorruptCheckpointError, problems


def _crc_of(folder: Folder, name: str) -> int:
    """The crc32c of the file `name`, read `_BLOCK` bytes at a time: never whole, so
    verify's memory stays bounded whatever size the file has."""
    file = folder.open(name)
    try:
        crc, at, size = 0, 0, file.size()
        while at < size:
            data = file.pread(min(_BLOCK, size - at), at)
            if not data:  # cut short since its size was taken: its crc32c will not match
                break
            crc, at = crc32c.crc32c(data, crc), at + len(data)
        return crc
    finally:
        file.close()


def _verify_chunk(
    folder: Folder,
    key: str,
    chunk: ChunkEntry,
    dtype: str,
    page: int,
    progress: Callable[[int], None] | None,
) -> list[str]:
    """A chunk's problem, if any: its record framing, then every checksum tile (or page)
    of its payload, read and checked by the read executor as a load reads and checks
    them (`io.chunks`), `_BLOCK` bytes at a time."""
    where = f"'{key}' chunk at {chunk.offsets}"
    info = StoredChunk.of(chunk, dtype, page)
    reader = ReadExecutor(folder)
    try:
        if chunk.payload is None:  # stored through a transform (e.g. zstd): one checksum over it
            reader.run([ArchiveRead(key, info, _counted(progress), decode=False)])
            return []
        (start, length), (record_start, record_length) = chunk.payload, chunk.record
        frames: list[bytes] = []
        reader.run(
            [
                ArchiveRead(key, _StorageInfo(chunk.file, at, n), frames.append, decode=False)
                for at, n in (
                    (record_start, start - record_start),
                    (start + length, record_start + record_length - start - length),
                )
            ]
        )
        if frame_crc(*frames) != chunk.frame:
            return [
                f"{where}: the torch.save record framing in {folder.where(chunk.file)} "
                f"(bytes {record_start}..{record_start + record_length}) fails its checksum"
            ]
        reader.run(_payload_reads(key, info, progress))
    except (OSError, ValueError) as e:
        own = f"'{key}': "  # the read path's wording names the key: `where` does here
        return [f"{where}: {str(e).removeprefix(own)}"]
    return []


def _payload_reads(
    key: str, info: StoredChunk, progress: Callable[[int], None] | None
) -> list[ChunkRead | ArchiveRead]:
    """Reads of a chunk's whole payload in boxes of whole tiles (or, paged, of whole
    pages of its bytes) of at most `_BLOCK` bytes each (or one tile), into scratch."""
    assert info.payload is not None
    shape: tuple[int, ...]
    boxes: list[tuple[tuple[int, ...], tuple[int, ...]]]
    if info.tile is None:  # pages: the payload as bytes, cut at page boundaries
        n, step = info.payload[1], max(info.page_size, _BLOCK // info.page_size * info.page_size)
        shape, dtype = (n,), torch.uint8
        boxes = [((at,), (min(step, n - at),)) for at in range(0, n, step)] or [((0,), (0,))]
    else:
        shape, dtype = info.sizes, dtype_from_name(info.dtype)
        boxes = list(_tile_boxes(shape, info.tile, dtype.itemsize))
    return [
        ChunkRead(key, info, shape, dtype, at, sizes, _scratch(sizes, dtype), _counted(progress))
        for at, sizes in boxes
    ]


def _tile_boxes(
    shape: tuple[int, ...], tile: tuple[int, ...], itemsize: int
) -> Iterator[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Boxes of whole tiles covering a chunk in C order, each at most `_BLOCK` bytes or
    one tile: whole trailing dimensions where they fit, else split tile by tile."""

    def walk(d: int, at: tuple[int, ...], sizes: tuple[int, ...]) -> Iterator[Any]:
        rest = math.prod(shape[d + 1 :]) * math.prod(sizes) * itemsize
        step = max(tile[d], 1)
        if step * rest <= _BLOCK or d == len(shape) - 1:
            step = max(step, _BLOCK // max(rest, 1) // step * step)
            for lo in range(0, shape[d], step):
                yield (
                    at + (lo,) + (0,) * len(shape[d + 1 :]),
                    (sizes + (min(step, shape[d] - lo),) + shape[d + 1 :]),
                )
            return
        for lo in range(0, shape[d], step):
            yield from walk(d + 1, at + (lo,), sizes + (min(step, shape[d] - lo),))

    if not shape or not math.prod(shape):
        yield (0,) * len(shape), shape
        return
    yield from walk(0, (), ())


def _scratch(sizes: tuple[int, ...], dtype: torch.dtype) -> Callable[[], torch.Tensor]:
    return lambda: torch.empty(sizes, dtype=dtype)


def _counted(progress: Callable[[int], None] | None) -> Callable[[Any], None]:
    def done(value: Any) -> None:
        if progress:
            progress(value.nbytes if isinstance(value, torch.Tensor) else len(value))

    return done
