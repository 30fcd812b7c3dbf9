"""The op of last resort: run it on whole tensors, then come back sharded.

An aten op with no rule is never run on the shards as if they were the
tensor (that would be a silent wrong answer). Instead every ShardedTensor
operand is gathered whole on every rank (a replicated layout, which DTensor
expresses as `Replicate()`), the op runs on plain tensors as it would without
shardwise, and each tensor result comes back as a ShardedTensor: in the
layout of the first sharded operand of the same shape (taking this rank's
blocks, no communication), else replicated. An op that draws random numbers
runs on group rank 0 and is broadcast, so replicas stay identical.

Cost per rank: every sharded operand's whole size received (minus what the
rank holds), and the op's full compute. `shardwise.ops.FALLBACK_OPS` counts
what fell back, and each first use logs at DEBUG on `shardwise.ops`, so a
model that leans on it can be found and given rules.
"""

from __future__ import annotations

import collections
import logging
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_map

from ..tensor import ShardedTensor
from .exchange import broadcast, is_replicated, replicated, whole
from .per_shard import is_inplace, sharded_args

__all__ = ["FALLBACK_OPS", "fallback", "result_like"]

log = logging.getLogger("shardwise.ops")

# op -> how many times it ran through the fallback (in this process).
FALLBACK_OPS: collections.Counter[Any] = collections.Counter()


def result_like(
    value: torch.Tensor, sharded: list[ShardedTensor], *, copy: bool = True
) -> ShardedTensor:
    """A whole result, identical on every rank, as a ShardedTensor: the layout of the first
    operand of its shape (this rank's blocks of it), else replicated."""
    ref = sharded[0]
    shape = tuple(value.shape)
    for st in sharded:
        if tuple(st.shape) == shape:
            blocks = st._layout.blocks_of(st._rank)
            shards = [value[b.slices()] for b in blocks]
            if copy:
                shards = [s.clone() for s in shards]
            return st._with_layout(st._layout, shards, dtype=value.dtype, device=value.device)
    layout = replicated(shape, ref._layout.world_size)
    return ref._with_layout(layout, [value], dtype=value.dtype, device=value.device)


def fallback(func: Any, args: tuple, kwargs: dict) -> Any:
    """Run `func` on whole tensors on every rank; see the module docstring."""
    sharded = sharded_args(args, kwargs)
    if func not in FALLBACK_OPS:
        log.debug(
            "%s has no sharded rule: gathering %d operand(s) whole on every rank",
            func,
            len(sharded),
        )
    FALLBACK_OPS[func] += 1
    wholes: dict[int, torch.Tensor] = {}

    def whole_of(x: Any) -> Any:
        if isinstance(x, ShardedTensor):
            if id(x) not in wholes:
                wholes[id(x)] = whole(x)
            return wholes[id(x)]
        return x

    full_args, full_kwargs = tree_map(whole_of, (args, kwargs))
    out = func(*full_args, **full_kwargs)
    if torch.Tag.nondeterministic_seeded in func.tags:
        leaves, _ = tree_flatten(out)
        for leaf in leaves:
            if isinstance(leaf, torch.Tensor):
                broadcast(leaf, sharded[0])
    mutated = [
        (i, a)
        for i, a in enumerate(func._schema.arguments)
        if a.alias_info is not None and a.alias_info.is_write
    ]
    for i, _ in mutated:  # in-place and out= ops: write the whole result back into the shards
        target = args[i] if i < len(args) else kwargs.get(func._schema.arguments[i].name)
        if isinstance(target, ShardedTensor) and not is_replicated(target._layout):
            for shard, block in zip(target._shards, target._layout.blocks_of(target._rank)):
                shard.copy_(whole_of(target)[block.slices()])
    if is_inplace(func) or (mutated and "out" in kwargs):
        return args[0] if is_inplace(func) else kwargs["out"]

    def back(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return result_like(x, sharded)
        return x

    return tree_map(back, out)
