"""`shardwise.json`: the plain-JSON description of a checkpoint (see docs/format.md).

It lists every tensor's dtype, global shape and chunks (file, byte ranges,
checksums) and every stored object, so that loading a shardwise checkpoint
never unpickles DCP's `.metadata`, and tools can inspect or verify it with a
JSON parser. It is written last: its presence marks a committed checkpoint.
Its fields are declared once, in `manifest_fields`; this module adds what
relates several of them (byte ranges inside files, geometry); DCP's view of it
is `dcp_view`.
"""

from __future__ import annotations

import json
import operator
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import crc32c
from torch.distributed.checkpoint.metadata import Metadata

from ...errors import CorruptCheckpointError
from ...storage import Folder, open_folder
from .dcp_view import StoredChunk, StoredObject, metadata_of
from .field_table import FieldError, decode, encode
from .gc_pause import gc_paused
from .manifest_entries import (
    FORMAT,
    INLINE,
    MANIFEST,
    PAGE_SIZE,
    READS,
    VERSION,
    ChunkEntry,
    IndexRef,
    ObjectEntry,
    TensorEntry,
    dtype_from_name,
    dtype_name,
)
from .manifest_fields import TOP
from .manifest_index import resolve_sections, write_sections
from .manifest_text import parse
from .planner_data import pickled, unpickled
from .record_check import (
    check_coverage,
    check_name,
    check_ranges,
    chunk_consistent,
    record_limit,
)

__all__ = [
    "FORMAT",
    "MANIFEST",
    "MARKER",
    "PAGE_SIZE",
    "READS",
    "VERSION",
    "ChunkEntry",
    "IndexRef",
    "Manifest",
    "ObjectEntry",
    "StoredChunk",
    "StoredObject",
    "TensorEntry",
    "dtype_from_name",
    "dtype_name",
    "seal",
    "tail_of",
]

MARKER = ".shardwise"  # written first: a folder with it but no manifest is incomplete
METADATA = ".metadata"  # DCP's record, beside the manifest
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

    def resolve(self, folder: Folder, name: str = MANIFEST) -> None:
        """Read every chunk (version 4: from the index; once) and check them all."""
        path = folder.where(name)
        if self.index is not None:
            if self.resolved:
                return
            resolve_sections(folder, self.index, self.tensors, path, self.version)
            self._check_geometry(path)
            self.resolved = True
        self._check_files(folder, path)
        self.check_coverage(path, holes=name != MANIFEST)

    @classmethod
    def read_head(
        cls, folder: Folder, name: str = MANIFEST, listing: dict[str, int] | None = None
    ) -> Manifest:
        """The manifest `name` in `folder` as the file holds it: from version 4 without
        chunks (a load reads the sections it needs: `manifest_index`), checked alone.
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
        """The chunks of each tensor cover it exactly, each element once (`holes`: a
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
        """Keep DCP's `planner_data` (`planner_data.pickled`)."""
        self.planner_data, self.planner_data_pickle = pickled(value)

    def decoded_planner_data(self) -> Any:
        return unpickled(self.planner_data, self.planner_data_pickle)

    def to_metadata(self) -> Metadata:
        """The DCP `Metadata` this manifest describes, built without unpickling."""
        return metadata_of(self)
