"""The index of a version 4 checkpoint (`chunk_table`, `manifest_index`): the section layout
docs/format.md gives, byte for byte, and what a reader refuses in a damaged or crafted
index; a load's reads of the sections of its tensors only (`TensorChunks`)."""

from __future__ import annotations

import json
from pathlib import Path

import crc32c
import numpy as np
import pytest

import shardwise.checkpoint as swc
from shardwise.checkpoint.format.manifest import ChunkEntry, IndexRef, Manifest, TensorEntry
from shardwise.checkpoint.format.manifest_index import (
    Ranges,
    TensorChunks,
    check_read_ranges,
    read_sections,
)
from shardwise.storage import open_folder

from .golden_manifest import (
    FILE,
    INDEX_FILE,
    checksummed,
    compact,
    golden_chunks,
    golden_folder,
    golden_index,
    golden_text,
    minimal_manifest,
    save_golden,
    written,
)

W = 264  # bytes of model.w's section: 2 rows of 16 int64, 2 uint32


def test_the_section_layout_is_the_documented_one():
    index = golden_index()
    w = np.frombuffer(index[: 2 * 16 * 8], dtype="<i8").reshape(2, 16).tolist()
    # offsets sizes tile rank k token record payload frame crc_count transform
    assert w == [
        [0, 0, 4, 4, 4, 4, 0, 0, 0, 0, 1305, 448, 64, 0, 1, -1],
        [4, 0, 2, 4, 2, 4, 0, 0, 0, 1305, 1305, 1753, 32, 0, 1, -1],
    ]
    assert np.frombuffer(index[256:W], dtype="<u4").tolist() == [722256751, 3265927622]
    bias = np.frombuffer(index[W : W + 104], dtype="<i8").tolist()
    assert bias == [0, 3, 3, 0, 0, 0, 2610, 1241, 3058, 6, 0, 1, -1]
    assert np.frombuffer(index[W + 104 : W + 108], dtype="<u4").tolist() == [3417325932]
    scale = np.frombuffer(index[W + 108 : W + 188], dtype="<i8").tolist()  # 0-d: no box
    assert scale == [0, 0, 0, 3851, 1241, 4299, 8, 0, 1, -1]
    assert np.frombuffer(index[W + 188 :], dtype="<u4").tolist() == [2575767776]


def test_a_transformed_chunk_row_names_its_transform_by_position(tmp_path):
    m = Manifest(world_size=1, version=4)
    m.tensors["t"] = TensorEntry("int16", (4,))
    m.tensors["t"].chunks = [
        ChunkEntry((0,), (2,), FILE, (0, 50), None, [7], 3, ["stream.zstd/1"]),
        ChunkEntry((2,), (2,), FILE, (50, 50), None, [8], 4, ["stream.zstd/1"]),
    ]
    text, index = written(m, tmp_path)
    assert json.loads(text)["tensors"]["t"]["transforms"] == [["stream.zstd/1"]]
    rows = np.frombuffer(index[: 2 * 13 * 8], dtype="<i8").reshape(2, 13).tolist()
    assert rows == [
        [0, 2, -1, 0, 0, 0, 0, 50, -1, -1, 3, 1, 0],
        [2, 2, -1, 0, 0, 0, 50, 50, -1, -1, 4, 1, 0],
    ]
    assert Manifest.read(tmp_path).tensors == m.tensors


def _crafted(tmp_path: Path, rows: list[list[int]], crcs: list[int], count: int = -1) -> Path:
    """The golden checkpoint with model.w's section made of `rows` and `crcs` (the head
    pointing at it, its crc32c right; `count` rows when given)."""
    section = np.asarray(rows, dtype="<i8").tobytes() + np.asarray(crcs, dtype="<u4").tobytes()
    doc = json.loads(golden_text())
    shift = len(section) - W
    for t in doc["tensors"].values():
        if t["section"][1]:
            t["section"][1] += shift
    count = len(rows) if count < 0 else count
    doc["tensors"]["model.w"]["section"] = [0, 0, len(section), count, crc32c.crc32c(section)]
    folder = golden_folder(tmp_path, compact(checksummed(doc)))
    (folder / INDEX_FILE).write_bytes(section + golden_index()[W:])
    return folder


ROWS = [
    [0, 0, 4, 4, 4, 4, 0, 0, 0, 0, 1305, 448, 64, 0, 1, -1],
    [4, 0, 2, 4, 2, 4, 0, 0, 0, 1305, 1305, 1753, 32, 0, 1, -1],
]
CRCS = [722256751, 3265927622]


def _row(i: int, column: int, value: int) -> list[list[int]]:
    rows = [list(r) for r in ROWS]
    rows[i][column] = value
    return rows


@pytest.mark.parametrize(
    "rows, crcs, count, message",
    [
        (ROWS, CRCS, 3, "a section of 264 bytes cannot hold 3 chunk rows"),
        (ROWS, CRCS + [0], -1, "its rows count 2 checksums, it holds 3"),
        (_row(0, 14, 2), CRCS, -1, "its rows count 3 checksums, it holds 2"),
        (_row(1, 0, -2), CRCS, -1, "a chunk row holds an impossible value"),
        (_row(1, 10, 1 << 62), CRCS, -1, "a chunk row holds an impossible value"),
        (_row(0, 8, 1 << 48), CRCS, -1, "chunk row 0 holds an impossible value"),
        (_row(0, 15, 0), CRCS, -1, "chunk row 0 holds an impossible value"),  # no transforms
        (_row(1, 11, -1), CRCS, -1, "chunk row 1 holds an impossible value"),  # payload, no
        (_row(0, 13, 1 << 32), CRCS, -1, "chunk row 0 holds an impossible value"),  # frame
        (_row(1, 12, 28), CRCS, -1, "chunk at offsets (4, 0) of 'model.w' has inconsistent"),
        (_row(1, 4, 8), CRCS, -1, "chunk at offsets (4, 0) of 'model.w' has inconsistent"),
        (_row(1, 2, 3), CRCS, -1, "chunk at offsets (4, 0) of 'model.w' has inconsistent"),
        (_row(1, 0, 3), CRCS, -1, "'model.w' (shape (6, 4)) overlap in part at 3 along"),
        (_row(1, 6, 5), CRCS, -1, "__5_0.sw000000000000.distcp is missing"),
        (_row(1, 10, 6000), CRCS, -1, "lie past the end of"),
    ],
    ids=[
        "rows-past-the-section",
        "a-checksum-too-many",
        "a-checksum-too-few",
        "negative",
        "too-big",
        "token-over-48-bits",
        "transform-unknown",
        "payload-null-untransformed",
        "frame-over-32-bits",
        "payload-length",
        "tile-too-large",
        "sizes-past-shape",
        "overlapping",
        "missing-file",
        "record-past-the-file",
    ],
)
def test_a_crafted_section_is_refused(tmp_path, rows, crcs, count, message):
    folder = _crafted(tmp_path, rows, crcs, count)
    Manifest.read_head(open_folder(folder))  # the head alone is sound
    with pytest.raises(swc.CorruptCheckpointError) as info:
        Manifest.read(folder)
    assert message in str(info.value)


def test_the_crafted_golden_section_reads(tmp_path):
    m = Manifest.read(_crafted(tmp_path, ROWS, CRCS))
    assert m.tensors["model.w"].chunks == golden_chunks()["model.w"].chunks


def test_a_damaged_index_is_refused(tmp_path):
    folder = golden_folder(tmp_path)
    index = bytearray(golden_index())
    index[100] ^= 1  # inside model.w's section
    (folder / INDEX_FILE).write_bytes(bytes(index))
    with pytest.raises(swc.CorruptCheckpointError) as info:
        Manifest.read(folder)
    assert str(info.value) == (
        f"{folder / INDEX_FILE}: the section of 'model.w' does not match its checksum (damaged)"
    )
    (folder / INDEX_FILE).write_bytes(golden_index()[:-1])
    with pytest.raises(swc.CorruptCheckpointError, match=r"sections up to byte 456 of .* \(455"):
        Manifest.read(folder)


def test_a_missing_index_is_refused_as_a_missing_data_file(tmp_path):
    folder = golden_folder(tmp_path)
    (folder / INDEX_FILE).unlink()
    assert Manifest.read_head(open_folder(folder)).index is not None  # the head alone reads
    with pytest.raises(swc.CorruptCheckpointError, match=rf"{INDEX_FILE} is missing"):
        Manifest.read(folder)


@pytest.mark.parametrize(
    "where, value, message",
    [
        (("tensors", "model.w", "section"), [1, 0, W, 2, 0], "'model.w' names block 1 of its"),
        (("index", "file"), "notes.txt", "is not a shardwise data file"),
        (("index", "file"), "shardwise.json", "one of the checkpoint's own records"),
        (("index", "blocks"), [], "'model.w' names block 0 of its index"),
    ],
    ids=["block", "index-not-a-data-file", "index-a-record", "no-blocks"],
)
def test_a_head_pointing_outside_its_index_is_refused(tmp_path, where, value, message):
    doc = json.loads(golden_text())
    target = doc
    for step in where[:-1]:
        target = target[step]
    target[where[-1]] = value
    folder = golden_folder(tmp_path, compact(checksummed(doc)))
    with pytest.raises(swc.CorruptCheckpointError, match=message):
        Manifest.read(folder)


def test_a_load_reads_only_the_sections_of_its_tensors(tmp_path):
    folder = golden_folder(tmp_path)
    index = bytearray(golden_index())
    index[100] ^= 1  # model.w's section is damaged: reading it would fail
    (folder / INDEX_FILE).write_bytes(bytes(index))
    f = open_folder(folder)
    head = Manifest.read_head(f)
    assert head.index is not None
    wanted = [(k, head.tensors[k]) for k in ("model.scale", "model.bias")]
    tables = dict(read_sections(f, head.index, wanted, "src"))
    assert list(tables) == ["model.bias", "model.scale"]  # in index order
    bias = TensorChunks("model.bias", head.tensors["model.bias"], tables["model.bias"], set())
    assert bias.table.entries() == golden_chunks()["model.bias"].chunks


def test_a_piece_gets_the_rows_overlapping_it_each_checked(tmp_path):
    folder = golden_folder(tmp_path)
    f = open_folder(folder)
    head = Manifest.read_head(f)
    assert head.index is not None
    ((_, table),) = read_sections(f, head.index, [("model.w", head.tensors["model.w"])], "src")
    ranges: Ranges = {}
    chunks = TensorChunks("model.w", head.tensors["model.w"], table, ranges)
    first, second = golden_chunks()["model.w"].chunks
    assert chunks.covering((0, 0), (6, 4)) == [first, second]
    assert chunks.covering((4, 1), (1, 2)) == [second]
    assert chunks.covering((3, 0), (2, 1)) == [first, second]
    assert ranges == {
        ("model.w", 0): ("model.w", FILE, *first.record),
        ("model.w", 1): ("model.w", FILE, *second.record),
    }
    check_read_ranges(f, ranges, f.sizes())  # each row once, however many pieces read it
    with pytest.raises(swc.CorruptCheckpointError, match="lie past the end of"):
        check_read_ranges(f, ranges, {FILE: 1700})
    other = ("model.v", FILE, second.record[0] + 8, 16)  # another tensor's claim on its bytes
    with pytest.raises(swc.CorruptCheckpointError, match="claim overlapping bytes"):
        check_read_ranges(f, {**ranges, ("model.v", 0): other}, f.sizes())
    twin = ("model.w", FILE, *second.record)  # another row naming the same record
    with pytest.raises(swc.CorruptCheckpointError, match="claim overlapping bytes"):
        check_read_ranges(f, {**ranges, ("model.w", 2): twin}, f.sizes())


def test_a_piece_a_row_is_missing_from_is_refused(tmp_path):
    folder = _crafted(tmp_path, ROWS[:1], CRCS[:1])
    f = open_folder(folder)
    head = Manifest.read_head(f)
    assert head.index is not None
    ((_, table),) = read_sections(f, head.index, [("model.w", head.tensors["model.w"])], "src")
    chunks = TensorChunks("model.w", head.tensors["model.w"], table, set())
    assert len(chunks.covering((0, 0), (4, 4))) == 1  # what it holds reads
    with pytest.raises(swc.CorruptCheckpointError, match=r"model.w \(at \(3, 0\)\)"):
        chunks.covering((3, 0), (2, 4))  # a hole where row 1 was


@pytest.mark.parametrize("index", [None, IndexRef(INDEX_FILE, [0])], ids=["no-index", "index"])
def test_a_version_4_manifest_without_its_sections_is_never_written(index):
    m = minimal_manifest(4)  # its chunks not yet written as sections (`indexed`)
    m.index = index
    with pytest.raises(ValueError, match="section"):
        m.to_json()


def test_read_checks_the_data_files(tmp_path):
    save_golden(tmp_path)
    m = Manifest.read(tmp_path)
    assert m.to_json() == (tmp_path / "shardwise.json").read_text()  # read whole, as written
    assert m.world_size == 1 and m.index is not None
    data = tmp_path / m.objects["extra.step"].file
    assert {p.name for p in tmp_path.glob("*.distcp")} == {data.name, m.index.file}
    data.write_bytes(data.read_bytes()[:-1])
    with pytest.raises(swc.CorruptCheckpointError, match=rf"past the end of .*{data.name}"):
        Manifest.read(tmp_path)
    data.unlink()
    with pytest.raises(swc.CorruptCheckpointError, match=rf"data file .*{data.name} is missing"):
        Manifest.read(tmp_path)
    (tmp_path / "shardwise.json").write_text("{")
    with pytest.raises(swc.CorruptCheckpointError, match="shardwise.json: unreadable manifest"):
        Manifest.read(tmp_path)


def test_many_small_tensors_round_trip_through_the_index(tmp_path):
    m = Manifest(world_size=1, version=4)
    m.storage_meta = {"checkpoint_id": None, "save_id": None, "modules": []}
    for i in range(500):
        m.tensors[f"layer.{i}.w"] = TensorEntry("float32", (4, i % 7))
        payload = (i * 200 + 100, 16 * (i % 7))
        chunk = ChunkEntry((0, 0), (4, i % 7), FILE, (i * 200, 200), payload, [i], 5)
        chunk.tile = (4, i % 7)
        m.tensors[f"layer.{i}.w"].chunks.append(chunk)
    text, index = written(m, tmp_path)
    assert len(index) == sum(16 * 8 + 4 for _ in range(500))
    head = Manifest.from_json(text)
    assert [t.section for t in head.tensors.values()] == [t.section for t in m.tensors.values()]
    assert Manifest.read(tmp_path) == m
