"""A collective save's records, joined on the committing rank from every owner's part.

Each key's owner writes its share of `.metadata` and of the manifest as a part
file beside the checkpoint (`write_part`); once every part is written (one
agreement) the committing rank copies every part's index block into the save's
index file (a new data file, format version 4 on), then streams the frames and
every part's sections into two temporary files (`join_records`), checksumming as
it goes — on a thread of its own beside the data writes (`engine.joining`) — and
`commit` renames them into place once every rank's data is durable. Its work is
copying bytes: no entry is decoded or encoded, nothing is received over the
network, and its memory holds one section at a time — the
records themselves grow with W × N (1,024 ranks × 1,000 tensors: 300 MB), so
holding or encoding them on one rank would not scale.

A part is named as a temporary of the manifest (`NAME.sw{12 hex}.tmp`, derived
from the save's token and the rank): the commit's collection removes it, and a
dead save's part is collected by the next commit like any leftover of ours.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterable
from typing import Any

import crc32c
from torch.distributed.checkpoint.metadata import StorageMeta

from ...errors import InvalidArgumentError
from ...storage import Folder
from ...storage.folder import RandomAccess, Sink, temporary_name
from ..format.manifest import MANIFEST, METADATA, TAIL, IndexRef, Manifest
from ..format.record_parts import (
    SECTIONS,
    manifest_frame,
    metadata_frame,
    part_spans,
    part_trailer,
)

__all__ = ["join_records", "part_name", "write_part"]


def part_name(token: str, rank: int) -> str:
    """The name of `rank`'s part in the save of `token`."""
    tag = hashlib.blake2b(f"{token}:{rank}".encode(), digest_size=6).hexdigest()
    return f"{MANIFEST}.sw{tag}.tmp"


def write_part(folder: Folder, token: str, rank: int, batches: Iterable[list[bytes]]) -> None:
    """`rank`'s part: each batch's seven sections (`SaveRecords.sections`) as it comes,
    then their lengths (`record_parts.part_trailer`); read once by the committing rank,
    which fails the save if it is not whole; never fsynced (the records made from it
    are). Nothing of it remains if writing fails."""
    sink = folder.create(part_name(token, rank))
    try:
        lengths = []
        for sections in batches:
            assert len(sections) == SECTIONS
            sink.write(sections)
            lengths.append([len(data) for data in sections])
        sink.write([part_trailer(lengths)])
        sink.close(sync=False)
    except BaseException:
        sink.abort()
        raise


class _Crc:
    """A sink that keeps the crc32c of what it was given, and its last `TAIL` bytes."""

    def __init__(self, sink: Sink) -> None:
        self.sink, self.crc, self.size, self.tail = sink, 0, 0, b""

    def write(self, data: bytes) -> None:
        if data:
            self.sink.write([data])
            self.crc = crc32c.crc32c(data, self.crc)
            self.size += len(data)
            self.tail = (self.tail + data[-TAIL:])[-TAIL:]


def join_records(
    folder: Folder,
    world: tuple[int, str],
    token: str,
    storage_meta: StorageMeta,
    frame: Manifest,
    sync: bool,
) -> tuple[str, str]:
    """`.metadata` and the manifest of the save of `token`, from its parts (`world`:
    their number, and the name of the index file to write from their blocks) and
    `frame` (the manifest's fields, no entries), each in a temporary file: their
    names, for `commit`."""
    world_size, index = world
    parts = []
    try:
        for r in range(world_size):
            parts.append(folder.open(part_name(token, r)))
        spans = [part_spans(p.pread, p.size(), p.where) for p in parts]
        _require_plain_planner_data(parts, spans)

        def pour(out: _Crc, pieces: list[bytes], first: int, comma: bool) -> None:
            for hole, piece in enumerate(pieces):
                out.write(piece)
                if hole == len(pieces) - 1:
                    break
                wrote = False
                for p, part in zip(parts, spans):
                    for offset, length in part[first + hole]:
                        out.write(b"," if comma and wrote else b"")
                        _copy(out, p, offset, length)
                        wrote = True

        frame.index = IndexRef(index, _index(folder, index, parts, spans, sync))
        metadata = _written(
            folder, METADATA, sync, lambda out: pour(out, metadata_frame(storage_meta), 0, False)
        )
        frame.metadata_crc32c, frame.metadata_tail = metadata[1]
        pieces = manifest_frame(frame)
        last = pieces[-1]
        assert last.endswith(b"0}")

        def manifest(out: _Crc) -> None:
            pour(out, pieces[:-1] + [b""], 3, True)
            # the seal (`manifest.seal`): the crc32c of the text ending `0}`, in place of the 0
            out.crc = crc32c.crc32c(last, out.crc)
            out.sink.write([last[:-2] + str(out.crc).encode() + b"}"])

        return metadata[0], _written(folder, MANIFEST, sync, manifest)[0]
    finally:
        for p in parts:
            p.close()


# bytes of a part copied at a time: the join holds this much, not a whole section
STEP = 4 << 20


def _copy(out: _Crc, part: RandomAccess, offset: int, length: int) -> None:
    for at in range(offset, offset + length, STEP):
        out.write(part.pread(min(STEP, offset + length - at), at))


def _require_plain_planner_data(parts: list[RandomAccess], spans: list[Any]) -> None:
    """Refuse the one planner data a manifest may read back wrong: a state dict whose
    only key is `__tuple__` (readers that decode tags from the outside in, as
    shardwise did before `planner_data.untag`, take a dict of that one key for a
    tuple). Only a handful of bytes are ever read to tell."""
    pieces = [(p, offset, n) for p, part in zip(parts, spans) for offset, n in part[3]]
    if sum(n for _p, _offset, n in pieces) > 256:  # the manifest's planner data sections
        return
    text = b",".join(p.pread(n, offset) for p, offset, n in pieces)
    if list(json.loads(b"{" + text + b"}")) == ["__tuple__"]:
        raise InvalidArgumentError(
            "cannot save a state dict whose only key is '__tuple__': the manifest's planner "
            "data would read back as a tuple; give it another key as well"
        )


def _index(
    folder: Folder, name: str, parts: list[RandomAccess], spans: list[Any], sync: bool
) -> list[int]:
    """The index file `name` (a new data file) from every part's block: where each
    block starts in it."""
    blocks = []
    sink = folder.create(name)
    out = _Crc(sink)
    try:
        for p, part in zip(parts, spans):
            blocks.append(out.size)
            for offset, length in part[SECTIONS - 1]:
                _copy(out, p, offset, length)
        sink.close(sync=sync)
    except BaseException:
        sink.abort()
        raise
    return blocks


def _written(
    folder: Folder, name: str, sync: bool, fill: Callable[[_Crc], None]
) -> tuple[str, tuple[int, tuple[int, int]]]:
    """A temporary file beside `name` filled by `fill(out)`: its name, crc32c, and size
    with the crc32c of its tail."""
    sink = folder.create(temporary_name(name))
    out = _Crc(sink)
    try:
        fill(out)
        sink.close(sync=sync)
    except BaseException:
        sink.abort()
        raise
    return sink.name, (out.crc, (out.size, crc32c.crc32c(out.tail)))
