"""The index of versions 4 and 5 (`format.table`, `format.index`): the section layout of
docs/format.md, byte for byte, what a reader refuses in a damaged or crafted index, a load's
reads of its tensors' sections only (`TensorChunks`). Kept checksums: test_writer_checksums."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import shardwise.checkpoint as swc
from shardwise.checkpoint.format.index import Ranges, TensorChunks, check_read_ranges, read_sections
from shardwise.checkpoint.format.manifest import ChunkEntry, IndexRef, Manifest, TensorEntry
from shardwise.storage import open_folder

from .crafted_sections import CRCS, INLINE_CRCS, ROWS, V4, crafted, inline, row
from .golden_manifest import (
    FILE,
    INDEX_FILE,
    checksummed,
    compact,
    golden_chunks,
    golden_folder,
    golden_index,
    golden_state,
    golden_text,
    minimal_manifest,
    save_golden,
    v4_sections,
    written,
)


@pytest.mark.parametrize("version", [4, 5])
def test_the_section_layout_is_the_documented_one(version):
    index, at, kept = golden_index(version), 0, version - 4  # 5: crc_at, no checksums
    bias = [0, 3, 3, 0, 0, 0, 2610, 1241, 3058, 6, 0, 1, -1] + [6369] * kept
    scale = [0, 0, 0, 3851, 1241, 4299, 8, 0, 1, -1] + [6377] * kept  # 0-d: no box
    for rows, crcs in [
        (ROWS[version], INLINE_CRCS[version]),
        ([bias], [3417325932][kept:]),
        ([scale], [2575767776][kept:]),
    ]:
        n = 8 * len(rows) * len(rows[0])
        assert np.frombuffer(index[at : at + n], dtype="<i8").tolist() == sum(rows, [])
        assert np.frombuffer(index[at + n : at + n + 4 * len(crcs)], "<u4").tolist() == crcs
        at += n + 4 * len(crcs)
    assert at == len(index) == (456 if version == 4 else 472)


@pytest.mark.parametrize("version", [4, 5])
def test_a_transformed_chunk_row_names_its_transform_by_position(tmp_path, version):
    m = Manifest(world_size=1, version=version)
    m.tensors["t"] = TensorEntry("int16", (4,))
    m.tensors["t"].chunks = [
        ChunkEntry((0,), (2,), FILE, (0, 50), None, [7], 3, ["stream.zstd/1"]),
        ChunkEntry((2,), (2,), FILE, (50, 50), None, [8], 4, ["stream.zstd/1"]),
    ]
    text, index = written(m, tmp_path)  # `Manifest.indexed`: checksums with their rows
    assert json.loads(text)["tensors"]["t"]["transforms"] == [["stream.zstd/1"]]
    width = 13 + (version - 4)
    rows = np.frombuffer(index[: 2 * width * 8], dtype="<i8").reshape(2, width).tolist()
    assert rows == [
        [0, 2, -1, 0, 0, 0, 0, 50, -1, -1, 3, 1, 0, -1][:width],
        [2, 2, -1, 0, 0, 0, 50, 50, -1, -1, 4, 1, 0, -1][:width],
    ]
    assert np.frombuffer(index[2 * width * 8 :], dtype="<u4").tolist() == [7, 8]
    assert Manifest.read(tmp_path).tensors == m.tensors


IMPOSSIBLE = "a chunk row holds an impossible value"
SIZES = "chunk at offsets (4, 0) of 'model.w' has inconsistent"
CRAFTED = {  # of either version: (row, column, value, message)
    "negative": (1, 0, -2, IMPOSSIBLE),
    "too-big": (1, 10, 1 << 62, IMPOSSIBLE),
    "token-over-48-bits": (0, 8, 1 << 48, "chunk row 0 holds an impossible value"),
    "transform-unknown": (0, 15, 0, "chunk row 0 holds an impossible value"),  # none listed
    "payload-null-untransformed": (1, 11, -1, "chunk row 1 holds an impossible value"),
    "payload-length": (1, 12, 28, SIZES),
    "tile-too-large": (1, 4, 8, SIZES),
    "sizes-past-shape": (1, 2, 3, SIZES),
    "overlapping": (1, 0, 3, "'model.w' (shape (6, 4)) overlap in part at 3 along"),
    "missing-file": (1, 6, 5, "__5_0.sw000000000000.distcp is missing"),
    "record-past-the-file": (1, 10, 6000, "lie past the end of"),
}


FRAME = (0, 13, 1 << 32)  # a frame of 33 bits
COUNTED = {  # what each version's section holds, and how its rows count it
    "4-rows-past-the-section": (4, V4, CRCS, 3, "a section of 264 bytes cannot hold 3 chunk"),
    "5-rows-past-the-section": (5, ROWS[5], [], 3, "a section of 272 bytes cannot hold 3 chunk"),
    "4-a-checksum-too-many": (4, V4, CRCS + [0], -1, "its rows count 2 checksums, it holds 3"),
    "5-a-checksum-too-many": (5, ROWS[5], [0], -1, "its rows count 0 checksums, it holds 1"),
    "4-a-checksum-too-few": (4, row(4, 0, 14, 2), CRCS, -1, "rows count 3 checksums, it holds 2"),
    "5-a-checksum-too-few": (5, inline(ROWS[5]), [], -1, "rows count 1 checksums, it holds 0"),
    "4-frame-over-32-bits": (4, row(4, *FRAME), CRCS, -1, "chunk row 0 holds an impossible"),
    "5-frame-over-32-bits": (5, inline(row(5, *FRAME)), CRCS[:1], -1, "chunk row 0 holds an"),
    "5-a-frame-with-crc_at": (5, row(5, 0, 13, 1), [], -1, IMPOSSIBLE),  # kept in the file
    "5-crc_at-below--1": (5, row(5, 1, 16, -2), [], -1, IMPOSSIBLE),
    "5-crc_at-too-big": (5, row(5, 1, 16, 1 << 62), [], -1, IMPOSSIBLE),
}


COUNTED |= {  # the row values either version refuses
    f"{v}-{name}": (v, row(v, i, column, value), INLINE_CRCS[v], -1, message)
    for v in (4, 5)
    for name, (i, column, value, message) in CRAFTED.items()
}


@pytest.mark.parametrize("version, rows, crcs, count, message", COUNTED.values(), ids=COUNTED)
def test_a_crafted_section_is_refused(tmp_path, version, rows, crcs, count, message):
    folder = crafted(tmp_path, rows, crcs, count, version)
    Manifest.read_head(open_folder(folder))  # the head alone is sound
    with pytest.raises(swc.CorruptCheckpointError) as info:
        Manifest.read(folder)
    assert message in str(info.value)


@pytest.mark.parametrize("version", [4, 5])
def test_the_crafted_golden_section_reads(tmp_path, version):
    m = Manifest.read(crafted(tmp_path, ROWS[version], INLINE_CRCS[version], -1, version))
    assert m.tensors["model.w"].chunks == golden_chunks()["model.w"].chunks
    # a row may hold its checksums itself in version 5 too (`Manifest.indexed` writes so)
    m = Manifest.read(crafted(tmp_path / "inline", inline(ROWS[5]), CRCS[:1]))
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
    with pytest.raises(swc.CorruptCheckpointError, match=r"sections up to byte 472 of .* \(471"):
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
        (("tensors", "model.w", "section"), [1, 0, 272, 2, 0], "'model.w' names block 1 of"),
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
    folder = crafted(tmp_path, ROWS[5][:1], [])
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
    data.write_bytes(data.read_bytes()[:-1])  # the last chunk's checksums cut short
    with pytest.raises(swc.CorruptCheckpointError) as info:
        Manifest.read(tmp_path)
    assert str(info.value) == (
        f"{tmp_path / m.index.file} 'model.scale': chunk checksums at bytes 6377..6385 of data "
        f"file {data} (6384 bytes) lie past its end"
    )
    data.unlink()
    with pytest.raises(swc.CorruptCheckpointError, match=rf"data file .*{data.name} is missing"):
        Manifest.read(tmp_path)
    (tmp_path / "shardwise.json").write_text("{")
    with pytest.raises(swc.CorruptCheckpointError, match="shardwise.json: unreadable manifest"):
        Manifest.read(tmp_path)


def test_a_version_4_checkpoint_still_loads_and_verifies(tmp_path):
    """The golden save with its index as version 4 wrote it: frames and checksums in the
    rows (the data file's checksum block then unread)."""
    save_golden(tmp_path)
    m = Manifest.read(tmp_path)  # version 5: the chunks' checksums from the data file
    assert m.index is not None and m.index.blocks == [0]
    m.version = 4
    (tmp_path / m.index.file).write_bytes(v4_sections(m.tensors))
    (tmp_path / "shardwise.json").write_text(m.to_json())
    again = Manifest.read(tmp_path)
    assert (again.version, again.tensors) == (4, m.tensors)
    assert [t.section[2] for t in again.tensors.values()] == [264, 108, 84]  # type: ignore[index]
    state = golden_state()
    target = {"model": {"w": torch.zeros(6, 4), "scale": torch.tensor(0.0, dtype=torch.float64)}}
    target["model"]["bias"] = torch.zeros(3, dtype=torch.bfloat16)
    swc.load(target, tmp_path)
    assert torch.equal(target["model"]["w"], torch.arange(24.0).reshape(6, 4))
    assert torch.equal(target["model"]["bias"], state["model"]["bias"].detach())
    assert torch.equal(target["model"]["scale"], state["model"]["scale"])
    assert swc.verify(tmp_path) == []


@pytest.mark.parametrize("version", [4, 5])
def test_many_small_tensors_round_trip_through_the_index(tmp_path, version):
    m = Manifest(world_size=1, version=version)
    m.storage_meta = {"checkpoint_id": None, "save_id": None, "modules": []}
    for i in range(500):
        m.tensors[f"layer.{i}.w"] = TensorEntry("float32", (4, i % 7))
        payload = (i * 200 + 100, 16 * (i % 7))
        chunk = ChunkEntry((0, 0), (4, i % 7), FILE, (i * 200, 200), payload, [i], 5)
        chunk.tile = (4, i % 7)
        m.tensors[f"layer.{i}.w"].chunks.append(chunk)
    text, index = written(m, tmp_path)
    assert len(index) == 500 * ((12 + version) * 8 + 4)  # each row and its checksum
    head = Manifest.from_json(text)
    assert [t.section for t in head.tensors.values()] == [t.section for t in m.tensors.values()]
    assert Manifest.read(tmp_path) == m
