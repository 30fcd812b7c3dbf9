"""DCP's view of a manifest (`format.manifest`): the `Metadata` stock readers and `Reader` plan
from, built from the manifest alone, each chunk's storage info carrying its byte ranges and
checksums."""

from __future__ import annotations

from pathlib import Path

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from shardwise.checkpoint.format.manifest import (
    ChunkEntry,
    Manifest,
    ObjectEntry,
    StoredChunk,
    StoredObject,
    TensorEntry,
    metadata_of,
)

DATA = "__0_0.sw0123456789ab.distcp"


def _tiny() -> Manifest:
    """A tensor in two chunks (one tiled, one transformed), a 0-d tensor, an object."""
    m = Manifest(world_size=2, dcp_version="1.0.0")
    m.storage_meta = {"checkpoint_id": "/ckpt/step_1", "save_id": "s1", "modules": ["torch"]}
    m.set_planner_data({"model.w": ("model", "w")})
    w = m.tensors["model.w"] = TensorEntry("bfloat16", (4, 3), requires_grad=True)
    w.chunks.append(ChunkEntry((0, 0), (2, 3), DATA, (0, 900), (64, 12), [11], 5, None, (2, 3)))
    w.chunks.append(ChunkEntry((2, 0), (2, 3), DATA, (900, 300), None, [12], 0, ["stream.zstd/1"]))
    s = m.tensors["scale"] = TensorEntry("float64", ())
    s.chunks.append(ChunkEntry((), (), DATA, (1200, 800), (1264, 8), [13], 6, None, ()))
    m.objects["step"] = ObjectEntry(DATA, 2000, 40, 14)
    return m


def test_to_metadata_of_a_tiny_manifest_is_the_expected_metadata():
    expected = Metadata(
        state_dict_metadata={
            "model.w": TensorStorageMetadata(
                TensorProperties(dtype=torch.bfloat16, requires_grad=True),
                torch.Size([4, 3]),
                [
                    ChunkStorageMetadata(torch.Size([0, 0]), torch.Size([2, 3])),
                    ChunkStorageMetadata(torch.Size([2, 0]), torch.Size([2, 3])),
                ],
            ),
            "scale": TensorStorageMetadata(
                TensorProperties(dtype=torch.float64),
                torch.Size([]),
                [ChunkStorageMetadata(torch.Size([]), torch.Size([]))],
            ),
            "step": BytesStorageMetadata(),
        },
        planner_data={"model.w": ("model", "w")},
        storage_data={
            MetadataIndex("model.w", (0, 0)): StoredChunk(
                DATA, 0, 900, None, "bfloat16", (2, 3), (64, 12), [11], 1 << 20, (2, 3)
            ),
            MetadataIndex("model.w", (2, 0)): StoredChunk(
                DATA, 900, 300, ["stream.zstd/1"], "bfloat16", (2, 3), None, [12], 1 << 20, None
            ),
            MetadataIndex("scale", ()): StoredChunk(
                DATA, 1200, 800, None, "float64", (), (1264, 8), [13], 1 << 20, ()
            ),
            MetadataIndex("step"): StoredObject(DATA, 2000, 40, None, 14),
        },
        storage_meta=StorageMeta(
            checkpoint_id=Path("/ckpt/step_1"), save_id="s1", modules=["torch"]
        ),
        version="1.0.0",
    )
    got = _tiny().to_metadata()
    assert got == expected
    assert metadata_of(_tiny()) == expected
    # what the stock reader uses of a chunk: its file and record, by the chunk's index
    info = got.storage_data[MetadataIndex("model.w", torch.Size([2, 0]))]
    assert (info.relative_path, info.offset, info.length) == (DATA, 900, 300)
    assert info.transform_descriptors == ["stream.zstd/1"]


def test_a_manifest_without_storage_meta_gives_an_empty_one():
    m = Manifest(world_size=1)
    md = m.to_metadata()
    assert md.storage_meta == StorageMeta(checkpoint_id=None, save_id=None, modules=[])
    assert (md.state_dict_metadata, md.storage_data, md.planner_data, md.version) == (
        {},
        {},
        None,
        None,
    )


def test_pages_keep_the_manifests_page_size():
    m = _tiny()
    m.version, m.page_size = 2, 4096
    chunk = m.tensors["model.w"].chunks[0]
    assert StoredChunk.of(chunk, "bfloat16", m.page_size).page_size == 4096
    assert m.to_metadata().storage_data[MetadataIndex("model.w", (0, 0))].page_size == 4096
