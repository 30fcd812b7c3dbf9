"""Pointwise ops (every op tagged `torch.Tag.pointwise`, and `fill_`/`zero_`): shard by
shard, once the operands share a layout.

Operands in different layouts are brought to one first (`aligned`): a
replicated operand (a plain parameter promoted, a reduction's result) takes
its blocks locally, for free; another layout of the same shape is
redistributed (each element this rank lacks received once).

A sharded operand smaller than the result (broadcast: `x * scale[:, None]`,
`idx[:, None] == torch.arange(n)`) takes the blocks the result's need of it
(`_broadcast`): the result's layout is the first full-size operand's, or the
operand's own spread along the dims it broadcasts; each of the result's blocks
needs that block seen through the operand's shape (its size-1 dims whole),
which it holds already when laid out alike (a batch-sharded `[B, 1]` against a
batch-sharded `[B, D]`): nothing moves, where the rule used to gather it whole.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import tree_map

from ..errors import LayoutError
from ..layout import Block, Layout
from ..tensor import ShardedTensor
from .exchange import is_replicated, local_in, whole
from .fallback import fallback
from .per_shard import (
    empty_block,
    is_inplace,
    per_shard,
    result_meta,
    sharded_args,
    tensors_in,
    wrap,
)

__all__ = ["aligned", "pointwise"]


def aligned(func: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
    """`args`/`kwargs` with every ShardedTensor in one layout, ready for `per_shard`; None
    when the result's shape is not one of the operands' (broadcasting up to a shape no
    sharded operand has), which `pointwise` leaves to the fallback.

    The layout is the first operand's for an in-place op, else the first non-replicated
    one of the result's shape. A replicated operand takes its blocks locally, another of
    the same shape is redistributed; a smaller sharded one (broadcast) is `_broadcast`'s
    (None here).
    """
    found = tensors_in(args, kwargs)
    sharded = [x for x in found if isinstance(x, ShardedTensor)]
    shapes = [x.shape for x in found]
    # one shape (the common case): no broadcast to work out
    same = all(s == shapes[0] for s in shapes)
    shape = tuple(shapes[0] if same else torch.broadcast_shapes(*shapes))
    first = sharded[0]
    if tuple(first.shape) == shape and all(
        x._layout is first._layout and x._rank == first._rank for x in sharded
    ):  # one layout object: nothing to align (and a layout not learned yet stays so)
        return args, kwargs
    if any(tuple(x.shape) != shape for x in sharded):
        return None
    if is_inplace(func):
        ref = sharded[0]
    else:
        candidates = [x for x in sharded if tuple(x.shape) == shape]
        if not candidates:
            return None
        ref = next((x for x in candidates if not is_replicated(x._layout)), candidates[0])
    if all(x._layout == ref._layout and x._rank == ref._rank for x in sharded):
        return args, kwargs
    converted: dict[int, Any] = {}

    def convert(x: Any) -> Any:
        if not isinstance(x, ShardedTensor) or x._layout == ref._layout or x is ref:
            return x
        if id(x) not in converted:
            shards = local_in(x, ref._layout)
            converted[id(x)] = ref._with_layout(ref._layout, shards, dtype=x.dtype, device=x.device)
        return converted[id(x)]

    if is_inplace(func):
        return (args[0], *tree_map(convert, args[1:])), tree_map(convert, kwargs)
    return tree_map(convert, (args, kwargs))


def pointwise(func: Any, args: tuple, kwargs: dict) -> Any:
    if is_inplace(func) and not isinstance(args[0], ShardedTensor):
        raise NotImplementedError(
            f"{func} writes into a plain tensor from a ShardedTensor; that needs "
            f"communication: use st.full_tensor() first"
        )
    ready = aligned(func, args, kwargs)
    if ready is None:
        done = _broadcast(func, args, kwargs)
        return fallback(func, args, kwargs) if done is None else done
    args, kwargs = ready
    results = per_shard(func, args, kwargs)
    if "out" in kwargs:
        return kwargs["out"]
    if is_inplace(func):
        return args[0]
    ref = next(x for x in sharded_args(args, kwargs))
    return wrap(func, ref, results, args, kwargs)


# -- broadcasting: sharded operands smaller than the result ------------------------------


def _seen_as(layout: Layout, shape: tuple[int, ...]) -> Layout | None:
    """What each block of `layout` (the result's) needs of an operand of `shape`
    broadcast to it: the block with the operand's size-1 dims whole and its missing
    leading dims dropped (an empty block's image empty); None when `shape` does not
    broadcast, or when the images partly overlap (blocks not on a grid)."""
    full = layout.global_shape
    lead = len(full) - len(shape)
    if lead < 0:
        return None
    for d, n in enumerate(shape):
        if n not in (1, full[d + lead]):
            return None

    def image(b: Block) -> Block:
        keeps = [n == full[d + lead] for d, n in enumerate(shape)]
        offsets = tuple(b.offsets[d + lead] if k else 0 for d, k in enumerate(keeps))
        sizes = tuple(b.sizes[d + lead] if k else min(1, b.numel) for d, k in enumerate(keeps))
        return Block(offsets, sizes)

    blocks = {r: [image(b) for b in rank_blocks] for r, rank_blocks in enumerate(layout.blocks)}
    try:
        return Layout(shape, blocks, layout.world_size)
    except LayoutError:
        return None


def _spread(layout: Layout, shape: tuple[int, ...]) -> Layout:
    """`layout` of an operand broadcast to `shape`: each block whole along the dims the
    operand broadcasts (its size-1 ones and the new leading ones); an empty block stays
    empty (its box kept where a zero size survives the spread)."""
    own = layout.global_shape
    lead = len(shape) - len(own)

    def image(b: Block) -> Block:
        keeps = [own[d] == shape[d + lead] for d in range(len(own))]
        if b.is_empty() and not any(k and b.sizes[d] == 0 for d, k in enumerate(keeps)):
            return empty_block(len(shape))
        offsets = [0] * lead + [b.offsets[d] if k else 0 for d, k in enumerate(keeps)]
        sizes = list(shape[:lead]) + [
            b.sizes[d] if k else shape[d + lead] for d, k in enumerate(keeps)
        ]
        return Block(tuple(offsets), tuple(sizes))

    blocks = {r: [image(b) for b in rank_blocks] for r, rank_blocks in enumerate(layout.blocks)}
    return Layout(shape, blocks, layout.world_size)


def _broadcast(func: Any, args: tuple, kwargs: dict) -> Any:
    """`func` on operands some of which are sharded and smaller than the result (see the
    module's note), or None (the fallback's) when they do not broadcast so."""
    if "out" in kwargs:
        return None
    found = tensors_in(args, kwargs)
    sharded = [x for x in found if isinstance(x, ShardedTensor)]
    try:
        shape = tuple(torch.broadcast_shapes(*(x.shape for x in found)))
    except RuntimeError:
        return None  # torch's own error, from the fallback's run on whole tensors
    full_size = [x for x in sharded if tuple(x.shape) == shape]
    if is_inplace(func):
        if not full_size or full_size[0] is not args[0]:
            return None
        ref = args[0]
        out = ref._layout
    else:
        ref = next(
            (x for x in full_size if not is_replicated(x._layout)),
            next((x for x in sharded if not is_replicated(x._layout)), sharded[0]),
        )
        out = ref._layout if tuple(ref.shape) == shape else _spread(ref._layout, shape)
    if any(x._rank != ref._rank for x in sharded):
        return None
    shards: dict[int, list[torch.Tensor]] = {}
    wholes: dict[int, torch.Tensor] = {}  # operands whose blocks' images overlap: whole
    for x in sharded:
        if id(x) in shards or id(x) in wholes:
            continue
        need = out if tuple(x.shape) == shape else _seen_as(out, tuple(x.shape))
        if need is None:
            wholes[id(x)] = whole(x)
        else:
            shards[id(x)] = x._shards if x._layout == need else local_in(x, need)
    blocks = out.blocks_of(ref._rank)
    dtype, device = result_meta(func, args, kwargs)
    results = []
    for i, block in enumerate(blocks):
        if block.is_empty() and not is_inplace(func):  # nothing to compute
            results.append(torch.empty(block.sizes, dtype=dtype, device=device))
            continue

        def pick(x: Any, i: int = i, block: Block = block) -> Any:
            if isinstance(x, ShardedTensor):
                if id(x) in shards:
                    return shards[id(x)][i]
                x = wholes[id(x)]
            if isinstance(x, torch.Tensor) and x.dim() > 0:
                return x.expand(shape)[block.slices()]
            return x

        a, k = tree_map(pick, (args, kwargs))
        results.append(func(*a, **k))
    if is_inplace(func):
        return args[0]
    return ref._with_layout(out, results, dtype=dtype, device=device)
