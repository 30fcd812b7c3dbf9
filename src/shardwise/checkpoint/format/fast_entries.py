"""The common chunk and tensor of `shardwise.json`, parsed and written fast.

A checkpoint of 100,000 small tensors has 100,000 chunks like these: version 3
(the last listing chunks in the manifest), no transform, every integer checked by
a few C-level calls instead of one Python call each; from version 4 a tensor is
its dtype, shape and section (`_heads`). They accept exactly what the tables
accept (a test holds them to it); anything else goes through the tables, which
name what is wrong.
"""

from __future__ import annotations

import itertools
import operator
from array import array
from typing import Any

from .field_kinds import is_dtype_name, is_file_name
from .field_table import FieldError
from .manifest_entries import INDEXED, INLINE, ChunkEntry, TensorEntry
from .manifest_text import Head

FAST_CHUNK = ("offsets", "sizes", "file", "record", "payload", "tile", "tiles", "frame")
_FAST_CHUNK_KEYS = frozenset(FAST_CHUNK)
_chunk_values = operator.itemgetter(*FAST_CHUNK)
_INT = {int}  # not bool: JSON `true` is no size
_FRESH = 4096  # sections whose integers are made afresh at once


def _counts(values: list[Any]) -> bool:
    """Non-negative integers, all of them (`values` is not empty)."""
    return set(map(type, values)) == _INT and min(values) >= 0


def parse_chunk(doc: Any, version: int) -> ChunkEntry | None:
    """One common chunk, checked by `parse_tensors` (wrapped as the chunk of a tensor)."""
    out = parse_tensors({"": {"dtype": "uint8", "shape": [], "chunks": [doc]}}, version)
    return None if out is None else out[""].chunks[0]


def dump_chunk(c: ChunkEntry, version: int) -> dict[str, Any] | None:
    if version != INLINE or c.transform is not None:
        return None
    if c.tile is None and c.payload is not None:  # a writer's bug: no reader would take it
        raise FieldError("tile", f"chunk at {c.offsets} in {c.file} has a payload but no tiles")
    return {
        "offsets": c.offsets,
        "sizes": c.sizes,
        "file": c.file,
        "record": c.record,
        "payload": c.payload,
        "tile": c.tile,
        "tiles": c.crcs,
        "frame": c.frame,
    }


def parse_tensors(value: Any, version: int) -> dict[str, TensorEntry] | None:
    """Every tensor of a manifest at once, when all are common: the integers, crc32cs,
    file and dtype names of all chunks are gathered and each kind checked in one pass."""
    if version >= INDEXED:
        return _heads(value)
    if type(value) is dict:
        _objects(value)  # a tensor is no head before version 4: objects again, checked below
    if version != INLINE or type(value) is not dict:
        return None
    counts: list[Any] = []  # every value that must be a non-negative integer
    crcs: list[Any] = []  # every value that must be a crc32c
    names: set[str] = set()  # file names and dtype names, checked once each
    dtypes: set[str] = set()
    out = {}
    for key, t in value.items():
        if type(t) is not dict:
            return None
        dtype, shape, chunks = t.get("dtype"), t.get("shape"), t.get("chunks")
        requires_grad = t.get("requires_grad", False)
        if not (
            len(t) == 3 + ("requires_grad" in t)
            and type(dtype) is str
            and type(shape) is list
            and type(chunks) is list
            and type(requires_grad) is bool
        ):
            return None
        counts += shape
        dtypes.add(dtype)
        entries = []
        for c in chunks:
            if type(c) is not dict or c.keys() != _FAST_CHUNK_KEYS:
                return None
            offsets, sizes, file, record, payload, tile, tiles, frame = _chunk_values(c)
            if not (
                type(offsets) is list
                and type(sizes) is list
                and type(file) is str
                and type(record) is list
                and len(record) == 2
                and type(payload) is list
                and len(payload) == 2
                and type(tile) is list
                and type(tiles) is list
            ):
                return None
            counts += offsets
            counts += sizes
            counts += record
            counts += payload
            counts += tile
            crcs += tiles
            crcs.append(frame)
            names.add(file)
            entries.append(
                ChunkEntry(
                    tuple(offsets),
                    tuple(sizes),
                    file,
                    tuple(record),
                    tuple(payload),
                    tiles,
                    frame,
                    None,
                    tuple(tile),
                )
            )
        out[key] = TensorEntry(dtype, tuple(shape), entries, requires_grad)
    if counts and not _counts(counts):
        return None
    if crcs and not (_counts(crcs) and max(crcs) < 4294967296):
        return None
    if not (all(map(is_file_name, names)) and all(map(is_dtype_name, dtypes))):
        return None
    return out


def parse_tensor(doc: Any, version: int) -> TensorEntry | None:
    out = parse_tensors({"": doc}, version)
    return None if out is None else out[""]


def _heads(value: Any) -> dict[str, TensorEntry] | None:
    """Every tensor of a version 4 manifest at once: dtype, shape and section each.
    Held for the whole load, 100,000 of them at scale: equal dtype names and shapes are
    one object each (the parsed document's copies die with it), and each section's
    integers are made afresh, together, so that none keeps a piece of the document's
    memory alive after it."""
    if type(value) is not dict:
        return None
    counts: list[Any] = []  # checked a few thousand tensors at a time (`_FRESH`)
    crcs: list[Any] = []
    huge = False  # an integer past int64: sections kept as parsed, refused where used
    dtypes: set[str] = set()
    names: dict[str, str] = {}
    shapes: dict[tuple[int, ...], tuple[int, ...]] = {}
    out = {}
    for key, t in value.items():
        if type(t) is Head:  # checked as parsed (`manifest_text`): its values below
            dtype, shape, section, requires_grad, _named = t
        elif type(t) is not dict:
            return _objects(value)
        else:
            dtype, shape, section = t.get("dtype"), t.get("shape"), t.get("section")
            requires_grad = t.get("requires_grad", False)
            if not (
                len(t) == 3 + ("requires_grad" in t)
                and type(dtype) is str
                and type(shape) is list
                and type(section) is list
                and len(section) == 5
                and type(requires_grad) is bool
            ):
                return _objects(value)
        counts += shape
        counts += section
        crcs.append(section[4])
        dtypes.add(dtype)
        shape = tuple(shape)
        dtype, shape = names.setdefault(dtype, dtype), shapes.setdefault(shape, shape)
        # its section a tuple below, of integers of its own
        out[key] = TensorEntry(dtype, shape, [], requires_grad, section)
        if len(crcs) == _FRESH:
            if not _heads_valid(counts, crcs):
                return _objects(value)
            huge |= max(counts) >= 1 << 63
            counts, crcs = [], []
    if not (_heads_valid(counts, crcs) and all(map(is_dtype_name, dtypes))):
        return _objects(value)
    if huge or (counts and max(counts) >= 1 << 63):
        for t in out.values():
            t.section = tuple(t.section)  # type: ignore[arg-type, assignment]
        return out
    del counts, crcs
    heads = list(out.values())
    for lo in range(0, len(heads), _FRESH):
        part = heads[lo : lo + _FRESH]
        fresh = iter(array("q", [v for t in part for v in t.section]).tolist())  # type: ignore[union-attr]
        for t in part:
            t.section = tuple(itertools.islice(fresh, 5))  # type: ignore[assignment]
    return out


def _objects(value: dict[str, Any]) -> dict[str, TensorEntry] | None:
    """None, for the tables to name what is wrong: every head given back to `value` as
    the JSON object it was parsed from."""
    for key, t in value.items():
        if type(t) is Head:
            value[key] = t.as_object()
    return None


def _heads_valid(counts: list[Any], crcs: list[Any]) -> bool:
    """Non-negative integers all, crc32cs below 2**32 (empty: none to check)."""
    return not counts or (_counts(counts) and max(crcs) < 1 << 32)


def dump_tensor(t: TensorEntry, version: int) -> dict[str, Any] | None:
    if version >= INDEXED and not t.transforms and t.section is not None:
        head: dict[str, Any] = {"dtype": t.dtype, "shape": t.shape}
        if t.requires_grad:
            head["requires_grad"] = True
        head["section"] = t.section
        return head
    if version != INLINE:
        return None
    chunks = []
    for c in t.chunks:
        d = dump_chunk(c, version)
        if d is None:
            return None
        chunks.append(d)
    if t.requires_grad:
        return {"dtype": t.dtype, "shape": t.shape, "requires_grad": True, "chunks": chunks}
    return {"dtype": t.dtype, "shape": t.shape, "chunks": chunks}
