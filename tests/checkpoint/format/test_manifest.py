"""shardwise.json as a whole (`manifest`): the bytes the writer writes (golden files), what
the reader refuses across fields (format, version, checksum, geometry) and the data files it
checks. The field tables themselves: test_manifest_fields."""

from __future__ import annotations

import json
import re

import crc32c
import pytest
import torch

import shardwise
import shardwise.checkpoint as swc
from shardwise.checkpoint.format.manifest import READS, ChunkEntry, Manifest, TensorEntry

from .golden_manifest import (
    CHECKPOINT_ID,
    DOC,
    FILE,
    SAVE_ID,
    SOURCE,
    checksummed,
    compact,
    full_manifest,
    golden_text,
    minimal_manifest,
    mutate,
    normalised,
    refused,
    save_golden,
)


def test_written_manifest_is_the_golden_one(tmp_path):
    save_golden(tmp_path / "step_100")
    assert normalised(tmp_path / "step_100") == golden_text(), (
        "the manifest format changed: if on purpose, bump VERSION when old readers would "
        "misread it (docs/format.md, Versioning) and regenerate the golden file with "
        "`python -m tests.checkpoint.format.golden_manifest`"
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


@pytest.mark.parametrize(
    "build", [full_manifest, minimal_manifest], ids=["all-optional-fields", "minimal"]
)
def test_round_trip_keeps_every_value(build):
    m = build()
    again = Manifest.from_json(m.to_json())
    m.storage_meta = {"checkpoint_id": None, "save_id": None, "modules": []} | m.storage_meta
    assert again == m and again.decoded_planner_data() == m.decoded_planner_data()


@pytest.mark.parametrize(
    "version, reason",
    [
        (4, "format version 4 is not supported: this shardwise reads versions 1, 2, 3 (a newer"),
        (0, "format version 0 is not supported: this shardwise reads versions 1, 2, 3"),
        ("2", "format version '2' is not supported: this shardwise reads versions 1, 2, 3"),
    ],
)
def test_an_unknown_version_names_found_and_supported(version, reason):
    message = refused(mutate(json.loads(golden_text()), "top level", "version", version))
    assert f"field version: {reason}" in message


def test_not_a_shardwise_manifest():
    message = refused({"format": "other", "version": 2})
    assert "field format: is 'other', not 'shardwise.checkpoint'" in message


def test_a_damaged_document_fails_its_checksum():
    doc = mutate(json.loads(golden_text()), "object", "offset", 1)  # crc32c left as it was
    assert "field crc32c: does not match the contents" in refused(doc, checksum=False)


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
    doc = mutate(json.loads(golden_text()), "chunk", name, value)
    with pytest.raises(swc.CorruptCheckpointError) as info:
        Manifest.from_json(compact(checksummed(doc)), SOURCE)
    assert str(info.value).startswith(f"{SOURCE}: chunk at offsets ") and "of 'model.w'" in str(
        info.value
    )


def test_cross_field_checks_of_pages_in_version_2():
    doc = mutate(json.loads(golden_text(2)), "chunk", "pages", [1, 2])  # one page per MiB
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


def test_a_manifest_that_is_no_json_object_is_corrupt():
    with pytest.raises(shardwise.CorruptCheckpointError, match="src: .* not a JSON object"):
        Manifest.from_json(b"[1, 2]", "src")
