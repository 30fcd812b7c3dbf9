"""The one builder of a save's two records: `shardwise.json` and DCP's `.metadata`.

`save`, `Writer` and `reshard` describe what they stored as plain manifest
entries (each chunk's and object's place and checksums) and get both records
from here, so the two always describe the same checkpoint. A collective save's
entries carry no checksums: each chunk names where its writer keeps them in its
data file (`crc_at`, format version 5), so they are known from the places alone;
`Writer` and `reshard` fill the checksums in before `manifest` encodes them.
`.metadata` needs no checksums: it can be built as soon as the places are known.
Like objects are shared in its pickle (tensor properties, shapes, boxes), so it
stays small and fast at 100,000 tensors.
A collective save builds the records of each key on its owner (`key_owners`):
`part` encodes them there, `io.record_join` joins every owner's part.
"""

from __future__ import annotations

import math
import pickle
from collections.abc import Callable
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

from ..format.manifest import IndexRef, Manifest, ObjectEntry, TensorEntry
from ..format.manifest_fields import ChunkEntry
from ..format.manifest_index import write_sections
from ..format.record_parts import manifest_sections, metadata_sections
from ..format.tiles import tile_shape
from .places import Places
from .planning import SavePlan

__all__ = ["SaveRecords", "plan_records"]


class SaveRecords:
    """What a new checkpoint holds, as manifest entries: add them to `tensors` and
    `objects` (chunks in the order `.metadata` lists them), then build the records."""

    def __init__(self, world_size: int, storage_meta: StorageMeta, planner_data: Any) -> None:
        self.world_size = world_size
        self.storage_meta = storage_meta
        self.planner_data = planner_data  # DCP's: flattened key -> path, as its planner keeps
        self.tensors: dict[str, TensorEntry] = {}
        self.objects: dict[str, ObjectEntry] = {}
        self._draft: Manifest | None = None

    def draft(self) -> Manifest:
        """The manifest of these entries (the same objects: checksums filled later are
        in it), made once."""
        if self._draft is None:
            meta = self.storage_meta
            stored_meta = {
                "checkpoint_id": None if meta.checkpoint_id is None else str(meta.checkpoint_id),
                "save_id": meta.save_id,
                "modules": list(meta.modules),
            }
            self._draft = Manifest(
                world_size=self.world_size,
                tensors=self.tensors,
                objects=self.objects,
                storage_meta=stored_meta,
                dcp_version=CURRENT_DCP_VERSION,
            )
            self._draft.set_planner_data(self.planner_data)
        return self._draft

    def records(self, index_file: str) -> tuple[bytes, bytes, bytes]:
        """`.metadata`, `shardwise.json` (sealed) and the index file, to be written as
        `index_file` (a data file of the save) before the records are committed."""
        metadata = self.metadata()
        manifest, index = self.draft().indexed(index_file, metadata)
        return metadata, manifest, index

    def metadata(self) -> bytes:
        """The pickled DCP `Metadata` stock `dcp.load` reads."""
        state, storage = self._metadata_items()
        metadata = Metadata(
            state_dict_metadata=state,
            planner_data=self.planner_data,
            storage_data=storage,
            storage_meta=self.storage_meta,
            version=CURRENT_DCP_VERSION,
        )
        return pickle.dumps(metadata, protocol=pickle.HIGHEST_PROTOCOL)

    def part(self, planner_data: dict[str, Any], block: int) -> list[list[bytes]]:
        """These entries (an owner's keys) and their `planner_data` as a part of a
        collective save's records (`io.record_join.write_part`), in one batch, their
        chunk sections as block `block` of its index."""
        return [self.sections(planner_data, block, 0)]

    def sections(self, planner_data: dict[str, Any], block: int, at: int) -> list[bytes]:
        """These entries' seven sections of a part, a batch of it (`write_part`): their
        chunk sections placed from byte `at` of block `block` of the index."""
        state, storage = self._metadata_items()
        index = write_sections(self.tensors, block)
        for t in self.tensors.values():
            assert t.section is not None
            t.section = (block, t.section[1] + at, *t.section[2:])
        entries = Manifest(
            world_size=self.world_size,
            tensors=self.tensors,
            objects=self.objects,
            index=IndexRef("", []),  # the frame's: only the entries are encoded here
        )
        return (
            metadata_sections(state, planner_data, storage)
            + manifest_sections(entries, planner_data)
            + [index]
        )

    def _metadata_items(self) -> tuple[dict[str, Any], dict[MetadataIndex, _StorageInfo]]:
        """`.metadata`'s `state_dict_metadata` and `storage_data` of these entries."""
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
        for key, t in self.tensors.items():
            prop = properties.get((t.dtype, t.requires_grad))
            if prop is None:
                prop = properties[(t.dtype, t.requires_grad)] = TensorProperties(
                    dtype=getattr(torch, t.dtype), requires_grad=t.requires_grad
                )
            chunks = []
            for i, c in enumerate(t.chunks):
                chunk = boxes.get((c.offsets, c.sizes))
                if chunk is None:
                    chunk = boxes[(c.offsets, c.sizes)] = ChunkStorageMetadata(
                        size(c.offsets), size(c.sizes)
                    )
                chunks.append(chunk)
                index = MetadataIndex(key, None, i)
                # the shared torch.Size, as MetadataIndex.__init__ would store a copy of it:
                # pickled once and then by reference
                object.__setattr__(index, "offset", chunk.offsets)
                storage[index] = _StorageInfo(c.file, c.record[0], c.record[1], c.transform)
            state[key] = TensorStorageMetadata(properties=prop, size=size(t.shape), chunks=chunks)
        for key, o in self.objects.items():
            state[key] = BytesStorageMetadata()
            storage[MetadataIndex(key)] = _StorageInfo(o.file, o.offset, o.length, o.transform)
        return state, storage


def plan_records(
    plan: SavePlan,
    placements: list[Places],
    file_name: Callable[[int, int], str],
    storage_meta: StorageMeta,
    object_crcs: dict[str, int],
) -> SaveRecords:
    """The records of `plan`'s keys (an owner's share of a save, `key_owners`), all
    known from the plan and the places: each chunk's checksums are where its place
    says in its writer's file (`crc_at`, format version 5), its tiles those
    `tiles.tile_shape` picks. `file_name(rank, k)`: the name of a rank's k-th data file."""
    records = SaveRecords(len(placements), storage_meta, plan.mappings)
    itemsizes: dict[str, int] = {}
    tiles: dict[tuple[tuple[int, ...], int], tuple[int, ...]] = {}
    for key, t in plan.tensors.items():
        entry = records.tensors[key] = TensorEntry(t.dtype, t.shape, requires_grad=t.requires_grad)
        itemsize = itemsizes.get(t.dtype)
        if itemsize is None:
            itemsize = itemsizes[t.dtype] = getattr(torch, t.dtype).itemsize
        for offsets, lengths, rank, position in t.chunks:
            at, length, payload_at, file, crc_at = placements[rank].rows[position].tolist()
            tile = tiles.get((lengths, itemsize))
            if tile is None:
                tile = tiles[(lengths, itemsize)] = tile_shape(lengths, itemsize)
            payload = (payload_at, math.prod(lengths) * itemsize)
            name = file_name(rank, file)
            chunk = ChunkEntry(offsets, lengths, name, (at, length), payload, [], 0, None, tile)
            chunk.crc_at = crc_at
            entry.chunks.append(chunk)
    for key, (rank, position) in plan.objects.items():
        place = placements[rank][position]
        records.objects[key] = ObjectEntry(
            file_name(rank, place.file), place.offset, place.length, object_crcs[key]
        )
    return records
