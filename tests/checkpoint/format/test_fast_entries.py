"""The fast path for the common chunk and tensor (`format.entries`): it accepts exactly what
the field tables accept, and writes what they write."""

from __future__ import annotations

import json
from typing import Any

import pytest

from shardwise.checkpoint.format.entries import (
    CHUNK,
    FAST_CHUNK,
    INDEXED,
    INLINE,
    TENSOR,
    decode,
    dump_chunk,
    dump_tensor,
    encode,
    parse_chunk,
    parse_tensor,
    parse_tensors,
)
from shardwise.checkpoint.format.manifest import READS, VERSION, ChunkEntry, Manifest, TensorEntry

from .broken_fields import BAD, BAD_V4
from .golden_manifest import FILE, golden_text, minimal_manifest


def _chunk_docs() -> list[Any]:
    """The golden chunks (version 3: the last listing them), and each with one field broken
    in every way the tests know."""
    doc = json.loads(golden_text(INLINE))
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
    assert FAST_CHUNK == tuple(f.name for f in CHUNK if f.in_version(INLINE) and f.required)
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
            version == INLINE
            and set(c) == set(FAST_CHUNK)
            and c["payload"] is not None
            and c["tile"] is not None
        )
        assert (fast is not None) == common, c
        accepted += fast is not None
        if fast is not None:
            assert dump_chunk(fast, version) == encode(CHUNK, fast, version)
    # the 4 golden chunks, and 9 broken ones whose fields are each well-formed: offsets,
    # sizes, tile or tiles of another length, a file "x" (geometry is checked afterwards)
    assert accepted == (13 if version == INLINE else 0)
    # the fast tensor path: version 3 (chunks listed) and from 4 (a head: dtype, shape, section)
    fast = version == INLINE or version >= INDEXED
    tensors = json.loads(golden_text(version))["tensors"]
    slow = {k: TensorEntry(**decode(TENSOR, t, version, "tensor")) for k, t in tensors.items()}
    assert parse_tensors(tensors, version) == (slow if fast else None)
    for k, t in tensors.items():
        assert parse_tensor(t, version) == (slow[k] if fast else None)
        assert dump_tensor(slow[k], version) == (encode(TENSOR, slow[k], version) if fast else None)
    if version != INLINE:
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
    with pytest.raises(ValueError, match=rf"chunk at \(0, 0\) in {FILE} has a payload but no"):
        m.to_json()
    m.version = 2  # what they are: a version 2 manifest (pages of page_size)
    m.page_size = 8
    m.storage_meta = {"checkpoint_id": None, "save_id": None, "modules": []}
    assert Manifest.from_json(m.to_json()) == m


def _head_docs(version: int) -> list[Any]:
    """The golden tensors of `version` (4 or later), and each with one field broken in every
    way the tests know, or with a field the fast path leaves to the table."""
    tensors = list(json.loads(golden_text(version))["tensors"].values())
    w = tensors[0]
    broken = [
        dict(w, **{n: value}) for record, n, value, _ in BAD_V4.values() if record == "tensor"
    ]
    for name in ("dtype", "shape", "section", "requires_grad"):
        broken.append({k: v for k, v in w.items() if k != name})
        for value in (None, True, 1.0, -1, "x", [], [None], [1.5], [-1], [1, 2, 3], {}):
            broken.append(dict(w, **{name: value}))
    broken.append(dict(w, section=[0, 0, 264, 2, (1 << 32) - 1]))
    broken.append(dict(w, transforms=[["stream.zstd/1"]]))
    broken.append(dict(w, transforms=[]))
    broken.append(dict(w, requires_grad=False))
    broken.append(dict(w, chunks=[]))
    return tensors + broken + ["not a tensor", None, []]


@pytest.mark.parametrize("version", [INDEXED, VERSION])
def test_the_fast_head_path_reads_and_writes_as_the_table(version):
    """From version 4: the fast path for a tensor's head never accepts what the table
    refuses, and what it accepts is the table's entry, written back as the table writes it."""
    accepted = 0
    for t in _head_docs(version):
        fast = parse_tensor(t, version)
        try:
            slow = TensorEntry(**decode(TENSOR, t, version, "tensor"))
        except ValueError:
            assert fast is None, t
            continue
        assert fast is None or fast == slow, t
        # it takes every head the table takes, but one with transforms (a table field)
        assert (fast is not None) == ("transforms" not in t), t
        accepted += fast is not None
        assert dump_tensor(slow, version) in (None, encode(TENSOR, slow, version)), t
        if fast is not None:
            assert parse_tensors({"a": t, "b": t}, version) == {"a": slow, "b": slow}
    # the 3 golden heads; shapes [] and [1, 2, 3] (the geometry is the section's to check),
    # no requires_grad (as the golden), requires_grad true or false, a crc32c of 2**32 - 1
    assert accepted == 9
    tensors = json.loads(golden_text(version))["tensors"]
    for t in _head_docs(version)[3:]:  # one broken tensor: the whole map goes through the table
        if parse_tensor(t, version) is None:
            assert parse_tensors(dict(tensors, **{"model.bias": t}), version) is None, t


def test_the_fast_heads_share_equal_dtypes_and_shapes_and_keep_any_section():
    """Held for a whole load: equal dtype names and shapes are one object each, sections
    tuples of the same values (a section past int64 kept as parsed: refused where used)."""
    w = json.loads(golden_text(VERSION))["tensors"]["model.w"]
    other = dict(w, dtype="".join(w["dtype"]), shape=list(w["shape"]))
    assert other["dtype"] is not w["dtype"]
    out = parse_tensors({"a": w, "b": other}, VERSION)
    assert out is not None and out["a"].dtype is out["b"].dtype
    assert out["a"].shape is out["b"].shape and out["a"].section == tuple(w["section"])
    huge = dict(w, section=[0, 1 << 70, *w["section"][2:]])
    out = parse_tensors({"a": w, "h": huge}, VERSION)
    assert out is not None and out["h"] == TensorEntry(**decode(TENSOR, huge, VERSION, "tensor"))
    assert type(out["h"].section) is tuple and out["h"].section[1] == 1 << 70


@pytest.mark.parametrize("at", [0, 4095, 4096, 5000])  # either side of a batch of checks
def test_many_heads_are_checked_in_batches_and_every_one_is(at):
    w = json.loads(golden_text(VERSION))["tensors"]["model.w"]
    heads = {f"t{i}": w for i in range(5001)}
    assert parse_tensors(heads, VERSION) == {k: parse_tensor(w, VERSION) for k in heads}
    assert parse_tensors(dict(heads, **{f"t{at}": dict(w, shape=[-1, 4])}), VERSION) is None
    crc = dict(w, section=[*w["section"][:4], 1 << 32])
    assert parse_tensors(dict(heads, **{f"t{at}": crc}), VERSION) is None
    huge = dict(w, section=[0, 1 << 70, *w["section"][2:]])
    out = parse_tensors(dict(heads, **{f"t{at}": huge}), VERSION)
    assert out is not None and out[f"t{at}"].section == tuple(huge["section"])
    assert all(type(t.section) is tuple for t in out.values())
