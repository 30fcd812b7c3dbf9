"""The manifest, `shardwise.json`: one checkpoint's description, read and written.

`Manifest`, built from its entries; DCP's view of it (the `Metadata` stock
readers and `Reader` plan from); the parts different ranks encode and the
committing rank assembles; and the pause of cyclic garbage collection around
bulk object creation, which every manifest parse needs.
"""

from __future__ import annotations

import gc
import io
import json
import operator
import os
import pickle
import struct
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import crc32c
import torch
from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION, _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from ...errors import CorruptCheckpointError, InvalidArgumentError
from ...storage import Folder, open_folder
from .checks import (
    METADATA,
    check_coverage,
    check_name,
    check_ranges,
    chunk_consistent,
    record_limit,
)
from .entries import (
    FORMAT,
    INLINE,
    MANIFEST,
    PAGE_SIZE,
    READS,
    TOP,
    VERSION,
    ChunkEntry,
    Field,
    FieldError,
    IndexRef,
    ObjectEntry,
    TensorEntry,
    decode,
    dtype_from_name,
    dtype_name,
    encode,
    encode_planner_data,
    parse,
    pickled,
    unpickled,
)
from .index import Unsettled, resolve_sections, write_sections

__all__ = [
    "ChunkEntry",
    "FORMAT",
    "IndexRef",
    "MANIFEST",
    "MARKER",
    "Manifest",
    "ObjectEntry",
    "PAGE_SIZE",
    "READS",
    "SECTIONS",
    "StoredChunk",
    "StoredObject",
    "TRAILER",
    "TensorEntry",
    "VERSION",
    "dtype_from_name",
    "dtype_name",
    "gc_paused",
    "manifest_frame",
    "manifest_sections",
    "metadata_frame",
    "metadata_of",
    "metadata_sections",
    "part_spans",
    "part_trailer",
    "pickled_items",
    "seal",
    "tail_of",
]


# -----------------------------------------------------------------------------
# DCP's view of a manifest: the `Metadata` stock readers and `Reader` plan from.
#
# `metadata_of` builds it from the manifest alone (nothing unpickled), with a
# `StoredChunk` per chunk carrying what ranged, verified reads need, so a
# reader's byte ranges always come from the metadata it was set up with.
# -----------------------------------------------------------------------------


@dataclass
class StoredChunk(_StorageInfo):
    """DCP's per-chunk storage info plus what ranged, verified reads need.

    It is what `Manifest.to_metadata` puts in `Metadata.storage_data`, so a
    reader's byte ranges always come from the metadata it was set up with.
    `crcs` are those of the tiles of shape `tile` (format version 3), else of
    pages of `page_size` (versions 1 and 2), else (no payload) one of the record."""

    dtype: str = ""
    sizes: tuple[int, ...] = ()
    payload: tuple[int, int] | None = None
    crcs: list[int] | None = None
    page_size: int = PAGE_SIZE
    tile: tuple[int, ...] | None = None

    @classmethod
    def of(cls, chunk: ChunkEntry, dtype: str, page_size: int = PAGE_SIZE) -> StoredChunk:
        """The storage info of a manifest chunk of a tensor of `dtype` (its name)."""
        return cls(
            chunk.file,
            chunk.record[0],
            chunk.record[1],
            chunk.transform,
            dtype,
            chunk.sizes,
            chunk.payload,
            chunk.crcs,
            page_size,
            chunk.tile,
        )


@dataclass
class StoredObject(_StorageInfo):
    """DCP's storage info of a pickled object plus its checksum."""

    crc32c: int | None = None


def metadata_of(manifest: Manifest) -> Metadata:
    """The DCP `Metadata` `manifest` describes, built without unpickling."""
    state: dict[str, Any] = {}
    storage: dict[MetadataIndex, _StorageInfo] = {}
    for k, t in manifest.tensors.items():
        state[k] = TensorStorageMetadata(
            properties=TensorProperties(
                dtype=dtype_from_name(t.dtype), requires_grad=t.requires_grad
            ),
            size=torch.Size(t.shape),
            chunks=[
                ChunkStorageMetadata(torch.Size(c.offsets), torch.Size(c.sizes)) for c in t.chunks
            ],
        )
        for c in t.chunks:
            storage[MetadataIndex(k, c.offsets)] = StoredChunk.of(c, t.dtype, manifest.page_size)
    for k, o in manifest.objects.items():
        state[k] = BytesStorageMetadata()
        storage[MetadataIndex(k)] = StoredObject(o.file, o.offset, o.length, o.transform, o.crc32c)
    meta = manifest.storage_meta
    return Metadata(
        state_dict_metadata=state,
        planner_data=manifest.decoded_planner_data(),
        storage_data=storage,
        storage_meta=StorageMeta(
            # a Path, as FileSystemWriter pickles it (its init_path makes one)
            checkpoint_id=None
            if meta.get("checkpoint_id") is None
            else Path(meta["checkpoint_id"]),
            save_id=meta.get("save_id"),
            modules=list(meta.get("modules") or []),
        ),
        version=manifest.dcp_version,
    )


# -----------------------------------------------------------------------------
# Cyclic garbage collection paused around bulk object creation.
#
# A save or load of 100,000 tensors creates millions of small containers and no
# cycles; each of the hundreds of collections they would trigger walks every
# one of them (it tripled the time to parse 100,000 chunks).
# -----------------------------------------------------------------------------


@contextmanager
def gc_paused() -> Iterator[None]:
    """No cyclic collection inside; the collector's previous state restored after."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


# -----------------------------------------------------------------------------
# `shardwise.json`: the plain-JSON description of a checkpoint (see docs/format.md).
#
# It lists every tensor's dtype, global shape and chunks (file, byte ranges,
# checksums) and every stored object, so that loading a shardwise checkpoint
# never unpickles DCP's `.metadata`, and tools can inspect or verify it with a
# JSON parser. It is written last: its presence marks a committed checkpoint.
# Its fields are declared once, in `format.entries`; this module adds what
# relates several of them (byte ranges inside files, geometry); DCP's view of it
# is `format.manifest`.
# -----------------------------------------------------------------------------

MARKER = ".shardwise"  # written first: a folder with it but no manifest is incomplete


TAIL = 4096  # the last bytes of `.metadata` a load checks: its save id is there


def tail_of(metadata: bytes) -> tuple[int, int]:
    """What a version 4 manifest keeps of its `.metadata`: size, crc32c of its `TAIL`."""
    return len(metadata), crc32c.crc32c(memoryview(metadata)[-TAIL:])


def seal(text: str) -> str:
    """Canonical manifest text ending `"crc32c":0}` with that field set to the crc32c
    of the text itself: what `Manifest.read` checks."""
    return f"{text[:-2]}{crc32c.crc32c(text.encode())}}}"


@dataclass
class Manifest:
    world_size: int
    tensors: dict[str, TensorEntry] = field(default_factory=dict)
    objects: dict[str, ObjectEntry] = field(default_factory=dict)
    page_size: int = PAGE_SIZE
    metadata_crc32c: int = 0  # of DCP's .metadata, for `verify`
    planner_data: Any = None  # DCP's, when plain JSON (see encode_planner_data)
    planner_data_pickle: str | None = None  # otherwise: base64 pickle, read with the safe unpickler
    storage_meta: dict[str, Any] = field(default_factory=dict)  # checkpoint_id, save_id, modules
    dcp_version: str | None = None
    version: int = VERSION  # of the file read; writing always writes VERSION
    metadata_tail: tuple[int, int] = (0, 0)  # v4: .metadata's size, crc32c of its `TAIL`
    index: IndexRef | None = None  # v4: the index file of the tensors' chunk sections
    resolved: bool = field(default=False, compare=False, repr=False)  # v4: chunks read
    # chunks resolved without the checksums their writers keep (`resolve(settled=False)`)
    unsettled: dict[tuple[str, tuple[int, ...]], Unsettled] = field(
        default_factory=dict, compare=False, repr=False
    )

    def to_json(self) -> str:
        """Canonical JSON whose "crc32c" field checksums the document itself, in this
        manifest's `version` (from version 4: once `indexed` set its sections)."""
        return seal(self.unsealed_json())

    def indexed(self, index_file: str, metadata: bytes) -> tuple[bytes, bytes]:
        """This manifest as one writer saves it: (its text, its index file's bytes),
        the index to be written as `index_file`, `metadata` the `.metadata` beside it.
        Written in the current version, whose rows `write_sections` encodes."""
        sections = write_sections(self.tensors, 0)
        self.version = VERSION
        self.index = IndexRef(index_file, [0])
        self.metadata_crc32c = crc32c.crc32c(metadata)
        self.metadata_tail = tail_of(metadata)
        return self.to_json().encode(), sections

    def unsealed_json(self) -> str:
        """`to_json` before its checksum: the text with `"crc32c":0` last (`seal` it)."""
        if self.version > INLINE and (
            self.index is None or any(t.section is None for t in self.tensors.values())
        ):
            raise FieldError("section", "not set: write the sections first (`indexed`)")
        with gc_paused():
            text = json.dumps(encode(TOP, self, self.version), separators=(",", ":"))
        assert text.endswith(',"crc32c":0}')
        return text

    @classmethod
    def from_json(cls, text: str | bytes, source: str | Path = MANIFEST) -> Manifest:
        """The manifest in `text`, every field and the geometry checked (not the data
        files: see `read`). `source` names the file in errors."""
        return cls._parsed([text.encode() if isinstance(text, str) else text], source)

    @classmethod
    def _parsed(cls, held: list[bytes], source: str | Path) -> Manifest:
        """`from_json` of the text `held` alone holds: it is let go once checked, before
        the entries are built (a large manifest's text is 12 MB at 100,000 tensors)."""
        data = held.pop()
        with gc_paused():
            try:
                parsed = parse(data)
                if parsed is None:
                    raise CorruptCheckpointError(
                        f"{source}: unreadable manifest: not a JSON object"
                    )
                del data
                doc, version = parsed
                out = cls(**decode(TOP, doc, version, ""))
            except ValueError as e:  # FieldError, and JSON's and UTF-8's errors
                raise CorruptCheckpointError(f"{source}: unreadable manifest: {e}") from e
            except RecursionError as e:  # nested deeper than any manifest: crafted
                raise CorruptCheckpointError(
                    f"{source}: unreadable manifest: nested too deeply ({e})"
                ) from e
            del doc  # freed before the collector is back: it would walk all of it once more
            out._check_geometry(source)
        return out

    @classmethod
    def read(cls, folder: Folder | str | os.PathLike, name: str = MANIFEST) -> Manifest:
        """The manifest `name` in `folder` with every chunk (from version 4, read from
        its index), checked, its byte ranges inside its files."""
        folder = open_folder(folder)
        out = cls.read_head(folder, name)
        out.resolve(folder, name)
        return out

    def resolve(self, folder: Folder, name: str = MANIFEST, settled: bool = True) -> None:
        """Read every chunk (version 4: from the index; once) and check them all; not
        `settled`: without the checksums writers keep in data files (`unsettled` names
        those chunks: `format.index.resolve_sections`)."""
        path = folder.where(name)
        if self.index is not None:
            if self.resolved and not (settled and self.unsettled):
                return
            self.unsettled = resolve_sections(
                folder, self.index, self.tensors, path, self.version, settled
            )
            self._check_geometry(path)
            self.resolved = True
        self._check_files(folder, path)
        self.check_coverage(path, holes=name != MANIFEST)

    @classmethod
    def read_head(
        cls, folder: Folder, name: str = MANIFEST, listing: dict[str, int] | None = None
    ) -> Manifest:
        """The manifest `name` in `folder` as the file holds it: from version 4 without
        chunks (a load reads the sections it needs: `format.index`), checked alone.
        At most `record_limit` bytes are read (`listing`: the folder's files and sizes,
        when the caller listed it already)."""
        path = folder.where(name)
        try:
            limit = record_limit(folder.sizes() if listing is None else listing, name)
            held = [folder.read(name, limit)]  # the parse lets it go (`_parsed`)
        except OSError as e:
            raise CorruptCheckpointError(f"{path}: unreadable manifest: {e}") from e
        return cls._parsed(held, path)

    def check_coverage(self, source: str, *, holes: bool = False) -> None:
        """The chunks of each tensor cover it exactly, each element once (`engine.plan`: a
        per-rank manifest, its rank's chunks only, still never overlapping)."""
        for k, t in self.tensors.items():
            chunks = [(c.offsets, c.sizes) for c in t.chunks]
            check_coverage(k, t.shape, chunks, source, replicas=False, holes=holes)

    def _check_files(self, folder: Folder, source: str) -> None:
        """Every file named is one of our data files, plain, inside the folder; every
        byte range lies inside its file and no two overlap: nothing past the end is
        read, and no size taken from the manifest is trusted beyond what is stored
        (one listing)."""
        ranges = [(k, c.file, *c.record) for k, t in self.tensors.items() for c in t.chunks]
        ranges += [(k, o.file, o.offset, o.length) for k, o in self.objects.items()]
        for name, key in {r[1]: r[0] for r in ranges}.items():  # each file named once
            check_name(folder, key, name, source, shardwise=True)
        check_ranges(folder, ranges, folder.sizes())

    def files(self) -> set[str]:
        """Every data file this manifest names (from version 4 once `read` whole)."""
        return self.data_files() | ({self.index.file} if self.index is not None else set())

    def data_files(self) -> set[str]:
        """The data files of its chunks and objects: what `.metadata` names too."""
        names = {c.file for t in self.tensors.values() for c in t.chunks}
        return names | {o.file for o in self.objects.values()}

    def stale(
        self, folder: Folder, name: str = METADATA, listing: dict[str, int] | None = None
    ) -> bytes | None:
        """DCP's record `name` beside this manifest when it is not the one this manifest
        was committed with (stock `dcp.save` replaced the checkpoint in place, or a save
        died between its two records): what stock readers follow. None when it matches,
        or when there is none; at most `record_limit` bytes of it are read."""
        listing = folder.sizes() if listing is None else listing
        if self.version >= 4:  # its size and its last bytes: no rank reads all of it
            size = listing.get(name)
            if size is None:
                return None
            file = folder.open(name)
            try:
                end = file.pread(min(size, TAIL), max(0, size - TAIL))
            finally:
                file.close()
            if (size, crc32c.crc32c(end)) == self.metadata_tail:
                return None
        try:
            data = folder.read(name, record_limit(listing, name))
        except FileNotFoundError:
            return None
        return None if crc32c.crc32c(data) == self.metadata_crc32c else data

    def _check_geometry(self, path: str | Path) -> None:
        itemsizes: dict[str, int] = {}
        for k, t in self.tensors.items():
            itemsize = itemsizes.get(t.dtype)
            if itemsize is None:
                itemsize = itemsizes[t.dtype] = dtype_from_name(t.dtype).itemsize
            ndim = len(t.shape)
            for c in t.chunks:
                if c.crc_at >= 0:  # checksums not fetched: as many as its row says
                    kept = self.unsettled.get((k, tuple(c.offsets)))
                    c = replace(c, crcs=range(kept.count if kept else -1))  # type: ignore[arg-type]  # noqa: PLW2901
                if (
                    len(c.offsets) != ndim
                    or len(c.sizes) != ndim
                    or not all(map(operator.le, map(operator.add, c.offsets, c.sizes), t.shape))
                    or not chunk_consistent(c, itemsize, self.version, self.page_size)
                ):
                    raise CorruptCheckpointError(
                        f"{path}: chunk at offsets {c.offsets} of '{k}' has inconsistent sizes or "
                        f"byte ranges (file {c.file}, payload {c.payload})"
                    )

    def set_planner_data(self, value: Any) -> None:
        """Keep DCP's `format.entries` (`format.entries.pickled`)."""
        self.planner_data, self.planner_data_pickle = pickled(value)

    def decoded_planner_data(self) -> Any:
        return unpickled(self.planner_data, self.planner_data_pickle)

    def to_metadata(self) -> Metadata:
        """The DCP `Metadata` this manifest describes, built without unpickling."""
        return metadata_of(self)


# -----------------------------------------------------------------------------
# `.metadata` and `shardwise.json` assembled from parts that different ranks encode.
#
# A save's records list every chunk of every rank: O(W × N) entries, 1,000,000
# at 1,024 ranks × 1,000 tensors. Encoding them on one rank puts seconds of
# pickling and JSON on its critical path, and gathering them there puts the
# whole records in its memory. So each key's owner (`engine.plan`) encodes
# the entries of its own keys into a part (`part_trailer`), writes it beside the
# checkpoint, and the committing rank only copies bytes: a fixed frame with
# three holes in each record, the parts' sections poured into them in order
# (`engine.records`).
#
# `.metadata` sections are protocol-2 pickle fragments: a dict's items with their
# own memo, whose `BINPUT`/`BINGET` carry explicit indices. Concatenated inside an
# empty dict, each fragment re-stores the memo slots it uses before it reads
# them, so no fragment ever sees another's objects. The frame around them is
# pickled without a memo (`Pickler.fast`), so nothing after a fragment reads a
# slot it overwrote. Any unpickler reads the result: stock `dcp.load`'s
# `pickle.load` and shardwise's safe one alike. Manifest sections are the
# members of its three objects ("planner_data", "tensors", "objects"), joined
# by commas. The seventh section is the owner's block of the index (format
# version 4: its keys' chunk sections, `format.index`), which the committing rank
# copies into the index file; the manifest's members point into the block.
# -----------------------------------------------------------------------------

# A part's sections, in the order the frames' holes take them, then its index block.
SECTIONS = 7  # .metadata: state, planner, storage; manifest: planner, tensors, objects; index

_LENGTHS = struct.Struct(f"<{SECTIONS}Q")  # one batch's section lengths

_COUNT = struct.Struct("<Q")  # the number of batches, the part's last bytes

TRAILER = _COUNT.size

_HEAD = b"\x80\x02}q\x00"  # PROTO 2, EMPTY_DICT, BINPUT 0

_MARKS = tuple(f"\x00shardwise part: {n}\x00" for n in ("state", "planner", "storage"))

_EMPTY_TAIL = '"planner_data":{},"tensors":{},"objects":{},"crc32c":0}'

# The manifest's last members, in this order: the holes the parts are poured into
# (`manifest_frame`; "planner_data_pickle" is absent from a frame, its default).
FRAME_TAIL = ("planner_data", "planner_data_pickle", "tensors", "objects", "crc32c")


def check_frame_order(fields: tuple[Field, ...], version: int = VERSION) -> None:
    """Refuse a top-level field table (`format.entries.TOP`) that does not end with
    `FRAME_TAIL`: a field declared after them would land inside a part's bytes, and
    every collective save would fail. Checked when this module is imported."""
    names = tuple(f.name for f in fields if f.in_version(version))
    tail = names[-len(FRAME_TAIL) :]
    if tail == FRAME_TAIL:
        return
    start = names.index("planner_data") + 1 if "planner_data" in names else len(names)
    after = [n for n in names[start:] if n not in FRAME_TAIL]
    raise InvalidArgumentError(
        f"the manifest's top-level field table must end with {', '.join(FRAME_TAIL)} "
        "(the holes the parts of a collective save fill, `format.manifest.manifest_frame`), "
        f"but it ends with {', '.join(tail)}"
        + (f"; declare {after[0]!r} before 'planner_data'" if after else "")
    )


def pickled_items(items: dict[Any, Any]) -> bytes:
    """`items` as a fragment: the opcodes that fill an empty dict with them."""
    data = pickle.dumps(items, protocol=2)
    assert data.startswith(_HEAD) and data.endswith(b"."), "protocol 2 opens and ends so"
    return data[len(_HEAD) : -1]


def _hole(mark: str) -> bytes:
    """How the memo-less frame pickles `{mark: None}` (BINUNICODE, NONE, SETITEM)."""
    text = mark.encode()
    return b"}X" + len(text).to_bytes(4, "little") + text + b"Ns"


def metadata_sections(
    state: dict[str, Any], planner_data: dict[str, Any], storage: dict[Any, Any]
) -> list[bytes]:
    """A part's three `.metadata` sections."""
    return [pickled_items(state), pickled_items(planner_data), pickled_items(storage)]


def manifest_sections(manifest: Manifest, planner_data: dict[str, Any]) -> list[bytes]:
    """A part's three manifest sections: the members of "planner_data" (key: DCP's
    flattened path, a tuple of names and indices: plain JSON), "tensors" and "objects"."""
    doc = encode(TOP, manifest, VERSION)
    paths = {key: encode_planner_data(path) for key, path in planner_data.items()}
    members = [paths, doc["tensors"], doc["objects"]]
    return [json.dumps(m, separators=(",", ":"))[1:-1].encode() for m in members]


def part_trailer(lengths: list[list[int]]) -> bytes:
    """The end of a part written a batch of keys at a time (`engine.records.write_part`):
    each batch's seven section lengths, then the number of batches. An owner of 50,000
    keys that built all their entries, `.metadata` objects and encodings at once would
    hold hundreds of MiB, and the part's bytes; a batch at a time it holds one batch's.
    A section's batches join as parts do: pickle fragments back to back, manifest
    members with commas, index blocks back to back."""
    return b"".join(_LENGTHS.pack(*n) for n in lengths) + _COUNT.pack(len(lengths))


def part_spans(
    read: Callable[[int, int], bytes], size: int, where: str
) -> list[list[tuple[int, int]]]:
    """Each section's (offset, length) pieces, batch by batch, in a part file of `size`
    bytes (`read(n, offset)`); refused unless its batches and trailer fill it exactly."""
    count = _COUNT.unpack(read(TRAILER, size - TRAILER))[0] if size >= TRAILER else -1
    if count < 0 or TRAILER + count * _LENGTHS.size > size:
        raise CorruptCheckpointError(f"{where}: a record part cut short ({size} bytes)")
    table = read(count * _LENGTHS.size, size - TRAILER - count * _LENGTHS.size)
    spans: list[list[tuple[int, int]]] = [[] for _ in range(SECTIONS)]
    at = 0
    for lengths in _LENGTHS.iter_unpack(table):
        for section, n in enumerate(lengths):
            if n:
                spans[section].append((at, n))
            at += n
    if at + len(table) + TRAILER != size:
        raise CorruptCheckpointError(f"{where}: a record part whose sections do not fill it")
    return spans


def metadata_frame(storage_meta: StorageMeta) -> list[bytes]:
    """DCP's pickled `Metadata` cut at its three holes (state, planner data, storage):
    four pieces, each part's `.metadata` sections going between them in order."""
    frame = Metadata(
        state_dict_metadata={_MARKS[0]: None},  # type: ignore[dict-item]  # holes
        planner_data={_MARKS[1]: None},
        storage_data={_MARKS[2]: None},
        storage_meta=storage_meta,
        version=CURRENT_DCP_VERSION,
    )
    buffer = io.BytesIO()
    pickler = pickle.Pickler(buffer, protocol=2)
    pickler.fast = True  # no memo in the frame: see the module's docstring
    pickler.dump(frame)
    pieces, rest = [], buffer.getvalue()
    for mark in _MARKS:
        before, hole, rest = rest.partition(_hole(mark))
        assert hole and _hole(mark) not in rest, "the frame holds nothing of the caller's"
        pieces.append(before + b"}")
    return [*pieces, rest]


def manifest_frame(frame: Manifest) -> list[bytes]:
    """`frame`'s manifest text (no entries, no planner data) cut at its holes: four
    pieces, each part's manifest sections going between them, comma-separated. The
    last piece ends `"crc32c":0}`: the writer seals it (`manifest.seal`)."""
    assert not frame.tensors and not frame.objects and frame.planner_data == {}
    text = frame.unsealed_json()
    if not text.endswith(_EMPTY_TAIL):  # `check_frame_order` refuses such a table at import
        raise InvalidArgumentError(f"the manifest frame does not end with {_EMPTY_TAIL!r}")
    head = text[: -len(_EMPTY_TAIL)]
    return [
        f'{head}"planner_data":{{'.encode(),
        b'},"tensors":{',
        b'},"objects":{',
        b'},"crc32c":0}',
    ]


check_frame_order(TOP)
