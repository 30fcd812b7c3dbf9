"""DCP's `.metadata` and `shardwise.json` of a save, built straight from its plan.

`.metadata` names only files, offsets and lengths, all known from the plan
(`planning.place_records`) before any data is written, so any rank can build
it (`saving` has the last rank do it while rank 0 writes). The manifest also needs each
record's checksums, which only the writers know: it is built after they
report. Objects that repeat (tensor properties, like shapes) are shared, so
the pickle stays small and fast for 100,000 tensors.
"""

from __future__ import annotations

import math
import pickle
import re
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION, _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from ..format.manifest import Manifest, TensorEntry, seal
from ..format.manifest_fields import ChunkEntry, ObjectEntry
from .planning import Placement, SavePlan

__all__ = ["build_metadata", "manifest_skeleton", "manifest_text"]

# One record's checksums as its writer reports them: (tile shape or None, crcs, frame crc)
# for a tensor, (None, [], 0) for an object (its crc32c rides on the inventory).
Checksums = tuple[tuple[int, ...] | None, list[int], int]


def build_metadata(
    plan: SavePlan,
    placements: list[list[Placement]],
    files: list[str],
    checkpoint_id: Path | str,
    save_id: str,
) -> bytes:
    """The pickled DCP `Metadata` stock `dcp.load` reads: chunks in rank order."""
    sizes: dict[tuple[int, ...], torch.Size] = {}

    def size(t: tuple[int, ...]) -> torch.Size:
        s = sizes.get(t)
        if s is None:
            s = sizes[t] = torch.Size(t)
        return s

    # Like boxes share one ChunkStorageMetadata (pickled once, then by reference):
    # 10,000 tensors sharded alike have as many chunk objects as one of them.
    boxes: dict[tuple[tuple[int, ...], tuple[int, ...]], ChunkStorageMetadata] = {}
    properties: dict[tuple[str, bool], TensorProperties] = {}
    state: dict[str, Any] = {}
    storage: dict[MetadataIndex, _StorageInfo] = {}
    for key, t in plan.tensors.items():
        prop = properties.get((t.dtype, t.requires_grad))
        if prop is None:
            prop = properties[(t.dtype, t.requires_grad)] = TensorProperties(
                dtype=getattr(torch, t.dtype), requires_grad=t.requires_grad
            )
        chunks = []
        for i, (offsets, lengths, rank, position) in enumerate(t.chunks):
            chunk = boxes.get((offsets, lengths))
            if chunk is None:
                chunk = boxes[(offsets, lengths)] = ChunkStorageMetadata(
                    size(offsets), size(lengths)
                )
            chunks.append(chunk)
            place = placements[rank][position]
            index = MetadataIndex(key, None, i)
            # the shared torch.Size, as MetadataIndex.__init__ would store a copy of it:
            # pickled once and then by reference
            object.__setattr__(index, "offset", chunk.offsets)
            storage[index] = _StorageInfo(files[rank], place.offset, place.length)
        state[key] = TensorStorageMetadata(properties=prop, size=size(t.shape), chunks=chunks)
    for key, (rank, position) in plan.objects.items():
        state[key] = BytesStorageMetadata()
        place = placements[rank][position]
        storage[MetadataIndex(key)] = _StorageInfo(files[rank], place.offset, place.length)
    metadata = Metadata(
        state_dict_metadata=state,
        planner_data=plan.mappings,
        storage_data=storage,
        storage_meta=StorageMeta(checkpoint_id=checkpoint_id, save_id=save_id),
        version=CURRENT_DCP_VERSION,
    )
    return pickle.dumps(metadata, protocol=pickle.HIGHEST_PROTOCOL)


# What `manifest_skeleton` writes where a chunk's checksums go (one tile, crc 0, frame 0).
# Only structure matches it: quotes inside keys and names are escaped in JSON.
_CHUNK_CHECKSUMS = re.compile(r'"tile":\[[0-9,]*\],"tiles":\[0\],"frame":0\}')
_NO_METADATA_CRC = '"metadata_crc32c":0,'


def manifest_skeleton(
    plan: SavePlan,
    placements: list[list[Placement]],
    files: list[str],
    checkpoint_id: Path | str,
    save_id: str,
    object_crcs: dict[str, int],
) -> tuple[list[str], list[tuple[int, int]]]:
    """The text of the manifest of the same checkpoint, all but the checksums the
    writers report: rank 0 encodes it while the others finish. Returns the text
    cut where each chunk's checksums go, and the (rank, position in its writes)
    of each cut, in text order, for `manifest_text`."""
    manifest = Manifest(
        world_size=len(placements),
        storage_meta={"checkpoint_id": str(checkpoint_id), "save_id": save_id, "modules": []},
        dcp_version=CURRENT_DCP_VERSION,
    )
    manifest.set_planner_data(plan.mappings)
    cuts = []
    for key, t in plan.tensors.items():
        entry = manifest.tensors[key] = TensorEntry(t.dtype, t.shape, requires_grad=t.requires_grad)
        itemsize = getattr(torch, t.dtype).itemsize
        for offsets, lengths, rank, position in t.chunks:
            place = placements[rank][position]
            payload = (place.payload, math.prod(lengths) * itemsize)
            record = (place.offset, place.length)
            entry.chunks.append(
                ChunkEntry(offsets, lengths, files[rank], record, payload, [0], 0, None, lengths)
            )
            cuts.append((rank, position))
    for key, (rank, position) in plan.objects.items():
        place = placements[rank][position]
        manifest.objects[key] = ObjectEntry(
            files[rank], place.offset, place.length, object_crcs[key]
        )
    pieces = _CHUNK_CHECKSUMS.split(manifest.unsealed_json())
    if len(pieces) != len(cuts) + 1 or _NO_METADATA_CRC not in pieces[0]:
        raise AssertionError("manifest skeleton: checksum fields not where expected")
    return pieces, cuts


def manifest_text(
    pieces: list[str],
    cuts: list[tuple[int, int]],
    checksums: list[list[Checksums]],
    metadata_crc32c: int,
) -> str:
    """A `manifest_skeleton` completed with what each rank reported, sealed."""
    head = pieces[0].replace(_NO_METADATA_CRC, f'"metadata_crc32c":{metadata_crc32c},', 1)
    out = [head]
    for (rank, position), piece in zip(cuts, pieces[1:]):
        tile, crcs, frame = checksums[rank][position]
        assert tile is not None  # every chunk this engine writes has tiles
        out.append(
            f'"tile":[{",".join(map(str, tile))}],"tiles":[{",".join(map(str, crcs))}],'
            f'"frame":{frame}}}'
        )
        out.append(piece)
    return seal("".join(out))
