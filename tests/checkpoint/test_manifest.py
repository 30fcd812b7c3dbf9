"""shardwise.json: the bytes the writer writes (golden files), what the reader refuses, and
docs/format.md held to the field table of `manifest_fields`."""

from __future__ import annotations

import json
import re
import uuid
import warnings
from dataclasses import fields as dataclass_fields
from pathlib import Path
from typing import Any

import crc32c
import pytest
import torch

import shardwise.checkpoint as swc
from shardwise import Block, Layout, ShardedTensor
from shardwise.checkpoint.format.fast_entries import (
    dump_chunk,
    dump_tensor,
    parse_chunk,
    parse_tensor,
    parse_tensors,
)
from shardwise.checkpoint.format.manifest import (
    READS,
    VERSION,
    ChunkEntry,
    Manifest,
    ObjectEntry,
    TensorEntry,
)
from shardwise.checkpoint.format.manifest_fields import (
    CHUNK,
    FAST_CHUNK,
    RECORDS,
    TENSOR,
    Field,
    decode,
    encode,
)

GOLDEN = Path(__file__).parent / "golden"
DOC = Path(__file__).resolve().parents[2] / "docs" / "format.md"
SOURCE = "ckpt/shardwise.json"  # the file name errors must carry

# Where each record type sits in the golden manifest (the first of its kind).
WHERE: dict[str, tuple[Any, ...]] = {
    "top level": (),
    "storage_meta": ("storage_meta",),
    "tensor": ("tensors", "model.w"),
    "chunk": ("tensors", "model.w", "chunks", 0),
    "object": ("objects", "extra.step"),
}
PATH = {  # the same places as the reader names them in its errors
    "top level": "",
    "storage_meta": "storage_meta.",
    "tensor": "tensors['model.w'].",
    "chunk": "tensors['model.w'].chunks[0].",
    "object": "objects['extra.step'].",
}


def golden_state() -> dict[str, Any]:
    """Every record type and a few variants: two chunks of one tensor, a 0-d tensor,
    bfloat16 with requires_grad, a pickled object."""
    layout = Layout((6, 4), {0: [Block((0, 0), (4, 4)), Block((4, 0), (2, 4))]})
    w = torch.arange(24, dtype=torch.float32).reshape(6, 4)
    bias = torch.tensor([1.0, 2.0, 3.0], dtype=torch.bfloat16, requires_grad=True)
    return {
        "model": {
            "w": ShardedTensor.from_layout(layout, [w[:4].clone(), w[4:].clone()]),
            "bias": bias,
            "scale": torch.tensor(0.5, dtype=torch.float64),
        },
        "extra": {"step": 7},
    }


def checksummed(doc: dict[str, Any]) -> dict[str, Any]:
    """`doc` with its crc32c as docs/format.md defines it: of the compact document, field 0."""
    body = json.dumps(dict(doc, crc32c=0), separators=(",", ":"))
    return dict(doc, crc32c=crc32c.crc32c(body.encode()))


def compact(doc: dict[str, Any]) -> str:
    return json.dumps(doc, separators=(",", ":"))


def readable(value: Any, indent: int = 0) -> str:
    """JSON for people (the golden files, the example in docs/format.md): what fits in a
    line stays on one line."""
    flat = json.dumps(value, separators=(", ", ": "))
    if not isinstance(value, (dict, list)) or indent + len(flat) <= 80:
        return flat
    pad = " " * (indent + 1)
    if isinstance(value, dict):
        items = [f"{pad}{json.dumps(k)}: {readable(v, indent + 1)}" for k, v in value.items()]
        return "{\n" + ",\n".join(items) + "\n" + " " * indent + "}"
    items = [pad + readable(v, indent + 1) for v in value]
    return "[\n" + ",\n".join(items) + "\n" + " " * indent + "]"


# The fields that legitimately differ between two saves of the same state. Each is
# checked against what it stands for, then replaced by the golden's fixed value:
#   tensors[].chunks[].file, objects[].file   the save's random token: __0_0.sw<12 hex>.distcp
#   storage_meta.checkpoint_id                the path saved to
#   storage_meta.save_id                      DCP's random uuid of the save
#   tensors[].chunks[].frame                  crc32c of record bytes holding a save_id-derived id
#   metadata_crc32c                           crc32c of .metadata, which holds all of the above
#   crc32c                                    of the document: recomputed once normalised
FILE = "__0_0.sw000000000000.distcp"
CHECKPOINT_ID = "ckpt/step_100"
SAVE_ID = "00000000-0000-0000-0000-000000000000"


def normalised(folder: Path) -> str:
    written = (folder / "shardwise.json").read_text()
    doc = json.loads(written)
    assert compact(doc) == written  # the writer writes the compact, canonical form
    token = re.compile(r"__0_0\.sw[0-9a-f]{12}\.distcp")
    chunks = [c for t in doc["tensors"].values() for c in t["chunks"]]
    names = {entry["file"] for entry in chunks + list(doc["objects"].values())}
    assert len(names) == 1 and token.fullmatch(next(iter(names)))  # one file, one token
    data = (folder / next(iter(names))).read_bytes()
    for entry in chunks + list(doc["objects"].values()):
        entry["file"] = FILE
    for c in chunks:
        (start, length), (at, size) = c["record"], c["payload"]
        assert c["frame"] == crc32c.crc32c(
            data[at + size : start + length], crc32c.crc32c(data[start:at])
        )
        c["frame"] = 0
    assert doc["metadata_crc32c"] == crc32c.crc32c((folder / ".metadata").read_bytes())
    doc["metadata_crc32c"] = 0
    meta = doc["storage_meta"]
    assert meta["checkpoint_id"] == str(folder) and uuid.UUID(meta["save_id"])
    meta["checkpoint_id"], meta["save_id"] = CHECKPOINT_ID, SAVE_ID
    return compact(checksummed(doc))


def save_golden(folder: Path) -> None:
    with warnings.catch_warnings():  # "assuming the intent is to save in a single process"
        warnings.simplefilter("ignore", UserWarning)
        swc.save(golden_state(), folder)


def golden_text(version: int = VERSION) -> str:
    return compact(json.loads((GOLDEN / f"manifest_v{version}.json").read_text()))


def test_written_manifest_is_the_golden_one(tmp_path):
    save_golden(tmp_path / "step_100")
    assert normalised(tmp_path / "step_100") == golden_text(), (
        "the manifest format changed: if on purpose, bump VERSION when old readers would "
        "misread it (docs/format.md, Versioning) and regenerate the golden file with "
        "`python tests/checkpoint/test_manifest.py`"
    )


def test_golden_round_trips():
    text = golden_text()
    assert Manifest.from_json(text).to_json() == text


def test_golden_values():
    m = Manifest.from_json(golden_text())
    assert (m.version, m.world_size, m.dcp_version) == (3, 1, "1.0.0")
    assert m.storage_meta == {"checkpoint_id": CHECKPOINT_ID, "save_id": SAVE_ID, "modules": []}
    assert m.decoded_planner_data() == {
        "model.w": ("model", "w"),
        "model.bias": ("model", "bias"),
        "model.scale": ("model", "scale"),
        "extra.step": ("extra", "step"),
    }
    w, bias, scale = m.tensors.values()
    assert (w.dtype, w.shape, w.requires_grad) == ("float32", (6, 4), False)
    assert [(c.offsets, c.sizes, c.payload[1]) for c in w.chunks] == [
        ((0, 0), (4, 4), 64),
        ((4, 0), (2, 4), 32),
    ]
    assert (bias.dtype, bias.shape, bias.requires_grad, bias.chunks[0].payload[1]) == (
        "bfloat16",
        (3,),
        True,
        6,
    )
    assert (scale.shape, scale.chunks[0].offsets, scale.chunks[0].payload[1]) == ((), (), 8)
    # chunks of at most 256 KiB are one tile: crc32c of the payload, the elements in C order
    data = torch.arange(24, dtype=torch.float32).numpy().tobytes()
    assert [c.tile for c in w.chunks] == [(4, 4), (2, 4)]
    assert [c.crcs for c in w.chunks] == [[crc32c.crc32c(data[:64])], [crc32c.crc32c(data[64:])]]
    assert (bias.chunks[0].tile, scale.chunks[0].tile) == ((3,), ())
    step = m.objects["extra.step"]
    assert (step.file, step.length, step.transform) == (FILE, 1261, None)
    # one data file, its records back to back in save order, then the pickled object
    ranges = [c.record for t in (w, bias, scale) for c in t.chunks] + [(step.offset, 1261)]
    assert [start for start, _ in ranges] == [0, 1305, 2610, 3851, 5092]
    assert all(a + n == b for (a, n), (b, _) in zip(ranges, ranges[1:]))


@pytest.mark.parametrize("version", READS)
def test_every_readable_version_has_a_golden_file_that_reads(version):
    m = Manifest.from_json(golden_text(version))
    assert m.version == version
    current = Manifest.from_json(golden_text())
    if version == 1:  # before DCP's metadata was kept: defaults
        assert (m.storage_meta, m.planner_data, m.dcp_version) == ({}, None, None)
        assert m.tensors["model.bias"].requires_grad is False
        current.tensors["model.bias"].requires_grad = False
    if version < 3:  # pages of 1 MiB: one each here, the same crc32c as the one tile
        assert m.page_size == 1 << 20
        for t in current.tensors.values():
            for c in t.chunks:
                c.tile = None
    assert m.tensors == current.tensors and m.objects == current.objects
    # an older manifest is written back in its own version, byte for byte
    assert m.to_json() == golden_text(version)


def _doc_example() -> str:
    (block,) = re.findall(r"```json\n(.*?)```", DOC.read_text(), re.DOTALL)
    return block


def test_doc_example_reads_with_the_real_reader(tmp_path):
    text = _doc_example()
    (tmp_path / "shardwise.json").write_text(text)
    doc = json.loads(text)
    ends: dict[str, int] = {}  # data files exactly as long as the example's byte ranges need
    for t in doc["tensors"].values():
        for c in t["chunks"]:
            ends[c["file"]] = max(ends.get(c["file"], 0), sum(c["record"]))
    for o in doc["objects"].values():
        ends[o["file"]] = max(ends.get(o["file"], 0), o["offset"] + o["length"])
    for name, size in ends.items():
        (tmp_path / name).write_bytes(bytes(size))
    assert Manifest.read(tmp_path).to_json() == compact(doc)
    assert compact(doc) == golden_text()  # the example is what the writer writes


def _presence(f: Field) -> str:
    since = f", since v{f.since}" if f.since > 1 else ""
    since += f", until v{f.until}" if f.until is not None else ""
    if f.required:
        return f"required{since}"
    return f"optional{since}; absent: `{json.dumps(f.default)}`"


def markdown_table(record: str) -> str:
    """The table docs/format.md must hold for `record`."""
    rows = [f"| {record} field | value | presence | meaning |", "|---|---|---|---|"]
    rows += [f"| `{f.name}` | {f.kind.doc} | {_presence(f)} | {f.doc} |" for f in RECORDS[record]]
    return "\n".join(rows)


@pytest.mark.parametrize("record", RECORDS)
def test_doc_tables_match_the_field_table(record):
    expected = markdown_table(record)
    assert expected in DOC.read_text(), f"docs/format.md should hold:\n\n{expected}\n"


@pytest.mark.parametrize(
    "record, entry",
    [
        ("top level", Manifest),
        ("tensor", TensorEntry),
        ("chunk", ChunkEntry),
        ("object", ObjectEntry),
    ],
)
def test_entries_hold_the_stored_fields_with_the_table_defaults(record, entry):
    table = {f.name: f for f in RECORDS[record] if f.stored}
    attributes = {a.name: a for a in dataclass_fields(entry)}
    assert {f.attribute for f in table.values()} == set(attributes)
    for f in table.values():
        if not f.required:  # an entry built without it writes nothing for it
            assert attributes[f.attribute].default == f.default, f.name


def _full() -> Manifest:
    """Every optional field set: what the writer emits must be the whole table."""
    m = Manifest(world_size=2, metadata_crc32c=5, dcp_version="1.0.0")
    m.storage_meta = {"checkpoint_id": "c", "save_id": "s", "modules": ["m"]}
    m.set_planner_data({"odd": {1: 2}})  # not plain JSON: pickled
    m.tensors["t"] = TensorEntry("int16", (2, 3), requires_grad=True)
    m.tensors["t"].chunks.append(
        ChunkEntry((0, 0), (2, 3), "f", (0, 99), None, [7], 0, ["stream.zstd/1"])
    )
    m.objects["o"] = ObjectEntry("f", 99, 3, 9, ["stream.zstd/1"])
    return m


def _minimal() -> Manifest:
    m = Manifest(world_size=1)
    m.tensors["t"] = TensorEntry("int16", (2, 3))
    m.tensors["t"].chunks.append(
        ChunkEntry((0, 0), (2, 3), "f", (0, 40), (20, 12), [1, 2], 3, None, (1, 3))
    )
    m.objects["o"] = ObjectEntry("f", 40, 3, 9)
    return m


def _records(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {
        "top level": doc,
        "storage_meta": doc["storage_meta"],
        "tensor": doc["tensors"]["t"],
        "chunk": doc["tensors"]["t"]["chunks"][0],
        "object": doc["objects"]["o"],
    }


def _current(record: str) -> list[Field]:
    return [f for f in RECORDS[record] if f.in_version(VERSION)]


def test_writer_emits_exactly_the_table_fields():
    for record, written in _records(json.loads(_full().to_json())).items():
        assert list(written) == [f.name for f in _current(record)], record
    for record, written in _records(json.loads(_minimal().to_json())).items():
        assert list(written) == [f.name for f in _current(record) if f.required], record


@pytest.mark.parametrize("build", [_full, _minimal], ids=["all-optional-fields", "minimal"])
def test_round_trip_keeps_every_value(build):
    m = build()
    again = Manifest.from_json(m.to_json())
    m.storage_meta = {"checkpoint_id": None, "save_id": None, "modules": []} | m.storage_meta
    assert again == m and again.decoded_planner_data() == m.decoded_planner_data()


_REMOVE = object()


def _mutate(doc: dict[str, Any], record: str, name: str, value: Any) -> dict[str, Any]:
    """`doc` with field `name` of the first `record` set to `value`, or removed."""
    target = doc
    for step in WHERE[record]:
        target = target[step]
    if value is _REMOVE:
        del target[name]
    else:
        target[name] = value
    return doc


def _refused(doc: dict[str, Any], checksum: bool = True) -> str:
    text = compact(checksummed(doc) if checksum else doc)
    with pytest.raises(swc.CorruptCheckpointError) as info:
        Manifest.from_json(text, SOURCE)
    message = str(info.value)
    assert message.startswith(f"{SOURCE}: unreadable manifest: field "), message
    return message


REQUIRED = [
    (record, f.name)
    for record, table in RECORDS.items()
    for f in table
    if f.required and record in WHERE and f.in_version(VERSION)
]


@pytest.mark.parametrize("record, name", REQUIRED, ids=[f"{r}.{n}" for r, n in REQUIRED])
def test_a_missing_required_field_is_named(record, name):
    doc = _mutate(json.loads(golden_text()), record, name, _REMOVE)
    message = _refused(doc, checksum=(record, name) != ("top level", "crc32c"))
    assert f"field {PATH[record]}{name}: " in message


BAD = {
    "world_size-string": ("top level", "world_size", "2", "expected a positive integer"),
    "world_size-zero": ("top level", "world_size", 0, "expected a positive integer"),
    "page_size-in-v3": ("top level", "page_size", 1048576, "unexpected (format version 3 "),
    "metadata_crc32c-negative": ("top level", "metadata_crc32c", -1, "expected a crc32c"),
    "metadata_crc32c-too-big": ("top level", "metadata_crc32c", 1 << 32, "expected a crc32c"),
    "checksum-md5": ("top level", "checksum", "md5", "expected \"crc32c\", got 'md5'"),
    "dcp_version-int": ("top level", "dcp_version", 1, "expected a string or null"),
    "planner_data_pickle-not-base64": (
        "top level",
        "planner_data_pickle",
        "not base64!",
        "expected base64 text",
    ),
    "tensors-list": ("top level", "tensors", [], "expected an object, got []"),
    "objects-null": ("top level", "objects", None, "expected an object, got None"),
    "unexpected-top-level": ("top level", "compression", "zstd", "unexpected"),
    "storage_meta-string": ("top level", "storage_meta", "x", "expected an object"),
    "storage_meta-modules": ("storage_meta", "modules", "m", "expected a list of strings"),
    "storage_meta-checkpoint_id": ("storage_meta", "checkpoint_id", 3, "a string or null"),
    "unexpected-storage_meta": ("storage_meta", "rank", 0, "unexpected"),
    "dtype-unknown": ("tensor", "dtype", "float33", "expected a torch dtype name"),
    "dtype-not-a-dtype": ("tensor", "dtype", "tensor", "expected a torch dtype name"),
    "shape-string": ("tensor", "shape", "6x4", "expected a list of non-negative integers"),
    "shape-negative": ("tensor", "shape", [6, -4], "expected a list of non-negative integers"),
    "requires_grad-string": ("tensor", "requires_grad", "yes", "expected true or false"),
    "chunks-object": ("tensor", "chunks", {}, "expected a list"),
    "unexpected-tensor": ("tensor", "layout", "strided", "unexpected"),
    "sizes-negative": ("chunk", "sizes", [-2, 4], "expected a list of non-negative integers"),
    "offsets-float": ("chunk", "offsets", [0.0, 0], "expected a list of non-negative integers"),
    "file-traversal": (
        "chunk",
        "file",
        "../../etc/passwd",
        "expected a file name (no `/`, no `..`)",
    ),
    "file-empty": ("chunk", "file", "", "expected a file name (no `/`, no `..`)"),
    "record-three": ("chunk", "record", [0, 1, 2], "expected [offset, length]"),
    "payload-negative": ("chunk", "payload", [-1, 64], "expected [offset, length] or null"),
    "pages-in-v3": ("chunk", "pages", [1], "unexpected (format version 3 "),
    "tiles-too-big": ("chunk", "tiles", [1 << 32], "expected a list of crc32c"),
    "tiles-bool": ("chunk", "tiles", [True], "expected a list of crc32c"),
    "tile-negative": ("chunk", "tile", [-1, 4], "expected a list of non-negative integers or null"),
    "tile-float": ("chunk", "tile", [4.0, 4], "expected a list of non-negative integers or null"),
    "tile-string": ("chunk", "tile", "4x4", "expected a list of non-negative integers or null"),
    "frame-float": ("chunk", "frame", 1.5, "expected a crc32c"),
    "transform-empty": ("chunk", "transform", [], "expected a non-empty list of strings"),
    "unexpected-chunk": ("chunk", "compression", "zstd", "unexpected"),
    "object-offset-negative": ("object", "offset", -1, "expected a non-negative integer"),
    "object-length-bool": ("object", "length", True, "expected a non-negative integer"),
    "object-crc32c-null": ("object", "crc32c", None, "expected a crc32c"),
    "unexpected-object": ("object", "dtype", "float32", "unexpected"),
}


@pytest.mark.parametrize("record, name, value, reason", BAD.values(), ids=BAD.keys())
def test_a_malformed_field_is_named(record, name, value, reason):
    message = _refused(_mutate(json.loads(golden_text()), record, name, value))
    assert f"field {PATH[record]}{name}: " in message and reason in message


def test_a_field_newer_than_the_file_version_is_unexpected():
    doc = _mutate(json.loads(golden_text(1)), "chunk", "transform", ["stream.zstd/1"])
    message = _refused(doc)
    assert f"field {PATH['chunk']}transform: unexpected (format version 1 " in message
    doc = _mutate(json.loads(golden_text(2)), "chunk", "tile", [4, 4])
    assert f"field {PATH['chunk']}tile: unexpected (format version 2 " in _refused(doc)


BAD_V2 = {
    "page_size-float": ("top level", "page_size", 1048576.0, "expected a positive integer"),
    "pages-too-big": ("chunk", "pages", [1 << 32], "expected a list of crc32c"),
    "pages-missing": ("chunk", "pages", _REMOVE, "missing (required in format version 2)"),
    "page_size-missing": ("top level", "page_size", _REMOVE, "missing (required in format"),
}


@pytest.mark.parametrize("record, name, value, reason", BAD_V2.values(), ids=BAD_V2.keys())
def test_a_malformed_page_field_of_version_2_is_named(record, name, value, reason):
    message = _refused(_mutate(json.loads(golden_text(2)), record, name, value))
    assert f"field {PATH[record]}{name}: " in message and reason in message


@pytest.mark.parametrize(
    "version, reason",
    [
        (4, "format version 4 is not supported: this shardwise reads versions 1, 2, 3 (a newer"),
        (0, "format version 0 is not supported: this shardwise reads versions 1, 2, 3"),
        ("2", "format version '2' is not supported: this shardwise reads versions 1, 2, 3"),
    ],
)
def test_an_unknown_version_names_found_and_supported(version, reason):
    message = _refused(_mutate(json.loads(golden_text()), "top level", "version", version))
    assert f"field version: {reason}" in message


def test_not_a_shardwise_manifest():
    message = _refused({"format": "other", "version": 2})
    assert "field format: is 'other', not 'shardwise.checkpoint'" in message


def test_a_damaged_document_fails_its_checksum():
    doc = _mutate(json.loads(golden_text()), "object", "offset", 1)  # crc32c left as it was
    assert "field crc32c: does not match the contents" in _refused(doc, checksum=False)


@pytest.mark.parametrize(
    "name, value",
    [
        ("payload", [448, 60]),  # not sizes x itemsize
        ("payload", [1300, 64]),  # not inside the record
        ("payload", None),  # null without a transform
        ("tiles", [1, 2]),  # one crc32c per tile of the grid
        ("tile", [2, 4]),  # a grid of 2 tiles for 1 crc32c
        ("tile", [0, 4]),  # no tile side of 0 in a non-empty chunk
        ("tile", [8, 4]),  # larger than the chunk
        ("tile", [4]),  # not the chunk's ndim
        ("tile", None),  # only a transformed chunk has no tiles
        ("sizes", [5, 4]),  # past the global shape
        ("offsets", [0]),  # not the tensor's ndim
    ],
    ids=[
        "payload-length",
        "payload-outside-record",
        "payload-null",
        "tiles",
        "tile-grid",
        "tile-zero",
        "tile-too-large",
        "tile-ndim",
        "tile-null",
        "sizes",
        "ndim",
    ],
)
def test_cross_field_checks(name, value):
    doc = _mutate(json.loads(golden_text()), "chunk", name, value)
    with pytest.raises(swc.CorruptCheckpointError) as info:
        Manifest.from_json(compact(checksummed(doc)), SOURCE)
    assert str(info.value).startswith(f"{SOURCE}: chunk at offsets ") and "of 'model.w'" in str(
        info.value
    )


def test_cross_field_checks_of_pages_in_version_2():
    doc = _mutate(json.loads(golden_text(2)), "chunk", "pages", [1, 2])  # one page per MiB
    with pytest.raises(swc.CorruptCheckpointError, match=r"chunk at offsets \(0, 0\) of 'model.w'"):
        Manifest.from_json(compact(checksummed(doc)), SOURCE)


def test_a_tiled_chunk_has_one_crc32c_per_tile_of_its_grid():
    doc = json.loads(golden_text())
    chunk = doc["tensors"]["model.w"]["chunks"][0]  # sizes [4, 4]
    for tile, count in [([1, 4], 4), ([3, 3], 4), ([4, 1], 4), ([2, 3], 4), ([1, 1], 16)]:
        chunk["tile"], chunk["tiles"] = tile, list(range(count))
        got = Manifest.from_json(compact(checksummed(doc))).tensors["model.w"].chunks[0]
        assert (got.tile, got.crcs) == (tuple(tile), list(range(count)))
        chunk["tiles"] = list(range(count + 1))
        with pytest.raises(swc.CorruptCheckpointError, match="inconsistent"):
            Manifest.from_json(compact(checksummed(doc)), SOURCE)


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
    m = _minimal()
    m.tensors["t"].chunks[0].tile = None  # page checksums, in a version 3 manifest
    with pytest.raises(ValueError, match=r"chunk at \(0, 0\) in f has a payload but no tiles"):
        m.to_json()
    m.version = 2  # what they are: a version 2 manifest (pages of page_size)
    m.page_size = 8
    m.storage_meta = {"checkpoint_id": None, "save_id": None, "modules": []}
    assert Manifest.from_json(m.to_json()) == m


def test_a_manifest_of_many_small_tensors_round_trips():
    m = Manifest(world_size=1, storage_meta={"checkpoint_id": None, "save_id": None, "modules": []})
    for i in range(2000):
        m.tensors[f"layer.{i}.w"] = TensorEntry("float32", (4, i % 7))
        chunk = ChunkEntry((0, 0), (4, i % 7), "f", (i, 200), (i + 100, 16 * (i % 7)), [i], 5)
        chunk.tile = (4, i % 7)
        m.tensors[f"layer.{i}.w"].chunks.append(chunk)
    text = m.to_json()
    assert Manifest.from_json(text) == m
    doc = json.loads(text)
    assert doc["crc32c"] == crc32c.crc32c(compact(dict(doc, crc32c=0)).encode())
    # a document that is not in the writer's compact form still checks against that form
    assert Manifest.from_json(json.dumps(doc, indent=1)) == m


def test_read_checks_the_data_files(tmp_path):
    save_golden(tmp_path)
    (data,) = tmp_path.glob("*.distcp")
    assert Manifest.read(tmp_path).world_size == 1
    data.write_bytes(data.read_bytes()[:-1])
    with pytest.raises(swc.CorruptCheckpointError, match=rf"past the end of .*{data.name}"):
        Manifest.read(tmp_path)
    data.unlink()
    with pytest.raises(swc.CorruptCheckpointError, match=rf"data file .*{data.name} is missing"):
        Manifest.read(tmp_path)
    (tmp_path / "shardwise.json").write_text("{")
    with pytest.raises(swc.CorruptCheckpointError, match="shardwise.json: unreadable manifest"):
        Manifest.read(tmp_path)


if __name__ == "__main__":  # regenerate the golden file of the current version
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        save_golden(Path(tmp) / "step_100")
        doc = json.loads(normalised(Path(tmp) / "step_100"))
    (GOLDEN / f"manifest_v{VERSION}.json").write_text(readable(doc) + "\n")
