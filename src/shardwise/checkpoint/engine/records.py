"""A checkpoint's records: joined on the committing rank and committed by a save;
found and read safely by a load.

Each owner writes its part of the records; the committing rank joins the parts
beside its own writes and commits them. Loads find a checkpoint's records once
(`shardwise.json`, or DCP's `.metadata` alone) and read them within their size
bounds.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import re
import threading
from collections.abc import Callable, Iterable
from typing import Any

import crc32c
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from ...errors import CheckpointNotFoundError, IncompleteCheckpointError, InvalidArgumentError
from ...storage import Folder
from ...storage.folder import TEMPORARY, RandomAccess, Sink, temporary_name
from ..format import (
    LOCK_NAME,
    MANIFEST,
    MARKER,
    METADATA,
    SECTIONS,
    TAIL,
    IndexRef,
    Manifest,
    RecordNames,
    follow_replaced,
    manifest_frame,
    metadata_frame,
    part_spans,
    part_trailer,
    read_stock,
)
from ..io import Lease, commit, leftover_data, per_rank_records
from .plan import SaveRecords, file_name

__all__ = ["Joining", "join_records", "part_name", "read_records", "save_leftovers", "write_part"]


# -----------------------------------------------------------------------------
# A collective save's records, joined on the committing rank from every owner's part.
#
# Each key's owner writes its share of `.metadata` and of the manifest as a part
# file beside the checkpoint (`write_part`); once every part is written (one
# agreement) the committing rank copies every part's index block into the save's
# index file (a new data file, format version 4 on), then streams the frames and
# every part's sections into two temporary files (`join_records`), checksumming as
# it goes — on a thread of its own beside the data writes (`engine.records`) — and
# `commit` renames them into place once every rank's data is durable. Its work is
# copying bytes: no entry is decoded or encoded, nothing is received over the
# network, and its memory holds one section at a time — the
# records themselves grow with W × N (1,024 ranks × 1,000 tensors: 300 MB), so
# holding or encoding them on one rank would not scale.
#
# A part is named as a temporary of the manifest (`NAME.sw{12 hex}.tmp`, derived
# from the save's token and the rank): the commit's collection removes it, and a
# dead save's part is collected by the next commit like any leftover of ours.
# -----------------------------------------------------------------------------


def part_name(token: str, rank: int) -> str:
    """The name of `rank`'s part in the save of `token`."""
    tag = hashlib.blake2b(f"{token}:{rank}".encode(), digest_size=6).hexdigest()
    return f"{MANIFEST}.sw{tag}.tmp"


def write_part(folder: Folder, token: str, rank: int, batches: Iterable[list[bytes]]) -> None:
    """`rank`'s part: each batch's seven sections (`SaveRecords.sections`) as it comes,
    then their lengths (`format.manifest.part_trailer`); read once by the committing rank,
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
    shardwise did before `format.entries.untag`, take a dict of that one key for a
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


# -----------------------------------------------------------------------------
# Rank 0's share of a collective save: the records joined beside its writes, committed.
#
# The join copies every owner's part into `.metadata`, `shardwise.json` and the index
# (`engine.records`): O(W × N) bytes, 155 MiB at 1,024 ranks × 1,000 tensors. Since
# format version 5 the parts follow from the plan and the places alone (the checksums
# stay in the writers' files), so every part is written before any data: the join
# then runs on a thread of its own while every rank writes its data, off the save's
# critical path, and its records are committed only once every rank's data is durable.
# -----------------------------------------------------------------------------


class Joining:
    """Rank 0's join of the records on a thread of its own (`index`: rank 0's next data
    file, known before any data is written), then their commit."""

    def __init__(
        self, path: Folder, world: int, index: str, token: str, meta: StorageMeta, sync: bool
    ) -> None:
        self.path, self.world, self.index, self.token, self.sync = path, world, index, token, sync
        self._out: tuple[str, str] | BaseException | None = None
        self._committing = False  # from then on, the commit owns the records' files
        self._thread = threading.Thread(target=self._run, args=(meta,), name="shardwise-join")
        self._thread.start()

    def _run(self, meta: StorageMeta) -> None:
        try:
            frame = _frame(self.world, meta)
            where = (self.world, self.index)
            self._out = join_records(self.path, where, self.token, meta, frame, self.sync)
        except BaseException as e:  # noqa: BLE001 - given to the committing thread
            self._out = e

    def join(self) -> None:
        self._thread.join()

    def commit(self, most: int, lease: Lease | None) -> BaseException | None:
        """Commit the joined records once every rank's data is durable; the problem.
        `most`: the most data files a rank wrote: every name this save may have written
        is kept by the commit's collection (a superset, from the names alone: never a
        listing, which a shared file system may show late), and so is every part: each
        owner removes its own once the save is committed."""
        self._committing = True
        try:
            self.join()
            if isinstance(self._out, BaseException):
                raise self._out
            assert self._out is not None
            metadata, manifest = self._out
            keep = {file_name(r, k, self.token) for r in range(self.world) for k in range(most)}
            keep.add(self.index)
            keep |= {part_name(self.token, r) for r in range(self.world)}  # their owners
            commit(self.path, metadata, manifest, keep, RecordNames(), sync=self.sync, lease=lease)
        except Exception as e:  # noqa: BLE001 - the other ranks wait for the verdict
            return e
        return None

    def discard(self) -> None:
        """A failed save's: every rank's part and, unless the commit began (it may have
        made them visible), what the join wrote, removed (this save wrote them: their
        names say so). Best effort: the next commit's collection removes what is left."""
        self.join()
        names = [part_name(self.token, r) for r in range(self.world)]
        if not self._committing:
            names += [self.index, *(self._out if isinstance(self._out, tuple) else ())]
        for name in names:
            with contextlib.suppress(Exception):  # absent (never written), or gone already
                self.path.remove(name)


def _frame(world: int, meta: StorageMeta) -> Manifest:
    """The manifest's fields but its entries and planner data (`engine.records`)."""
    frame = SaveRecords(world, meta, {}).draft()
    frame.set_planner_data({})
    return frame


# -----------------------------------------------------------------------------
# A checkpoint's records, found once and read safely: `shardwise.json`, or DCP's
# `.metadata` where it is current (see `read_records`).
# -----------------------------------------------------------------------------

# The records a save writes under a temporary name first (`NAME.sw{12 hex}.tmp`): its
# parts and joined records (`shardwise.json`), `.metadata`, the marker, per-rank ones.
_RECORD = re.compile(r"(?:__\d+)?\.metadata|(?:__\d+\.)?shardwise\.json|\.shardwise", re.ASCII)


def save_leftovers(names: Iterable[str]) -> list[str]:
    """Of `names`, what a save leaves before its first data file: its lease's lock
    record, and temporary names of its records or lock."""
    found = []
    for name in sorted(names):
        temporary = TEMPORARY.fullmatch(name)
        base = name if temporary is None else temporary.group(1)
        if LOCK_NAME.fullmatch(base) or (temporary is not None and _RECORD.fullmatch(base)):
            found.append(name)
    return found


def read_records(
    folder: Folder,
    rank: int | None = None,
    *,
    whole: bool = False,
    listing: dict[str, int] | None = None,
    settled: bool = True,
) -> tuple[Manifest | None, Metadata | None]:
    """(the manifest, None) for a shardwise checkpoint whose manifest is current, else
    (None, DCP's metadata), read safely and checked; `rank`: that rank's own records.
    A version 4 manifest comes without its chunks (a load reads the sections it needs)
    unless `whole` (then, not `settled`, without the checksums writers keep in data
    files: `Manifest.resolve`). `listing`: the folder's files and sizes, listed once
    by the caller (on an object store each listing is a request, by every rank of a
    load).
    Raises `CheckpointNotFoundError` where there is no checkpoint (also where only
    per-rank records are: what `dcp.load` expects before it retries per rank) and
    `IncompleteCheckpointError` where a save never committed (SPEC §3): its data, or
    before any, its lease or temporary records are there (`save_leftovers`)."""
    names = RecordNames(rank)
    listing = folder.sizes() if listing is None else listing
    present = set(listing)  # plain files only
    if names.manifest not in present:  # every name: a record that is a link is refused by it
        present = set(folder.names())
    if names.manifest in present:
        manifest = Manifest.read_head(folder, names.manifest, listing)
        replaced = manifest.stale(folder, names.metadata, listing)
        if replaced is None:
            if manifest.index is None or whole:  # before version 4: every chunk, checked
                manifest.resolve(folder, names.manifest, settled)
            return manifest, None
        # what stock readers see now: never the data it replaced
        manifest.resolve(folder, names.manifest)  # the files it names, to refuse them
        return None, follow_replaced(
            folder, names.metadata, replaced, manifest.data_files(), holes=rank is not None
        )
    if rank is None and MARKER in present:
        raise IncompleteCheckpointError(
            f"{folder} is a shardwise checkpoint without its {names.manifest}: "
            "the save did not commit"
        )
    if names.metadata in present:
        return None, read_stock(folder, names.metadata, holes=rank is not None, listing=listing)
    if rank is None and per_rank_records(folder):
        raise CheckpointNotFoundError(
            f"{folder} holds per-rank checkpoint records only "
            "(saved with use_collectives=False): read them with read_metadata(rank=...)"
        )
    if rank is None and leftover_data(folder):
        raise IncompleteCheckpointError(
            f"a save to {folder} started but never committed ({leftover_data(folder)[0]} is left)"
        )
    if rank is None and (left := save_leftovers(present)):
        raise IncompleteCheckpointError(
            f"a save to {folder} started but never committed: it holds {', '.join(left[:4])}"
            f"{f' and {len(left) - 4} more' if len(left) > 4 else ''} (the lease or unfinished "
            "records of a save still running, or killed before its first data file) and no "
            "checkpoint; wait for that save, or save again"
        )
    raise CheckpointNotFoundError(f"no checkpoint at {folder}")
