"""In-place random fills (`torch.nn.init.*`): every shard drawn, replicas kept equal.

`uniform_`, `normal_` and the other in-place samplers run on each shard with
the rank's own generator (as the legacy ShardedTensor's `nn.init` did), so
the values differ from a draw of the whole tensor, as they do for any
sharded initialisation. A block held by several ranks is drawn by its first
holder and sent to the others (one `move` of the replica bytes), so
replicas never disagree. `kaiming_uniform_` and friends read the fan-in from
the global shape, as for the whole tensor.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from ..comm.transfer import move
from ..layout import Layout
from ..tensor import ShardedTensor
from .per_shard import per_shard

__all__ = ["RANDOM_HANDLERS"]

aten = torch.ops.aten


@functools.lru_cache(maxsize=1024)
def _first_holders(layout: Layout) -> Layout | None:
    """`layout` with each block on its first holder only; None when nothing is replicated."""
    if not layout.replica_groups:
        return None
    blocks = {
        r: [b for b in rank_blocks if layout.ranks_holding(b)[0] == r]
        for r, rank_blocks in enumerate(layout.blocks)
    }
    return Layout(layout.global_shape, blocks, layout.world_size)


def _fill(func: Any, args: tuple, kwargs: dict) -> ShardedTensor:
    st = args[0]
    first = _first_holders(st._layout)
    if first is None:
        per_shard(func, args, kwargs)
        return st
    own = [
        i
        for i, b in enumerate(st._layout.blocks_of(st._rank))
        if st._layout.ranks_holding(b)[0] == st._rank
    ]
    drawn = []
    for i in own:
        func(st._shards[i], *args[1:], **kwargs)
        drawn.append(st._shards[i])
    source = st._with_layout(first, drawn, dtype=st.dtype, device=st.device)
    for shard, value in zip(st._shards, move(source, st._layout, checked=True)):
        shard.copy_(value)
    return st


RANDOM_HANDLERS: dict[Any, Callable[[Any, tuple, dict], Any]] = {
    op: _fill
    for op in (
        aten.uniform_.default,
        aten.normal_.default,
        aten.bernoulli_.float,
        aten.exponential_.default,
        aten.cauchy_.default,
        aten.log_normal_.default,
        aten.geometric_.default,
        aten.random_.default,
        getattr(aten.random_, "from"),
        aten.random_.to,
    )
}
