"""`verify`: recompute every checksum and check coverage, so damage is found before a load needs it.

One process, no process group, memory bounded by one checksum page; every
problem is listed at once.
"""

from __future__ import annotations

import os
import pickle
from collections.abc import Callable
from pathlib import Path

import crc32c

from ..errors import CorruptCheckpointError, IncompleteCheckpointError
from ..layout import Block
from ..layout.coverage import analyze
from .file_io import bad_page, frame_crc
from .manifest import ChunkEntry
from .offline import open_checkpoint

__all__ = ["verify"]


def verify(
    path: str | os.PathLike,
    progress: Callable[[int], None] | None = None,
    *,
    raise_on_error: bool = True,
) -> list[str]:
    """Check a whole checkpoint; raise, listing every problem found, unless it is sound.

    Recomputes every checksum page (shardwise checkpoints), checks that every
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
    kind, problems = _find_problems(path, progress)
    if problems and raise_on_error:
        count = f"{len(problems)} problem{'s' if len(problems) > 1 else ''}"
        raise kind(f"{path} fails verification, {count}: " + "; ".join(problems), problems=problems)
    return problems


def _find_problems(
    path: str | os.PathLike, progress: Callable[[int], None] | None
) -> tuple[type[CorruptCheckpointError | IncompleteCheckpointError], list[str]]:
    """(the error that fits, every problem found) for `verify`."""
    try:
        ckpt = open_checkpoint(path)
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
    metadata = ckpt.path / ".metadata"
    try:
        if crc32c.crc32c(metadata.read_bytes()) != ckpt.manifest.metadata_crc32c:
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
            problems += _verify_chunk(ckpt.path, key, chunk, page, progress)
    for key in ckpt.manifest.objects:
        try:
            ckpt.object_bytes(key)
        except (OSError, CorruptCheckpointError) as e:
            problems.append(str(e))
    return CorruptCheckpointError, problems


def _verify_chunk(
    folder: Path, key: str, chunk: ChunkEntry, page: int, progress: Callable[[int], None] | None
) -> list[str]:
    path = folder / chunk.file
    where = f"'{key}' chunk at {chunk.offsets}"
    record_start, record_length = chunk.record
    record_end = record_start + record_length
    if chunk.payload is None:  # stored through a transform (e.g. zstd): one checksum over it
        try:
            with open(path, "rb") as f:
                data = os.pread(f.fileno(), record_length, record_start)
        except OSError as e:
            return [f"{where}: {e}"]
        if progress:
            progress(len(data))
        if len(data) != record_length or crc32c.crc32c(data) != chunk.pages[0]:
            return [f"{where}: bytes {record_start}..{record_end} of {path} fail their checksum"]
        return []
    start, length = chunk.payload
    try:
        with open(path, "rb") as f:
            f.seek(record_start)
            head = f.read(start - record_start)
            f.seek(start + length)
            tail = f.read(record_end - start - length)
            if frame_crc(head, tail) != chunk.frame:
                return [
                    f"{where}: the torch.save record framing in {path} "
                    f"(bytes {record_start}..{record_end}) fails its checksum"
                ]
            for i in range(len(chunk.pages)):
                lo = start + i * page
                f.seek(lo)
                data = f.read(min(page, length - i * page))
                if len(data) != min(page, length - i * page):
                    return [f"{where}: {path} is truncated at byte {lo + len(data)}"]
                if bad_page(data, i * page, page, chunk.pages) is not None:
                    return [f"{where}: bytes {lo}..{lo + len(data)} of {path} fail their checksum"]
                if progress:
                    progress(len(data))
    except OSError as e:
        return [f"{where}: {e}"]
    return []
