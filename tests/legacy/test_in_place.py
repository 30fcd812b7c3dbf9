"""What an in-place `reshard` and a layout learned late must not break.

An in-place `reshard` changes a tensor's layout under the same Python object:
`async_save`'s staging cache (keyed on the tensor) must not reuse a copy staged
in the old layout, and the module-level `shardwise.legacy.reshard` must keep a
legacy tensor's spec. A tensor built by `from_local_blocks` on a rank holding
nothing must agree with the others on dtype when learned, on every rank alike.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.distributed._shard.sharding_spec import ChunkShardingSpec

import shardwise as sw
import shardwise.checkpoint as swc
from shardwise import Layout, ShardedTensor, legacy
from shardwise.testing import run_ranks

pytestmark = pytest.mark.spawned


def _specs(world: int) -> tuple[ChunkShardingSpec, ChunkShardingSpec]:
    ranks = list(range(world))
    return (
        ChunkShardingSpec(dim=0, placements=[f"rank:{r}/cpu" for r in ranks]),
        ChunkShardingSpec(dim=0, placements=[f"rank:{r}/cpu" for r in reversed(ranks)]),
    )


def _async_save_after_reshard(rank: int, world: int, root: str) -> list[bool]:
    warnings.simplefilter("ignore")
    first, swapped = _specs(world)
    full = torch.arange(16.0).reshape(4, 4)
    st = legacy.zeros(first, 4, 4)
    with torch.no_grad():
        for shard in st.local_shards():
            m = shard.metadata
            rows = slice(m.shard_offsets[0], m.shard_offsets[0] + m.shard_sizes[0])
            shard.tensor.copy_(full[rows])
    swc.async_save({"w": st}, f"{root}/a").result()
    # same shard shapes in the new layout: the staged buffers fit and are reused
    st.reshard(swapped)
    swc.async_save({"w": st}, f"{root}/b").result()
    seen = []
    for name in ("a", "b"):
        target = ShardedTensor.zeros(Layout.chunked((4, 4), 1, world))
        swc.load({"w": target}, f"{root}/{name}")
        seen.append(torch.equal(target.full_tensor(), full))
    return seen


def test_async_save_after_an_in_place_reshard_saves_the_new_layout(tmp_path):
    assert run_ranks(_async_save_after_reshard, 2, str(tmp_path), timeout=90) == [[True, True]] * 2


def _module_reshard(rank: int, world: int) -> tuple:
    warnings.simplefilter("ignore")
    first, swapped = _specs(world)
    st = legacy.full(first, (4, 4), float(rank + 1))
    out = legacy.reshard(st, swapped)
    shard = st.local_shards()[0]
    return (
        out is st,
        st.sharding_spec() == swapped,
        shard.tensor is st._shards[0],
        shard.metadata.shard_offsets,
        shard.tensor.tolist(),
    )


def test_module_level_reshard_keeps_a_legacy_tensors_spec():
    # rank r held rows [2r, 2r+2) filled with r + 1; after the swap each holds the other's
    got = run_ranks(_module_reshard, 2, timeout=60)
    assert got == [
        (True, True, True, [2, 0], [[2.0] * 4] * 2),
        (True, True, True, [0, 0], [[1.0] * 4] * 2),
    ]


def _empty_rank_dtype(rank: int, world: int, pass_dtype: bool) -> str:
    shards = [torch.ones(2, 3, dtype=torch.float64)] if rank == 0 else []
    offsets = [(0, 0)] if rank == 0 else []
    kwargs = {"dtype": torch.float64} if pass_dtype and rank == 1 else {}
    st = ShardedTensor.from_local_blocks(shards, offsets, (2, 3), **kwargs)
    try:
        total = st.full_tensor().sum().item()
    except sw.ShardwiseError as e:
        return f"{type(e).__name__}: {'pass dtype=' in str(e)}"
    return f"{st.dtype} {total}"


def test_a_rank_holding_nothing_must_agree_on_dtype_when_learned():
    assert run_ranks(_empty_rank_dtype, 2, True, timeout=60) == ["torch.float64 6.0"] * 2
    assert run_ranks(_empty_rank_dtype, 2, False, timeout=60) == ["ArgumentMismatchError: True"] * 2
