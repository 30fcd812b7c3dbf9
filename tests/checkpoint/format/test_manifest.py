"""shardwise.json as a whole (`manifest`): the bytes the writer writes (golden files), what
the reader refuses across fields (format, version, checksum, geometry) and the data files it
checks. The field tables themselves: test_manifest_fields."""

from __future__ import annotations

import json
import re

import crc32c
import numpy as np
import pytest
import torch

import shardwise
import shardwise.checkpoint as swc
from shardwise.checkpoint.format.entries import INLINE
from shardwise.checkpoint.format.manifest import (
    READS,
    VERSION,
    ChunkEntry,
    IndexRef,
    Manifest,
    TensorEntry,
)

from .broken_fields import mutate, refused
from .golden_manifest import (
    CHECKPOINT_ID,
    DOC,
    FILE,
    INDEX_FILE,
    SAVE_ID,
    SOURCE,
    checksummed,
    compact,
    full_manifest,
    golden_chunks,
    golden_folder,
    golden_index,
    golden_text,
    minimal_manifest,
    normalised,
    save_golden,
    written,
)


def test_written_manifest_is_the_golden_one(tmp_path):
    save_golden(tmp_path / "step_100")
    head, index = normalised(tmp_path / "step_100")
    assert head == golden_text(), (
        "the manifest format changed: if on purpose, bump VERSION when old readers would "
        "misread it (docs/format.md, Versioning) and regenerate the golden file with "
        "`python -m tests.checkpoint.format.golden_manifest`"
    )
    # its sections: the chunks the version 3 golden lists, their checksums in the data file
    assert index == golden_index()
    m = Manifest.read(tmp_path / "step_100")  # the data file's checksums: the golden's
    v3 = golden_chunks()
    assert {k: [c.crcs for c in t.chunks] for k, t in m.tensors.items()} == {
        k: [c.crcs for c in t.chunks] for k, t in v3.items()
    }


@pytest.mark.parametrize("version", READS)
def test_golden_round_trips(version):
    text = golden_text(version)
    assert Manifest.from_json(text).to_json() == text


def test_golden_values(tmp_path):
    head = Manifest.from_json(golden_text())
    assert (head.version, head.world_size, head.dcp_version) == (5, 1, "1.0.0")
    assert (head.metadata_crc32c, head.metadata_tail) == (0, (0, 0))
    assert head.index == IndexRef(INDEX_FILE, [0])
    assert head.storage_meta == {"checkpoint_id": CHECKPOINT_ID, "save_id": SAVE_ID, "modules": []}
    assert head.decoded_planner_data() == {
        "model.w": ("model", "w"),
        "model.bias": ("model", "bias"),
        "model.scale": ("model", "scale"),
        "extra.step": ("extra", "step"),
    }
    # the head alone lists no chunk: each tensor's section of the index, back to back
    assert [(k, t.section[:4], t.chunks, t.transforms) for k, t in head.tensors.items()] == [
        ("model.w", (0, 0, 272, 2), [], []),  # 2 rows of 3 * 2 + 11 int64, no checksum
        ("model.bias", (0, 272, 112, 1), [], []),  # 1 row of 14 int64
        ("model.scale", (0, 384, 88, 1), [], []),  # 0-d: 1 row of 11 int64
    ]
    index = golden_index()
    assert len(index) == 472
    assert [t.section[4] for t in head.tensors.values()] == [
        crc32c.crc32c(index[:272]),
        crc32c.crc32c(index[272:384]),
        crc32c.crc32c(index[384:]),
    ]
    m = Manifest.read(golden_folder(tmp_path))  # the chunks, from the index
    w, bias, scale = m.tensors.values()
    assert (w.dtype, w.shape, w.requires_grad) == ("float32", (6, 4), False)
    assert [(c.offsets, c.sizes, c.payload) for c in w.chunks] == [
        ((0, 0), (4, 4), (448, 64)),
        ((4, 0), (2, 4), (1753, 32)),
    ]
    assert (bias.dtype, bias.shape, bias.requires_grad, bias.chunks[0].payload) == (
        "bfloat16",
        (3,),
        True,
        (3058, 6),
    )
    assert (scale.shape, scale.chunks[0].offsets, scale.chunks[0].payload) == ((), (), (4299, 8))
    # chunks of at most 256 KiB are one tile: crc32c of the payload, the elements in C order
    data = torch.arange(24, dtype=torch.float32).numpy().tobytes()
    assert [c.tile for c in w.chunks] == [(4, 4), (2, 4)]
    assert [c.crcs for c in w.chunks] == [[crc32c.crc32c(data[:64])], [crc32c.crc32c(data[64:])]]
    assert (bias.chunks[0].tile, scale.chunks[0].tile) == ((3,), ())
    step = m.objects["extra.step"]
    assert (step.file, step.length, step.transform) == (FILE, 1261, None)
    # one data file, its records back to back in save order, then the pickled object, then
    # each chunk's frame (0 here) and tile checksums, in record order: 4 x 2 uint32
    ranges = [c.record for t in (w, bias, scale) for c in t.chunks] + [(step.offset, 1261)]
    assert [start for start, _ in ranges] == [0, 1305, 2610, 3851, 5092]
    assert all(a + n == b for (a, n), (b, _) in zip(ranges, ranges[1:]))
    crcs = [c.crcs[0] for t in (w, bias, scale) for c in t.chunks]
    block = (tmp_path / FILE).read_bytes()[6353:]
    assert np.frombuffer(block, dtype="<u4").tolist() == [n for crc in crcs for n in (0, crc)]
    assert m.files() == {FILE, INDEX_FILE}


def test_the_golden_sections_decode_to_the_chunks_of_the_version_3_golden(tmp_path):
    m = Manifest.read(golden_folder(tmp_path))
    v3 = golden_chunks()
    assert [(k, t.chunks) for k, t in m.tensors.items()] == [(k, t.chunks) for k, t in v3.items()]
    assert [t.chunks[0].file for t in m.tensors.values()] == [FILE] * 3
    assert m.to_json() == golden_text()  # read whole, still written as the head


@pytest.mark.parametrize("version", READS)
def test_every_readable_version_has_a_golden_file_that_reads(version, tmp_path):
    m = Manifest.from_json(golden_text(version))
    assert m.version == version
    if version > INLINE:  # its chunks are in the index
        assert all(t.chunks == [] for t in m.tensors.values())
        m = Manifest.read(golden_folder(tmp_path, golden_text(version)))
    current = Manifest.read(golden_folder(tmp_path / "current"))
    if version == 1:  # before DCP's metadata was kept: defaults
        assert (m.storage_meta, m.planner_data, m.dcp_version) == ({}, None, None)
        assert m.tensors["model.bias"].requires_grad is False
        current.tensors["model.bias"].requires_grad = False
    for key, t in current.tensors.items():
        if version <= INLINE:  # no sections
            t.section = None
        elif version < VERSION:  # its own sections' layout (its text holds them, below)
            t.section = m.tensors[key].section
        for c in t.chunks:
            if version < 3:  # pages of 1 MiB: one each here, the same crc32c as the one tile
                c.tile = None
    if version < 3:
        assert m.page_size == 1 << 20
    assert m.tensors == current.tensors and m.objects == current.objects
    # an older manifest is written back in its own version, byte for byte
    assert m.to_json() == golden_text(version)


def _doc_example() -> str:
    (block,) = re.findall(r"```json\n(.*?)```", DOC.read_text(), re.DOTALL)
    return block


def test_doc_example_reads_with_the_real_reader(tmp_path):
    text = _doc_example()
    doc = json.loads(text)
    assert compact(doc) == golden_text()  # the example is what the writer writes
    head = Manifest.from_json(text)  # a head: dtype, shape and section of each tensor
    assert [len(t.section) for t in head.tensors.values()] == [5, 5, 5]
    assert all(t.chunks == [] for t in head.tensors.values())
    # with the golden index and data files beside it, the whole checkpoint reads
    m = Manifest.read(golden_folder(tmp_path, text))
    assert sum(len(t.chunks) for t in m.tensors.values()) == 4
    assert m.to_json() == compact(doc)


@pytest.mark.parametrize("version", [INLINE, 4, VERSION])
@pytest.mark.parametrize(
    "build", [full_manifest, minimal_manifest], ids=["all-optional-fields", "minimal"]
)
def test_round_trip_keeps_every_value(build, version, tmp_path):
    m = build(version)
    text, _ = written(m, tmp_path)
    again = Manifest.from_json(text) if version <= INLINE else Manifest.read(tmp_path)
    m.storage_meta = {"checkpoint_id": None, "save_id": None, "modules": []} | m.storage_meta
    assert again == m and again.decoded_planner_data() == m.decoded_planner_data()


@pytest.mark.parametrize(
    "version, reason",
    [
        (6, "format version 6 is not supported: this shardwise reads versions 1, 2, 3, 4, 5 (a"),
        (0, "format version 0 is not supported: this shardwise reads versions 1, 2, 3, 4, 5"),
        ("2", "format version '2' is not supported: this shardwise reads versions 1, 2, 3, 4, 5"),
    ],
)
def test_an_unknown_version_names_found_and_supported(version, reason):
    message = refused(mutate(json.loads(golden_text()), "top level", "version", version))
    assert f"field version: {reason}" in message
    assert ("a newer shardwise wrote it" in message) == (version == 6)


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
    doc = mutate(json.loads(golden_text(INLINE)), "chunk", name, value)
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
    doc = json.loads(golden_text(INLINE))
    chunk = doc["tensors"]["model.w"]["chunks"][0]  # sizes [4, 4]
    for tile, count in [([1, 4], 4), ([3, 3], 4), ([4, 1], 4), ([2, 3], 4), ([1, 1], 16)]:
        chunk["tile"], chunk["tiles"] = tile, list(range(count))
        got = Manifest.from_json(compact(checksummed(doc))).tensors["model.w"].chunks[0]
        assert (got.tile, got.crcs) == (tuple(tile), list(range(count)))
        chunk["tiles"] = list(range(count + 1))
        with pytest.raises(swc.CorruptCheckpointError, match="inconsistent"):
            Manifest.from_json(compact(checksummed(doc)), SOURCE)


def test_a_manifest_of_many_small_tensors_round_trips():
    m = Manifest(
        world_size=1,
        version=INLINE,
        storage_meta={"checkpoint_id": None, "save_id": None, "modules": []},
    )
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


def test_a_manifest_that_is_no_json_object_is_corrupt():
    with pytest.raises(shardwise.CorruptCheckpointError, match="src: .* not a JSON object"):
        Manifest.from_json(b"[1, 2]", "src")


def test_a_top_level_field_declared_after_the_frames_holes_is_refused_by_name():
    """A field added last in the top-level table would land inside the parts a
    collective save pours into the frame: refused when the table is checked (at
    import), naming the field and where to declare it, not a bare assert at save."""
    from shardwise.checkpoint.format.entries import POSITIVE, TOP, Field
    from shardwise.checkpoint.format.manifest import FRAME_TAIL, check_frame_order
    from shardwise.errors import InvalidArgumentError

    check_frame_order(TOP)  # the table as it is: fine
    late = Field("late", POSITIVE, "a field added last")
    with pytest.raises(InvalidArgumentError) as info:
        check_frame_order((*TOP, late))
    assert str(info.value) == (
        "the manifest's top-level field table must end with planner_data, planner_data_pickle, "
        "tensors, objects, crc32c (the holes the parts of a collective save fill, "
        "`format.manifest.manifest_frame`), but it ends with planner_data_pickle, tensors, "
        "objects, crc32c, late; declare 'late' before 'planner_data'"
    )
    assert FRAME_TAIL[-1] == TOP[-1].name
