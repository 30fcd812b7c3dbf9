"""Stock `torch.distributed.checkpoint.save/load` accept ShardedTensors directly.

Saved on 2 ranks in one set of layouts, loaded on 3 ranks in others, and on 1
process into plain tensors: bit for bit each time.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import MetadataIndex

from shardwise import Block, Layout, ShardedTensor
from shardwise.testing import run_ranks, shard_of

pytestmark = pytest.mark.spawned

SHAPES = {
    "emb.row_uneven": (10, 6),
    "emb.columns": (5, 8),
    "emb.table": (4, 3),
    "dense.grid3d": (4, 6, 2),
    "bias": (6,),
    "step": (),
    "half": (6, 4),
}
DTYPES = {"half": torch.bfloat16}


def reference() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return {
        k: torch.randn(shape, generator=g).to(DTYPES.get(k, torch.float32))
        for k, shape in SHAPES.items()
    }


def save_layouts() -> dict[str, Layout]:  # 2 ranks
    return {
        "emb.row_uneven": Layout.row_wise((10, 6), [3, 7]),
        "emb.columns": Layout.column_wise((5, 8), [2, 2, 2, 2], ranks=[0, 1, 0, 1]),
        "emb.table": Layout.table_wise((4, 3), rank=1, world_size=2),  # rank 0 empty
        "dense.grid3d": Layout.grid((4, 6, 2), (1, 2, 1)),
        "bias": Layout.replicated((6,), 2),
        "step": Layout.replicated((), 2),
        "half": Layout.row_wise((6, 4), [0, 6]),
    }


def load_layouts() -> dict[str, Layout]:  # 3 ranks
    return {
        "emb.row_uneven": Layout.column_wise((10, 6), [1, 2, 3, 0], ranks=[0, 2, 2, 1]),
        "emb.columns": Layout.row_wise((5, 8), [2, 0, 3]),
        "emb.table": Layout.grid((4, 3), (3, 1), sizes=[[1, 1, 2], [3]]),
        "dense.grid3d": Layout.chunked((4, 6, 2), 2, 3),  # rank 2 holds nothing
        "bias": Layout.chunked((6,), 0, 3),
        "step": Layout.table_wise((), 2, 3),
        "half": Layout.replicated((6, 4), 3),
    }


def _sharded(layouts: dict[str, Layout], rank: int, fill: torch.Tensor | None = None):
    full = reference()
    out = {}
    for k, layout in layouts.items():
        if fill is None:
            shards = shard_of(full[k], layout, rank)
        else:
            shards = [
                torch.full(b.sizes, float("nan")).to(full[k].dtype) for b in layout.blocks_of(rank)
            ]
        out[k] = ShardedTensor.from_layout(layout, shards, dtype=full[k].dtype)
    return out


def _save(rank: int, world_size: int, path: str) -> None:
    state = _sharded(save_layouts(), rank)
    state["nested"] = {"note": f"saved by {world_size} ranks"}
    dcp.save(state, checkpoint_id=path)


def _load(rank: int, world_size: int, path: str) -> list[str]:
    full = reference()
    state = _sharded(load_layouts(), rank, fill=torch.tensor(0))
    state["nested"] = {"note": ""}
    dcp.load(state, checkpoint_id=path)
    wrong = []
    for k, st in state.items():
        if k == "nested":
            continue
        for shard, block in zip(st.local_shards(), st.local_blocks):
            if not torch.equal(shard, full[k][block.slices()]):
                wrong.append(f"rank {rank} {k} {block}")
    if state["nested"]["note"] != "saved by 2 ranks":
        wrong.append(f"rank {rank} nested note {state['nested']}")
    return wrong


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("dcp") / "ckpt")
    run_ranks(_save, 2, path, timeout=90)
    return path


def test_load_on_three_ranks_in_other_layouts(checkpoint):
    results = run_ranks(_load, 3, checkpoint, timeout=90)
    assert results == [[], [], []]


def test_load_in_one_process_into_plain_tensors(checkpoint):
    full = reference()
    state = {k: torch.full_like(v, float("nan")) for k, v in full.items()}
    state["nested"] = {"note": ""}
    dcp.load(state, checkpoint_id=checkpoint)
    for k, v in full.items():
        assert torch.equal(state[k], v), k
    assert state["nested"]["note"] == "saved by 2 ranks"


def test_metadata_is_stock(checkpoint):
    md = dcp.FileSystemReader(checkpoint).read_metadata()
    assert md.state_dict_metadata["emb.columns"].size == torch.Size([5, 8])
    chunks = md.state_dict_metadata["emb.columns"].chunks
    assert sorted(tuple(c.offsets) for c in chunks) == [(0, 0), (0, 2), (0, 4), (0, 6)]
    # replicas are written once
    assert len(md.state_dict_metadata["bias"].chunks) == 1


def test_load_in_one_process_into_sharded_tensor(checkpoint):
    full = reference()
    layout = Layout.column_wise((10, 6), [2, 2, 2], ranks=[0, 0, 0])
    st = ShardedTensor.zeros(layout)
    dcp.load({"emb.row_uneven": st}, checkpoint_id=checkpoint)
    assert torch.equal(st, full["emb.row_uneven"])


def test_hooks_directly():
    layout = Layout(
        (4, 4),
        {0: [Block((0, 0), (4, 0)), Block((0, 0), (4, 2))], 1: [Block((0, 2), (4, 2))]},
    )
    st = ShardedTensor.from_layout(layout, [torch.zeros(4, 0), torch.ones(4, 2)], rank=0)
    items = st.__create_write_items__("w", st)
    assert [tuple(i.index.offset) for i in items] == [(0, 0)]  # zero-size block skipped
    assert items[0].tensor_data.size == torch.Size([4, 4])
    assert len(st.__create_chunk_list__()) == 1
    found = st.__get_tensor_shard__(MetadataIndex("w", (0, 0), 0))  # stale hint: falls back
    assert found is st.local_shards()[1]
    with pytest.raises(ValueError, match="rank 0 holds no block at offsets \\(0, 2\\)"):
        st.__get_tensor_shard__(MetadataIndex("w", (0, 2)))


def test_hooks_take_a_containers_index_and_an_index_without_offsets():
    # Megatron's LocalShardsContainer passes each element its position (`index=`) and
    # may ask an element for its shard by an index without offsets
    layout = Layout((4, 4), {0: [Block((0, 2), (4, 2))], 1: [Block((0, 0), (4, 2))]})
    st = ShardedTensor.from_layout(layout, [torch.ones(4, 2)], rank=0)
    (item,) = st.__create_write_items__("w", st, index=3)
    assert (tuple(item.index.offset), item.index.index) == ((0, 2), 3)
    assert st.__get_tensor_shard__(MetadataIndex("w")) is st.local_shards()[0]
    two = Layout((4, 4), {0: [Block((0, 0), (4, 2)), Block((0, 2), (4, 2))]})
    both = ShardedTensor.from_layout(two, [torch.zeros(4, 2), torch.ones(4, 2)], rank=0)
    items = both.__create_write_items__("w", both, index=3)  # two blocks: their own positions
    assert [i.index.index for i in items] == [0, 1]
    assert both.__get_tensor_shard__(MetadataIndex("w", None, 1)) is both.local_shards()[1]
    with pytest.raises(ValueError) as info:
        both.__get_tensor_shard__(MetadataIndex("w"))
    assert str(info.value) == (
        "an index of 'w' without offsets names no block of rank 0: it holds 2 (its blocks: "
        f"{both.local_blocks[0]}, {both.local_blocks[1]})"
    )
