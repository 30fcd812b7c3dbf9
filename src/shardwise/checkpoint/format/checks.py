"""What a checkpoint's records claim, checked before anything is opened or allocated.

One validator per invariant: record names stay inside their folder, sizes are
bounded before a byte is read, and the chunks a record claims for a tensor are
in bounds and cover it exactly.
"""

from __future__ import annotations

import io
import math
import re
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import DEFAULT_SUFFIX
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)

from ...errors import CorruptCheckpointError, LayoutError, UnsafeMetadataError
from ...layout import Block
from ...layout.coverage import analyze
from ...storage import Folder
from ...storage.folder import TEMPORARY
from .checksums import tile_count, valid_tile
from .entries import MANIFEST, ChunkEntry
from .pickles import load_metadata

__all__ = [
    "GLOBAL_RECORDS",
    "LOCK",
    "LOCK_NAME",
    "METADATA",
    "RecordNames",
    "lock_name",
    "DATA_FILE",
    "check_coverage",
    "check_metadata",
    "check_name",
    "check_ranges",
    "checked_ints",
    "chunk_consistent",
    "follow_replaced",
    "name_problem",
    "read_stock",
    "record_limit",
]


# -----------------------------------------------------------------------------
# The chunks a record claims for a tensor: in bounds, and covering it exactly.
#
# Checked before anything is read or allocated (see `format.checks`): every chunk
# has its tensor's ndim and lies in bounds, and the distinct chunks cover it
# exactly (no partial overlap, no hole: nothing a reader returns was left
# unfilled), in O(n log n) (`layout.coverage`).
# -----------------------------------------------------------------------------

_LIMIT = 1 << 62  # no real offset, size or length comes near it: int64 arithmetic stays exact

_INT = {int}  # the only type a number in a record may have (`bool` is refused)


def checked_ints(values: Any, what: str, key: str, record: str) -> tuple[int, ...]:
    try:
        out = tuple(values)
    except TypeError:
        out = (values,)
    if not all(type(v) is int and 0 <= v < _LIMIT for v in out):
        raise CorruptCheckpointError(f"{record}: '{key}' has an invalid {what} {values!r}")
    return out


def _whole(shape: Any, offsets: Any, sizes: Any) -> bool:
    """Whether one chunk at `offsets` of `sizes` is all of `shape`, every number valid."""
    try:
        return (
            tuple(sizes) == tuple(shape)
            and set(map(type, shape)) <= _INT
            and (not shape or 0 <= min(shape) and max(shape) < _LIMIT)
            and len(offsets) == len(shape)
            and set(map(type, offsets)) <= _INT
            and not any(offsets)
        )
    except TypeError:
        return False


def check_coverage(
    key: str,
    shape: Sequence[int],
    chunks: Sequence[tuple[tuple[int, ...], tuple[int, ...]]],
    record: str,
    *,
    replicas: bool = True,
    holes: bool = False,
) -> None:
    """The chunks `(offsets, sizes)` of tensor `key` have its ndim, lie in bounds and
    cover it exactly: no partial overlap, no element left out (unless `engine.plan`: a
    per-rank record holds its rank's chunks only). Exact duplicates count as
    replicas unless `replicas` is False (a manifest stores each once)."""
    if len(chunks) == 1 and _whole(shape, *chunks[0]):
        return  # the common case: one chunk holding the whole tensor
    shape = checked_ints(shape, "shape", key, record)
    ndim = len(shape)
    distinct: dict[tuple[int, ...], tuple[int, ...]] = {}
    for offsets, sizes in chunks:
        offsets = checked_ints(offsets, "chunk offset", key, record)
        sizes = checked_ints(sizes, "chunk size", key, record)
        if len(offsets) != ndim or len(sizes) != ndim:
            raise CorruptCheckpointError(
                f"{record}: chunk at offsets {offsets} of '{key}' has {len(sizes)} dimensions, "
                f"the tensor {ndim} (shape {shape})"
            )
        if any(o + s > n for o, s, n in zip(offsets, sizes, shape)):
            raise CorruptCheckpointError(
                f"{record}: chunk at offsets {offsets} sizes {sizes} of '{key}' lies outside "
                f"its shape {shape}"
            )
        seen = distinct.get(offsets)
        distinct[offsets] = sizes
        if seen is not None and (seen != sizes or not replicas):
            raise CorruptCheckpointError(
                f"{record}: '{key}' has two chunks at offsets {offsets} (sizes {seen} and "
                f"{sizes}): damaged or crafted"
            )
    blocks = [(o, s) for o, s in distinct.items() if all(s)]
    problem = _tiles(blocks, shape, holes)
    if problem is None:
        return
    raise CorruptCheckpointError(
        f"{record}: the chunks of '{key}' (shape {shape}) {problem}: damaged or crafted; "
        "refused (nothing a chunk does not hold is ever returned)"
    )


def _tiles(
    blocks: list[tuple[tuple[int, ...], tuple[int, ...]]], shape: tuple[int, ...], holes: bool
) -> str | None:
    """Why non-empty distinct `blocks` fail to tile `shape` exactly, or with `engine.plan`
    overlap (None: they do not).
    The common layouts (one whole chunk, a cut along one dimension) are checked
    directly; anything else by `layout.coverage.analyze`."""
    total = math.prod(shape)
    if total == 0:
        return None  # nothing to cover, and a non-empty block of an empty tensor is out of bounds
    if (len(blocks) == 1 and [s for _o, s in blocks] == [shape]) or (holes and len(blocks) <= 1):
        return None
    cut = {d for _, s in blocks for d in range(len(shape)) if s[d] != shape[d]}
    if len(cut) == 1:
        (d,) = cut
        spans = sorted((o[d], o[d] + s[d]) for o, s in blocks)
        at = 0
        for start, end in spans:
            if start > at and not holes:
                return f"leave elements {at}..{start} of dimension {d} in no chunk"
            if start < at:
                return f"overlap in part at {start} along dimension {d}"
            at = end
        if at == shape[d] or holes:
            return None
        return f"leave elements {at}.. of dimension {d} in no chunk"
    try:
        found = analyze([Block(o, s) for o, s in blocks], shape)
    except (LayoutError, OverflowError, RuntimeError) as e:
        return f"cannot be analysed ({e})"
    if found.overlap is not None:
        a, b = found.overlap
        return f"overlap in part: {a} and {b}"
    if found.hole is not None and not holes:
        return f"leave element {found.hole} in no chunk"
    return None


# -----------------------------------------------------------------------------
# What a checkpoint's records claim, checked before anything is opened or allocated.
#
# A checkpoint folder is untrusted input: downloaded, shared, copied between
# clusters, or crafted. Its records (`shardwise.json`, a stock `.metadata`
# pickle, per-rank records) name files, byte ranges and shapes, and every
# reader trusts those only once this module passed them:
#
# * every file named is a plain file directly inside the folder: no `..`, no
#   absolute path, no separator, none of the checkpoint's own records or
#   lock and temporary files, and in a manifest only shardwise's data files
#   (`__{rank}_{k}.sw{token}.distcp`); links are refused where they are opened;
# * every byte range lies inside its file, and ranges of one file never
#   overlap (so no chunk claims more bytes than the files hold);
# * every chunk has its tensor's ndim and lies in bounds; the distinct chunks
#   of a tensor cover it exactly (`format.checks`);
# * a stock chunk's record is at least as long as the chunk's elements;
# * a record read whole (a manifest, a `.metadata`, an index section) holds at
#   most `record_limit` bytes, checked before anything is allocated for it.
#
# Anything else a tampered record holds (a wrong type, an absurd number) is a
# `CorruptCheckpointError` naming the entry and the file.
# -----------------------------------------------------------------------------

# What a record read whole may hold (`record_limit`): a fixed floor, plus a multiple of
# the folder's other bytes. Legitimate records stay far below it (a version 5 manifest
# is ~100 bytes a tensor, `.metadata` ~300 bytes a chunk, each chunk's record in a
# data file over 1 KiB), and a crafted size (a sparse file of 8 GiB costs no disk)
# is refused before it is read.
RECORD_FLOOR = 64 << 20

RECORD_FACTOR = 16

# Names a record never gives to a data file: the records, the marker, their
# temporary names, lock files. A record naming one of them is crafted or damaged,
# and trusting it would let a later overwrite delete the checkpoint's own records.
_RECORDS = re.compile(
    r"\.metadata|shardwise\.json|\.shardwise|__\d+\.metadata|__\d+\.shardwise\.json|.*\.lock"
)

# What `commit.data_file_name` makes: `__{rank}_{k}.sw{token}.distcp`, matched with
# fullmatch (a trailing newline is not ours); ASCII, since `\d` alone also matches other
# scripts' digits (`__٣_0...`), never names we write.
DATA_FILE = re.compile(r"__(\d+)_(\d+)\.sw([0-9a-f]{12})" + re.escape(DEFAULT_SUFFIX), re.ASCII)

METADATA = ".metadata"  # DCP's record, beside the manifest

# The lock record of a save lease (`io.lease`): named here with the records it guards.
LOCK = ".shardwise.lock"

LOCK_NAME = re.compile(r"(?:__(\d+))?" + re.escape(LOCK), re.ASCII)


def lock_name(rank: int | None) -> str:
    """The lock record of the global records (`rank` None) or of one rank's."""
    return LOCK if rank is None else f"__{rank}{LOCK}"


@dataclass(frozen=True)
class RecordNames:
    """The commit records of one checkpoint: the global ones, or one rank's
    when DCP saves without collectives (`__{rank}.metadata`)."""

    rank: int | None = None

    @property
    def metadata(self) -> str:
        return METADATA if self.rank is None else f"__{self.rank}{METADATA}"

    @property
    def manifest(self) -> str:
        return MANIFEST if self.rank is None else f"__{self.rank}.{MANIFEST}"

    @property
    def lock(self) -> str:
        """The lease's lock record of this scope (`io.lease`): never a checkpoint record."""
        return lock_name(self.rank)

    def owns(self, data_name: str) -> bool:
        """Whether a token-named data file is in this record's scope (all ranks, or its rank)."""
        m = DATA_FILE.fullmatch(data_name)
        return m is not None and (self.rank is None or int(m.group(1)) == self.rank)


GLOBAL_RECORDS = RecordNames()  # the global records: `.metadata`, `shardwise.json`


def record_limit(listing: Mapping[str, int], name: str) -> int:
    """The most bytes the record `name` of a folder whose plain files and sizes are
    `listing` may hold: `RECORD_FLOOR` plus `RECORD_FACTOR` times the bytes of every
    other file of the listing (the data it describes). What a record costs to read
    follows what is stored, never what the record's own size says."""
    return RECORD_FLOOR + RECORD_FACTOR * (sum(listing.values()) - listing.get(name, 0))


def name_problem(name: Any, *, shardwise: bool) -> str | None:
    """Why a record may not name `name` as a data file (None: it may)."""
    if not isinstance(name, str):
        return f"is a {type(name).__name__}, not a file name"
    if name in ("", ".", "..") or "/" in name or "\\" in name or "\0" in name:
        return "is not a file directly inside the checkpoint folder (a path out of it)"
    if not name.isprintable():  # a newline, escape or control character: never a name we wrote
        return "holds a non-printable character (a newline, an escape or a control code)"
    if _RECORDS.fullmatch(name) or TEMPORARY.fullmatch(name):
        return "is one of the checkpoint's own records, not a data file"
    if shardwise and not DATA_FILE.fullmatch(name):
        return "is not a shardwise data file (__<rank>_<k>.sw<token>.distcp)"
    return None


def check_name(folder: Folder, key: str, name: Any, record: str, *, shardwise: bool) -> None:
    """Refuse a data file name that `name_problem` refuses, naming the entry and the path."""
    problem = name_problem(name, shardwise=shardwise)
    if problem is not None:
        raise CorruptCheckpointError(
            f"{record}: '{key}' names the file {name!r} in {folder}, which {problem}: "
            "the checkpoint is damaged or crafted; refused, nothing read"
        )


def check_ranges(
    folder: Folder, ranges: Iterable[tuple[str, str, int, int]], sizes: dict[str, int]
) -> None:
    """Every `(key, file, offset, length)` lies inside `file`, a plain file of the
    folder's listing `sizes`, and no two non-empty ranges of one file overlap."""
    by_file: dict[str, list[tuple[int, int, str]]] = defaultdict(list)
    for key, name, offset, length in ranges:
        size = sizes.get(name)
        if size is None:
            raise CorruptCheckpointError(
                f"'{key}': data file {folder.where(name)} is missing or not a plain file "
                "(links and folders are refused)"
            )
        if offset + length > size:
            raise CorruptCheckpointError(
                f"'{key}': bytes {offset}..{offset + length} lie past the end of "
                f"{folder.where(name)} ({size} bytes): truncated or damaged"
            )
        if length:
            by_file[name].append((offset, offset + length, key))
    for name, spans in by_file.items():
        spans.sort()
        for (_, end, first), (start, _, second) in zip(spans, spans[1:]):
            if start < end:
                raise CorruptCheckpointError(
                    f"'{second}' and '{first}' claim overlapping bytes of "
                    f"{folder.where(name)} (at {start}): damaged or crafted records"
                )


def check_metadata(metadata: Any, folder: Folder, record: str, *, holes: bool = False) -> None:
    """A stock `Metadata` (unpickled with the safe unpickler) is sound enough to read
    from: see the module docstring. Its data files may have any plain name that is
    not one of the checkpoint's records. `engine.plan`: a per-rank record (its rank's
    chunks only)."""
    if not isinstance(metadata, Metadata):
        raise CorruptCheckpointError(
            f"{record} holds a {type(metadata).__name__}, not DCP checkpoint metadata"
        )
    state = metadata.state_dict_metadata
    storage = metadata.storage_data if metadata.storage_data is not None else {}
    if not isinstance(state, dict) or not isinstance(storage, dict):
        raise CorruptCheckpointError(f"{record}: malformed checkpoint metadata")
    ranges: list[tuple[str, str, int, int]] = []

    def stored(key: str, index: MetadataIndex) -> Any:
        info = storage.get(index)
        if info is None:
            raise CorruptCheckpointError(
                f"{record}: '{key}' (at {index.offset}) has no storage entry: damaged metadata"
            )
        name: str = getattr(info, "relative_path", None)  # type: ignore[assignment]
        check_name(folder, key, name, record, shardwise=False)  # a str once it passes
        offset, length = getattr(info, "offset", None), getattr(info, "length", None)
        if not (type(offset) is int and type(length) is int and 0 <= offset and 0 <= length):
            raise CorruptCheckpointError(
                f"{record}: '{key}' has an invalid byte range {offset!r}, {length!r} "
                f"in {folder.where(name)}"
            )
        ranges.append((key, name, offset, length))
        return info

    for key, md in state.items():
        if not isinstance(key, str):
            raise CorruptCheckpointError(f"{record}: a key of type {type(key).__name__}")
        if isinstance(md, BytesStorageMetadata):
            stored(key, MetadataIndex(key))
            continue
        if not isinstance(md, TensorStorageMetadata):
            raise CorruptCheckpointError(
                f"{record}: '{key}' is described by a {type(md).__name__}, not DCP's metadata"
            )
        dtype = getattr(md.properties, "dtype", None)
        if not isinstance(dtype, torch.dtype) or not isinstance(md.chunks, list):
            raise CorruptCheckpointError(f"{record}: '{key}' has malformed tensor metadata")
        chunks = []
        for c in md.chunks:
            offsets = checked_ints(getattr(c, "offsets", None), "chunk offset", key, record)
            sizes = checked_ints(getattr(c, "sizes", None), "chunk size", key, record)
            chunks.append((offsets, sizes))
        check_coverage(key, md.size, chunks, record, holes=holes)
        for offsets, sizes in dict(chunks).items():
            info = stored(key, MetadataIndex(key, offsets))
            nbytes = math.prod(sizes) * dtype.itemsize
            if not info.transform_descriptors and info.length < nbytes:
                raise CorruptCheckpointError(
                    f"{record}: '{key}' chunk at {offsets} claims {nbytes} bytes of elements "
                    f"in a record of {info.length} bytes of {folder.where(info.relative_path)}"
                )
    check_ranges(folder, ranges, folder.sizes())


def read_stock(
    folder: Folder,
    name: str,
    data: bytes | None = None,
    *,
    holes: bool = False,
    listing: Mapping[str, int] | None = None,
) -> Metadata:
    """DCP's record `name` (its bytes `data` when already read; else read, at most
    `record_limit` bytes of it, `listing` the folder's files when listed already):
    unpickled with the safe unpickler (`UnsafeMetadataError` when refused or
    unreadable; `CorruptCheckpointError` when an object it builds is not what DCP's
    class holds), then checked (`CorruptCheckpointError`)."""
    if data is None:
        listing = folder.sizes() if listing is None else listing
        data = folder.read(name, record_limit(listing, name))
    try:
        metadata = load_metadata(io.BytesIO(data), folder.where(name))
    except UnsafeMetadataError as e:
        raise UnsafeMetadataError(f"{folder.where(name)}: {e}") from e
    check_metadata(metadata, folder, folder.where(name), holes=holes)
    return metadata


def follow_replaced(
    folder: Folder, name: str, data: bytes, manifest_files: set[str], *, holes: bool = False
) -> Metadata:
    """DCP's record `name` (bytes `data`) that no longer matches the manifest beside it:
    stock `dcp.save` replaced the checkpoint in place (or a save died between its two
    records), so stock readers see it; so do we. Refused when unreadable, or when it
    names exactly the manifest's own data files (then it is the same checkpoint's record,
    damaged, not a replacement)."""
    where = folder.where(name)
    try:
        metadata = read_stock(folder, name, data, holes=holes)
    except (CorruptCheckpointError, UnsafeMetadataError) as e:
        raise CorruptCheckpointError(
            f"{where} does not match the manifest beside it (a checksum mismatch) and "
            f"cannot be read: {e}"
        ) from e
    named = {getattr(i, "relative_path", None) for i in (metadata.storage_data or {}).values()}
    if named and named == manifest_files:
        raise CorruptCheckpointError(
            f"{where} fails the manifest's checksum but names the same data files: it is "
            "damaged (restore it, or save the checkpoint again)"
        )
    return metadata


def chunk_consistent(c: ChunkEntry, itemsize: int, version: int, page_size: int) -> bool:
    """The byte ranges and checksums of a chunk fit each other and its size."""
    if c.payload is None:  # transformed: one checksum over the stored record
        return bool(c.transform) and c.tile is None and len(c.crcs) == 1
    nbytes = math.prod(c.sizes) * itemsize
    if not (
        c.payload[1] == nbytes
        and c.record[0] <= c.payload[0] <= c.payload[0] + c.payload[1] <= sum(c.record)
    ):
        return False
    if version <= 2:  # pages: at least one (an empty payload has one empty page)
        return len(c.crcs) == max(1, -(-nbytes // page_size))
    if c.tile is None:  # no checksums at all: only a transformed chunk has no tiles
        return False
    if c.tile == c.sizes:  # one tile, the common case for small chunks
        return len(c.crcs) == 1
    return valid_tile(c.sizes, c.tile) and len(c.crcs) == tile_count(c.sizes, c.tile)
