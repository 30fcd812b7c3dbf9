"""The `.metadata` unpickler: what DCP writers store loads; anything that would run code is refused."""

from __future__ import annotations

import io
import os
import pickle
from collections import OrderedDict
from pathlib import Path, PurePosixPath

import pytest
import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo, _StoragePrefix
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    BytesIOWriteData,
    LoadItemType,
    LoadPlan,
    ReadItem,
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)

from shardwise import ShardwiseError, UnsafeMetadataError
from shardwise.checkpoint.format.pickles import load_metadata

PROTOCOLS = [2, 4, 5]


def _tensor_item(
    fqn: str, offsets: tuple[int, ...], sizes: tuple[int, ...], kind: WriteItemType
) -> WriteItem:
    props = TensorProperties(dtype=torch.float8_e4m3fn, memory_format=torch.channels_last)
    chunk = ChunkStorageMetadata(torch.Size(offsets), torch.Size(sizes))
    return WriteItem(
        index=MetadataIndex(fqn, torch.Size(offsets), index=0),
        type=kind,
        tensor_data=TensorWriteData(chunk=chunk, properties=props, size=torch.Size([8, 4])),
    )


def megatron_metadata() -> Metadata:
    """Metadata as Megatron-Core 0.19 writes it: every rank's SavePlan in `all_local_plans`."""
    plans = [
        SavePlan(
            items=[
                _tensor_item("decoder.weight", (4 * rank, 0), (4, 4), WriteItemType.SHARD),
                _tensor_item("embedding", (0, 0), (8, 4), WriteItemType.TENSOR),
                WriteItem(
                    MetadataIndex("rng_state"),
                    WriteItemType.BYTE_IO,
                    bytes_io_data=BytesIOWriteData(12),
                ),
            ],
            storage_data=_StoragePrefix(f"__{rank}_"),
            planner_data={"decoder.weight": ("decoder", "weight")},
            usable=True,
        )
        for rank in range(2)
    ]
    md = Metadata(
        state_dict_metadata={
            "decoder.weight": TensorStorageMetadata(
                TensorProperties(dtype=torch.bfloat16, layout=torch.strided),
                torch.Size([8, 4]),
                [
                    ChunkStorageMetadata(torch.Size([0, 0]), torch.Size([4, 4])),
                    ChunkStorageMetadata(torch.Size([4, 0]), torch.Size([4, 4])),
                ],
            ),
            "rng_state": BytesStorageMetadata(),
        },
        planner_data={
            "decoder.weight": ("decoder", "weight"),
            "values": OrderedDict(
                s={1, 2},
                f=frozenset({"a"}),
                sl=slice(1, 9, 2),
                c=1 + 2j,
                b=b"\x00\xff",
                p=PurePosixPath("/x"),
            ),
        },
        storage_data={
            MetadataIndex("decoder.weight", torch.Size([0, 0])): _StorageInfo(
                "__0_0.distcp", 0, 96
            ),
            MetadataIndex("rng_state"): _StorageInfo("__1_0.distcp", 96, 12, ["zstd"]),
        },
        storage_meta=StorageMeta(
            checkpoint_id=Path("/ckpt/iter_0000030"), save_id="s1", modules=["torch"]
        ),
        version="1.0.0",
    )
    md.all_local_plans = plans
    md.mcore_data = {"decoder.weight": {"nd_reformulated_orig_global_shape": (2, 4, 4)}}
    md.planner_data["load"] = LoadPlan(
        [
            ReadItem(
                LoadItemType.TENSOR,
                MetadataIndex("embedding"),
                torch.Size([0, 0]),
                MetadataIndex("embedding", torch.Size([0, 0])),
                torch.Size([0, 0]),
                torch.Size([8, 4]),
            )
        ]
    )
    return md


@pytest.mark.parametrize("protocol", PROTOCOLS, ids=[f"protocol-{p}" for p in PROTOCOLS])
def test_megatron_metadata_with_save_plans_loads(protocol):
    md = megatron_metadata()
    loaded = load_metadata(io.BytesIO(pickle.dumps(md, protocol=protocol)))
    assert loaded == md
    assert loaded.all_local_plans == md.all_local_plans and loaded.mcore_data == md.mcore_data
    item = loaded.all_local_plans[1].items[0]
    assert (
        item.type is WriteItemType.SHARD
        and item.tensor_data.properties.memory_format == torch.channels_last
    )
    assert item.tensor_data.properties.dtype == torch.float8_e4m3fn
    assert type(loaded.storage_meta.checkpoint_id) is type(Path("/"))


# -- hostile pickles ---------------------------------------------------------------------


class _Reduce:
    """Pickles as a call of `fn(*args)`: what a hostile `__reduce__` looks like."""

    def __init__(self, fn, *args) -> None:
        self.fn, self.args = fn, args

    def __reduce__(self):
        return self.fn, self.args


def _nested_in_planner_data(victim: Path) -> bytes:
    md = megatron_metadata()
    md.all_local_plans[0] = SavePlan(
        items=[], planner_data={"x": [_Reduce(os.system, f"touch {victim}")]}
    )
    return pickle.dumps(md)


HOSTILE = {
    "os.system": lambda v: pickle.dumps(_Reduce(os.system, f"touch {v}")),
    "pathlib.Path.touch": lambda v: pickle.dumps(_Reduce(Path.touch, v), protocol=4),
    "pathlib.Path.touch, protocol 2": lambda v: pickle.dumps(_Reduce(Path.touch, v), protocol=2),
    "builtins.eval": lambda v: pickle.dumps(_Reduce(eval, f"open({str(v)!r}, 'w')")),
    "builtins.getattr": lambda v: pickle.dumps(_Reduce(getattr, Path(v), "touch")),
    "nested in planner_data": _nested_in_planner_data,
}


@pytest.mark.parametrize("case", HOSTILE)
def test_hostile_pickles_are_refused_and_run_nothing(case, tmp_path):
    victim = tmp_path / "pwned"
    payload = HOSTILE[case](victim)
    with pytest.raises(UnsafeMetadataError, match="refused global .* in the checkpoint metadata"):
        load_metadata(io.BytesIO(payload))
    assert not victim.exists()


# BUILD aimed at a shared object: a class, or an enum member, altered for the whole process.
_ALTER_CLASS = (
    b"\x80\x02ctorch.distributed.checkpoint.metadata\nMetadata\n"
    b"N}X\x05\x00\x00\x00pwnedK\x01s\x86b."  # BUILD (None, {"pwned": 1}) sets Metadata.pwned
)
_ALTER_MEMBER = (
    b"\x80\x02ctorch.distributed.checkpoint.planner\nWriteItemType\nK\x01\x85R"
    b"}X\x07\x00\x00\x00_value_Kcsb."  # BUILD {"_value_": 99} on WriteItemType.TENSOR
)


@pytest.mark.parametrize(
    "payload", [_ALTER_CLASS, _ALTER_MEMBER], ids=["class attribute", "enum member"]
)
def test_altering_a_shared_class_is_refused_and_undone(payload):
    with pytest.raises(UnsafeMetadataError, match="alters"):
        load_metadata(io.BytesIO(payload))
    assert not hasattr(Metadata, "pwned") and WriteItemType.TENSOR.value == 1


def test_the_refusal_says_what_and_where():
    with pytest.raises(
        pickle.UnpicklingError, match="refused global posix.system in the checkpoint metadata"
    ):
        load_metadata(io.BytesIO(pickle.dumps(_Reduce(os.system, "true"))))


def test_the_refusal_is_a_shardwise_error():
    with pytest.raises(ShardwiseError) as info:
        load_metadata(io.BytesIO(pickle.dumps(_Reduce(os.system, "true"))))
    assert type(info.value) is UnsafeMetadataError
