"""The states `scale_threads` saves and loads: layouts per key, values from global indices.

A state is described once as `{key: (layout, dtype)}` and built per rank from
it, so W ranks share one `Layout` object per distinct layout (as W processes
would each hold an equal one) and the data stays tiny: the planning is what is
measured. Each element's value is a function of its tensor and global index, so
a loaded shard is checked bit for bit without keeping the saved state.
"""

from __future__ import annotations

from typing import Any

import torch

from shardwise import Block, Layout, ShardedTensor

__all__ = ["Spec", "build", "check", "fsdp", "targets", "torchrec"]

Spec = dict[str, tuple[Layout, torch.dtype]]

_BITS = {torch.bfloat16: torch.int16, torch.float32: torch.int32}
_ROWS_PER_RANK, _FSDP_COLS = 4, 8
_TABLES, _TABLE_ROWS, _TABLE_DIM = 200, 1000, 16


def values(block: Block, shape: tuple[int, ...], dtype: torch.dtype, salt: int) -> torch.Tensor:
    """The elements of `block` of tensor number `salt`: distinct finite values per index."""
    (r0, c0), (nr, nc) = block.offsets, block.sizes
    rows = torch.arange(r0, r0 + nr, dtype=torch.int64)[:, None] * shape[1]
    index = rows + torch.arange(c0, c0 + nc, dtype=torch.int64)[None, :] + 131 * salt
    if dtype == torch.bfloat16:  # bit patterns below 0x7F00: no inf or NaN
        return (index % 0x7F00).to(torch.int16).view(torch.bfloat16)
    return index.to(dtype)  # below 2**24: exact in float32


def fsdp(world: int, tensors: int, reshard: bool = False) -> Spec:
    """`tensors` bf16 tensors of (4W, 8) rows-sharded over all W ranks (4 rows each); the
    reshard target is column-wise over W/2 ranks, one column per block, each tensor's
    8 blocks on ranks rotated by its index so every rank loads some."""
    shape = (_ROWS_PER_RANK * world, _FSDP_COLS)
    if not reshard:
        rows = Layout.chunked(shape, 0, world)
        return {f"layer{i}.weight": (rows, torch.bfloat16) for i in range(tensors)}
    half = world // 2
    layouts: dict[tuple[int, ...], Layout] = {}
    spec: Spec = {}
    for i in range(tensors):
        ranks = tuple((_FSDP_COLS * i + j) % half for j in range(_FSDP_COLS))
        if ranks not in layouts:
            sizes = [1] * _FSDP_COLS
            layouts[ranks] = Layout.column_wise(shape, sizes, ranks=ranks, world_size=half)
        spec[f"layer{i}.weight"] = (layouts[ranks], torch.bfloat16)
    return spec


def _rows(shape: tuple[int, ...], i: int, world: int) -> Layout:
    """Uneven row blocks over all ranks, rank r weighted 1 + (r + i) % 3."""
    weights = [1 + (r + i) % 3 for r in range(world)]
    total, bounds, acc = sum(weights), [0], 0
    for w in weights:
        acc += w
        bounds.append(shape[0] * acc // total)
    return Layout.row_wise(shape, [b - a for a, b in zip(bounds, bounds[1:])])


def _columns(shape: tuple[int, ...], i: int, world: int) -> Layout:
    """Column blocks: two per rank where the columns allow, else one each on a
    subset of ranks starting at rank i."""
    n = min(shape[1], 2 * world)
    sizes = [shape[1] // n + (j < shape[1] % n) for j in range(n)]
    ranks = [(i + j) % world for j in range(n)]
    return Layout.column_wise(shape, sizes, ranks=ranks, world_size=world)


def torchrec(world: int, reshard: bool = False) -> Spec:
    """200 float32 tables of (1000 + i, 16): a third row-wise (uneven), a third
    column-wise, a third table-wise. The reshard target (W/2 ranks) swaps rows and
    columns and moves each whole table to another rank."""
    spec: Spec = {}
    for i in range(_TABLES):
        shape = (_TABLE_ROWS + i, _TABLE_DIM)
        kind = i % 3
        if reshard:
            kind = {0: 1, 1: 0, 2: 3}[kind]
        if kind == 0:
            layout = _rows(shape, i, world)
        elif kind == 1:
            layout = _columns(shape, i, world)
        else:
            owner = i % world if kind == 2 else (7 * i + 3) % world
            layout = Layout.table_wise(shape, owner, world)
        spec[f"tables.t{i}.weight"] = (layout, torch.float32)
    return spec


def build(spec: Spec, comm: Any, rank: int, fill: bool) -> dict[str, ShardedTensor]:
    """Rank `rank`'s state: shards holding their values (`fill`) or NaN (load targets)."""
    state = {}
    for salt, (key, (layout, dtype)) in enumerate(spec.items()):
        shape = layout.global_shape
        shards = [
            values(b, shape, dtype, salt) if fill else torch.full(b.sizes, torch.nan, dtype=dtype)
            for b in layout.blocks_of(rank)
        ]
        state[key] = ShardedTensor.from_layout(layout, shards, dtype=dtype, group=comm, rank=rank)
    return state


def targets(spec: Spec, comm: Any, rank: int) -> dict[str, ShardedTensor]:
    return build(spec, comm, rank, fill=False)


def check(spec: Spec, state: dict[str, ShardedTensor], rank: int) -> None:
    """Raise unless every loaded shard holds exactly the saved bits."""
    for salt, (key, (layout, dtype)) in enumerate(spec.items()):
        shards = state[key].local_shards()
        for block, shard in zip(layout.blocks_of(rank), shards, strict=True):
            want = values(block, layout.global_shape, dtype, salt)
            if not torch.equal(shard.view(_BITS[dtype]), want.view(_BITS[dtype])):
                raise AssertionError(f"rank {rank}: {key} block {block} differs after load")
