"""The fast path for the common chunk and tensor (`fast_entries`): it accepts exactly what
the field tables accept, and writes what they write."""

from __future__ import annotations

import json
from typing import Any

import pytest

from shardwise.checkpoint.format.fast_entries import (
    dump_chunk,
    dump_tensor,
    parse_chunk,
    parse_tensor,
    parse_tensors,
)
from shardwise.checkpoint.format.manifest import READS, VERSION, ChunkEntry, Manifest, TensorEntry
from shardwise.checkpoint.format.manifest_fields import CHUNK, FAST_CHUNK, TENSOR, decode, encode

from .golden_manifest import BAD, golden_text, minimal_manifest


def _chunk_docs() -> list[Any]:
    """The golden chunks, and each with one field broken in every way the tests know."""
    doc = json.loads(golden_text())
    chunks = [c for t in doc["tensors"].values() for c in t["chunks"]]
    broken = []
    for record, name, value, _ in BAD.values():
        if record == "chunk":
            broken.append(dict(chunks[0], **{name: value}))
    for name in FAST_CHUNK:
        broken.append({k: v for k, v in chunks[0].items() if k != name})
        for value in (None, True, 1.0, -1, "x", [], [None], [1.5], [-1], [1, 2, 3], {}):
            broken.append(dict(chunks[0], **{name: value}))
    broken.append(dict(chunks[0], transform=["stream.zstd/1"], payload=None, tile=None))
    broken.append(dict(chunks[0], extra=1))
    return chunks + broken + ["not a chunk", None, []]


@pytest.mark.parametrize("version", READS)
def test_the_fast_chunk_path_reads_and_writes_as_the_table(version):
    """The fast path for the common chunk never accepts what the table refuses, and
    what it accepts is the table's entry; what it writes is the table's JSON."""
    assert FAST_CHUNK == tuple(f.name for f in CHUNK if f.in_version(VERSION) and f.required)
    accepted = 0
    for c in _chunk_docs():
        fast = parse_chunk(c, version)
        try:
            slow = ChunkEntry(**decode(CHUNK, c, version, "chunk"))
        except ValueError:
            assert fast is None, c
            continue
        assert fast is None or fast == slow, c
        # the fast path takes every current chunk the table takes, but for a transformed one
        # (a transform, a null payload or tile: the geometry check refuses the latter alone)
        common = (
            version == VERSION
            and set(c) == set(FAST_CHUNK)
            and c["payload"] is not None
            and c["tile"] is not None
        )
        assert (fast is not None) == common, c
        accepted += fast is not None
        if fast is not None:
            assert dump_chunk(fast, version) == encode(CHUNK, fast, version)
    assert accepted >= (3 if version == VERSION else 0)  # the golden chunks at least
    tensors = json.loads(golden_text(version))["tensors"]
    slow = {k: TensorEntry(**decode(TENSOR, t, version, "tensor")) for k, t in tensors.items()}
    assert parse_tensors(tensors, version) == (slow if version == VERSION else None)
    for k, t in tensors.items():
        assert parse_tensor(t, version) == (slow[k] if version == VERSION else None)
        assert dump_tensor(slow[k], version) == (
            encode(TENSOR, slow[k], version) if version == VERSION else None
        )
    if version != VERSION:
        return
    bias = tensors["model.bias"]
    for name, value in [("shape", [True]), ("shape", [-1]), ("dtype", "float33"), ("dtype", 3)]:
        broken = dict(tensors, **{"model.bias": dict(bias, **{name: value})})
        assert parse_tensors(broken, version) is None, (name, value)
        with pytest.raises(ValueError):
            decode(TENSOR, broken["model.bias"], version, "tensor")
    for c in _chunk_docs():  # one broken chunk: the whole map goes through the table
        broken = dict(tensors, **{"model.bias": dict(bias, chunks=[c])})
        if parse_chunk(c, version) is None:
            assert parse_tensors(broken, version) is None, c
    extra = dict(tensors, **{"model.bias": dict(bias, requires_grad=1)})
    assert parse_tensors(extra, version) is None


def test_a_chunk_without_tiles_is_never_written():
    m = minimal_manifest()
    m.tensors["t"].chunks[0].tile = None  # page checksums, in a version 3 manifest
    with pytest.raises(ValueError, match=r"chunk at \(0, 0\) in f has a payload but no tiles"):
        m.to_json()
    m.version = 2  # what they are: a version 2 manifest (pages of page_size)
    m.page_size = 8
    m.storage_meta = {"checkpoint_id": None, "save_id": None, "modules": []}
    assert Manifest.from_json(m.to_json()) == m
