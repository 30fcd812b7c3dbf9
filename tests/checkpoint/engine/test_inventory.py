"""`inventory`: what a rank holds, for one save engine with no fallback.

A tensor type only DCP's own protocol describes (`__create_write_items__` /
`__get_tensor_shard__`) is described through it; a `Serialized` object is stored
as its own bytes. Both are saved by the engine and read back by stock `dcp.load`.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from shardwise import Layout, ShardedTensor
from shardwise.checkpoint.engine.inventory import Serialized, describe, serialize_objects
from shardwise.checkpoint.engine.save import save_state
from shardwise.checkpoint.format.manifest import Manifest
from shardwise.comm.agreement import Agreement

from ...comm.threaded_world import ThreadedWorld


class RowBlock(torch.Tensor):
    """Rows [offset, offset + len(local)) of a (4, 2) tensor, checkpointable only
    through DCP's tensor protocol (as upstream's CheckpointableDistTensor)."""

    @staticmethod
    def __new__(cls, local: torch.Tensor, offset: int) -> RowBlock:
        r = torch.Tensor._make_wrapper_subclass(cls, (4, 2), dtype=local.dtype)
        r._local, r._offsets = local, torch.Size([offset, 0])
        return r

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):  # type: ignore[override]
        raise NotImplementedError(f"{func} on RowBlock")

    def __create_write_items__(self, fqn: str, object: Any) -> list[WriteItem]:
        chunk = ChunkStorageMetadata(self._offsets, self._local.size())
        return [
            WriteItem(
                index=MetadataIndex(fqn, self._offsets),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk, TensorProperties.create_from_tensor(self._local), torch.Size((4, 2))
                ),
            )
        ]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        assert index.offset == self._offsets
        return self._local


FULL = torch.arange(8, dtype=torch.float32).reshape(4, 2)


def test_a_checkpointable_tensor_is_described_through_dcps_protocol() -> None:
    entries, held = describe({"w": RowBlock(FULL[2:], 2)}, {"w": ("w",)}, {})
    assert entries == [("w", None, "float32", (4, 2), False, (((2, 0), (2, 2)),))]
    assert torch.equal(held.tensor("w", 0), FULL[2:])


def test_tensors_are_found_again_by_box_and_like_boxes_are_one_tuple() -> None:
    """Plain tensors and ShardedTensors keep no pieces: each box's tensor is found in
    the state again; like shapes and boxes are one tuple, pickled once."""
    layout = Layout.row_wise((4, 2), [1, 3])
    flat = {
        f"s{i}": ShardedTensor.from_layout(layout, [FULL[1:] + i], rank=1) for i in range(3)
    } | {"p": FULL, "q": FULL + 1}
    entries, held = describe(flat, {k: (k,) for k in flat}, {})
    assert held.pieces == {}
    assert [e[5] for e in entries] == [(((1, 0), (3, 2)),)] * 3 + [(((0, 0), (4, 2)),)] * 2
    assert entries[0][5] is entries[1][5] is entries[2][5] and entries[3][5] is entries[4][5]
    assert all(e[3] is entries[0][3] for e in entries)  # (4, 2), one tuple
    assert torch.equal(held.tensor("s2", 0), FULL[1:] + 2)
    assert held.tensor("q", 0) is flat["q"]


def test_the_engine_saves_checkpointable_tensors_and_raw_bytes(tmp_path: Path) -> None:
    raw = io.BytesIO()
    torch.save(["megatron's", "common state"], raw)
    world = ThreadedWorld(2)

    def save(comm: Any) -> None:
        state = {"w": RowBlock(FULL[2 * comm.rank : 2 * comm.rank + 2], 2 * comm.rank)}
        state["common"] = Serialized(raw.getvalue())
        save_state(state, tmp_path, Agreement(comm, ("args", ())))

    assert world.run(save) == [None, None]
    target = {"w": torch.zeros(4, 2), "common": None}
    dcp.load(target, checkpoint_id=tmp_path, no_dist=True)
    assert torch.equal(target["w"], FULL)
    assert target["common"] == ["megatron's", "common state"]  # pickled once, not twice
    stored = Manifest.read(tmp_path).objects["common"]
    with open(tmp_path / stored.file, "rb") as f:
        f.seek(stored.offset)
        assert f.read(stored.length) == raw.getvalue()


def test_serialized_bytes_are_not_pickled_again() -> None:
    objects, problem = serialize_objects({"a": Serialized(b"as is"), "t": torch.ones(1)})
    assert (objects, problem) == ({"a": b"as is"}, None)
