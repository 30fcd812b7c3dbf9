"""A program written against the legacy `torch.distributed._shard.sharded_tensor` API.

`program(sharded_tensor, rank, world)` uses only the module object it is given (and
the sharding specs, which legacy users import from torch and keep importing from
torch after the swap), so the same code runs with
`from torch.distributed._shard import sharded_tensor` and with
`from shardwise import legacy as sharded_tensor` (docs/migrating.md's import swap).
It returns what it observed: tensors, shapes, metadata as plain tuples, and which
`except` clause caught each error, so the two runs can be compared value by value.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed._shard.sharding_spec import ChunkShardingSpec, EnumerableShardingSpec

SHAPE = (7, 6)
FULL = torch.arange(42, dtype=torch.float32).reshape(SHAPE)


def plain_metadata(md: Any) -> tuple:
    """A ShardedTensorMetadata as plain values (every shard, in its order)."""
    props = md.tensor_properties
    return (
        tuple(md.size),
        props.dtype,
        props.layout,
        props.requires_grad,
        props.pin_memory,
        tuple(
            (tuple(m.shard_offsets), tuple(m.shard_sizes), str(m.placement))
            for m in md.shards_metadata
        ),
    )


def plain_spec(spec: Any) -> tuple:
    """A ChunkShardingSpec / EnumerableShardingSpec as plain values."""
    if isinstance(spec, ChunkShardingSpec):
        return ("chunk", spec.dim, tuple(str(p) for p in spec.placements))
    return (
        type(spec).__name__,
        tuple(
            (tuple(m.shard_offsets), tuple(m.shard_sizes), str(m.placement)) for m in spec.shards
        ),
    )


def plain_shards(st: Any) -> tuple:
    """`st.local_shards()` as legacy code reads them: `.metadata` and `.tensor`."""
    return tuple(
        (
            type(s).__name__,
            tuple(s.metadata.shard_offsets),
            tuple(s.metadata.shard_sizes),
            str(s.metadata.placement),
            s.tensor.detach().clone(),
            s.tensor.requires_grad,
        )
        for s in st.local_shards()
    )


def block(offsets: list[int], sizes: list[int]) -> torch.Tensor:
    """FULL's block at `offsets` of `sizes` (a contiguous copy)."""
    rows, cols = offsets[0], offsets[1]
    return FULL[rows : rows + sizes[0], cols : cols + sizes[1]].clone()


def program(sharded_tensor: Any, rank: int, world: int) -> dict[str, Any]:
    warnings.simplefilter("ignore")  # the legacy API warns that it is deprecated
    out: dict[str, Any] = {}
    ranks = list(range(world))
    rows = ChunkShardingSpec(dim=0, placements=[f"rank:{r}/cpu" for r in ranks])
    cols = ChunkShardingSpec(dim=1, placements=[f"rank:{r}/cpu" for r in reversed(ranks)])

    # creation helpers, every keyword legacy takes
    st = sharded_tensor.zeros(
        rows,
        *SHAPE,
        dtype=torch.float32,
        layout=torch.strided,
        requires_grad=False,
        pin_memory=False,
        memory_format=torch.contiguous_format,
        process_group=None,
        init_rrefs=False,
    )
    out["isinstance"] = (
        isinstance(st, sharded_tensor.ShardedTensor),
        isinstance(st, torch.Tensor),
        type(st).__name__,
    )
    out["size"] = (tuple(st.size()), tuple(st.shape), st.dtype, st.dim(), st.requires_grad)
    for shard in st.local_shards():  # fill each shard from its metadata
        shard.tensor.copy_(block(shard.metadata.shard_offsets, shard.metadata.shard_sizes))
    out["local shards"] = plain_shards(st)
    out["local tensor"] = st.local_tensor().clone()
    out["metadata"] = plain_metadata(st.metadata())
    out["spec"] = (st.sharding_spec() == rows, plain_spec(st.sharding_spec()))

    dst = world - 1
    gathered = torch.full(SHAPE, -1.0) if rank == dst else None
    st.gather(dst, out=gathered)
    out["gather"] = gathered

    # reshard changes st in place; the program keeps using st
    st.reshard(cols)
    out["reshard spec"] = (st.sharding_spec() == cols, plain_spec(st.sharding_spec()))
    out["reshard metadata"] = plain_metadata(st.metadata())
    out["reshard local shards"] = plain_shards(st)
    back = torch.full(SHAPE, -1.0) if rank == 0 else None
    st.gather(0, out=back)
    out["gather after reshard"] = back

    # more creation helpers: dtypes, fill values, requires_grad
    f = sharded_tensor.full(rows, SHAPE, 3)
    o = sharded_tensor.ones(cols, SHAPE, dtype=torch.int32)
    e = sharded_tensor.empty(rows, list(SHAPE), dtype=torch.float64)
    g = sharded_tensor.ones(cols, 4, 6, requires_grad=True)
    z = sharded_tensor.zeros(rows, torch.Size([4, 6]))
    z.requires_grad_()
    out["full"] = (f.dtype, f.local_tensor().clone(), plain_metadata(f.metadata()))
    out["ones"] = (o.dtype, o.local_tensor().clone(), plain_metadata(o.metadata()))
    out["empty"] = (e.dtype, tuple(e.local_tensor().shape), plain_metadata(e.metadata()))
    out["requires_grad"] = tuple(
        (
            t.requires_grad,
            t.local_tensor().requires_grad,
            t.metadata().tensor_properties.requires_grad,
        )
        for t in (g, z)
    )

    # nn.init on a sharded weight, each rank's generator seeded
    torch.manual_seed(1000 + rank)
    w = sharded_tensor.empty(rows, 8, 5)
    torch.nn.init.uniform_(w, a=-0.5, b=0.5)
    out["uniform_"] = w.local_tensor().clone()
    torch.nn.init.normal_(w, mean=1.0, std=0.1)
    out["normal_"] = w.local_tensor().clone()
    torch.nn.init.kaiming_uniform_(w, a=math.sqrt(5))
    out["kaiming_uniform_"] = w.local_tensor().clone()
    torch.nn.init.constant_(w, 0.25)
    out["constant_"] = w.local_tensor().clone()
    out["rand"] = sharded_tensor.rand(cols, 5, 8, dtype=torch.float64).local_tensor().clone()

    # a tensor built from local shards (uneven rows: a rank may hold none)
    splits = {2: [2, 5], 3: [1, 6, 0]}[world]
    start = sum(splits[:rank])
    mine = []
    if splits[rank]:
        md = sharded_tensor.ShardMetadata([start, 0], [splits[rank], 6], f"rank:{rank}/cpu")
        mine = [sharded_tensor.Shard(block([start, 0], [splits[rank], 6]), md)]
    built = sharded_tensor.init_from_local_shards(mine, *SHAPE)
    out["init_from_local_shards"] = (
        plain_metadata(built.metadata()),
        plain_spec(built.sharding_spec()),
        plain_shards(built),
    )
    whole = torch.zeros(SHAPE) if rank == 0 else None
    built.gather(0, out=whole)
    out["init_from_local_shards gather"] = whole
    size = rows.build_metadata(torch.Size(SHAPE), built.metadata().tensor_properties)
    mine_md = [m for m in size.shards_metadata if m.placement.rank() == rank][0]
    local = block(mine_md.shard_offsets, mine_md.shard_sizes)
    from_local = sharded_tensor.ShardedTensor._init_from_local_tensor(local, rows, *SHAPE)
    out["_init_from_local_tensor"] = (
        plain_metadata(from_local.metadata()),
        from_local.sharding_spec() == rows,
        from_local.local_tensor().data_ptr() == local.data_ptr(),
    )

    # several shards on a rank: local_tensor() refuses, the program falls back
    enum = EnumerableShardingSpec(
        [
            sharded_tensor.ShardMetadata([0, 0], [3, 6], "rank:0/cpu"),
            sharded_tensor.ShardMetadata([3, 3], [4, 3], f"rank:{world - 1}/cpu"),
            sharded_tensor.ShardMetadata([3, 0], [4, 3], "rank:0/cpu"),
        ]
    )
    several = sharded_tensor.full(enum, SHAPE, float(rank + 1))
    try:
        flat = several.local_tensor().flatten().clone()
        how = "local_tensor"
    except NotImplementedError:
        flat = torch.cat([torch.zeros(0)] + [s.tensor.flatten() for s in several.local_shards()])
        how = "NotImplementedError"
    out["several shards"] = (how, flat)
    out["enumerable spec"] = (
        several.sharding_spec() == enum,
        plain_spec(several.sharding_spec()),
        plain_metadata(several.metadata()),
    )

    # ranks disagreeing on the dtype: every rank's `except ValueError` catches it
    dtype = torch.float32 if rank == 0 else torch.float64
    try:
        md = sharded_tensor.ShardMetadata([rank, 0], [1, 6], f"rank:{rank}/cpu")
        sharded_tensor.init_from_local_shards(
            [sharded_tensor.Shard(torch.zeros(1, 6, dtype=dtype), md)], world, 6
        )
        mismatch = "built"
    except ValueError:
        mismatch = "ValueError"
    out["dtype mismatch"] = mismatch

    # fewer local shards than the global metadata places here: `except RuntimeError`
    try:
        sharded_tensor.ShardedTensor._init_from_local_shards_and_global_metadata(
            [], sharded_tensor.zeros(rows, *SHAPE).metadata()
        )
        count = "built"
    except RuntimeError:
        count = "RuntimeError"
    out["shard count mismatch"] = count

    # a custom op with the legacy handler signature
    calls: list[int] = []

    @sharded_tensor.custom_sharded_op_impl(torch.nn.functional.linear)
    def sharded_linear(types, args, kwargs, process_group):
        x, weight = args[0], args[1]
        kwargs = kwargs or {}
        bias = kwargs.get("bias", args[2] if len(args) > 2 else None)
        calls.append(dist.get_world_size(process_group))
        shard = weight.local_shards()[0]
        pieces: list[Any] = [None] * dist.get_world_size(process_group)
        partial = x @ shard.tensor.t()
        dist.all_gather_object(
            pieces, (shard.metadata.shard_offsets[0], partial), group=process_group
        )
        y = torch.cat([p for _, p in sorted(pieces, key=lambda t: t[0])], dim=-1)
        return y if bias is None else y + bias

    weight = sharded_tensor.empty(rows, 7, 6)
    for shard in weight.local_shards():
        shard.tensor.copy_(block(shard.metadata.shard_offsets, shard.metadata.shard_sizes) / 10)
    x = torch.linspace(-1, 1, 12).reshape(2, 6)
    bias = torch.arange(7, dtype=torch.float32)
    y = torch.nn.functional.linear(x, weight, bias)
    out["custom op"] = (y, calls, torch.allclose(y, x @ (FULL / 10).t() + bias))

    # tensor ops legacy registers
    # (not torch.equal / allclose: legacy's need an accelerator even on gloo)
    like = torch.zeros_like(st)
    out["zeros_like"] = (plain_metadata(like.metadata()), like.local_tensor().clone())
    as64 = st.to(torch.float64)
    out["to"] = (as64.dtype, as64.local_tensor().clone(), plain_metadata(as64.metadata()))
    out["cpu"] = st.cpu() is st

    # state-dict hooks: a module holding a ShardedTensor as a plain attribute
    class Holder(torch.nn.Module):
        def __init__(self, value: Any) -> None:
            super().__init__()
            self.scale = torch.nn.Parameter(torch.full((2,), float(rank)))
            self.w = value

    source = Holder(st)
    source._register_state_dict_hook(sharded_tensor.state_dict_hook)
    state = source.state_dict()
    out["state_dict"] = (sorted(state), state["w"] is st, state["scale"].clone())
    target = Holder(sharded_tensor.zeros(cols, *SHAPE))
    target._register_load_state_dict_pre_hook(sharded_tensor.pre_load_state_dict_hook, True)
    try:
        target.load_state_dict(state)  # strict: "w" is no parameter
        strict = "loaded"
    except RuntimeError:
        strict = "RuntimeError"
    result = target.load_state_dict(state, strict=False)
    out["load_state_dict"] = (
        strict,
        sorted(result.missing_keys),
        sorted(result.unexpected_keys),
        target.w.local_tensor().clone(),
        # sorted: legacy's hook puts the loaded tensor itself in place (its shards listed
        # by rank after its reshard), shardwise's copies into the module's own tensor
        # (listed in its spec's order), a difference docs/migrating.md lists
        (*plain_metadata(target.w.metadata())[:5], sorted(plain_metadata(target.w.metadata())[5])),
        target.scale.detach().clone(),
    )
    return out
