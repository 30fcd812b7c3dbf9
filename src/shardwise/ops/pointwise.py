"""Pointwise ops (every op tagged `torch.Tag.pointwise`, and `fill_`/`zero_`): shard by
shard, once the operands share a layout.

Operands in different layouts are brought to one first (`aligned`): a
replicated operand (a plain parameter promoted, a reduction's result) takes
its blocks locally, for free; another layout of the same shape is
redistributed (each element this rank lacks received once).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import tree_map

from ..tensor import ShardedTensor
from .exchange import is_replicated, local_in, whole
from .fallback import fallback
from .per_shard import is_inplace, per_shard, sharded_args, tensors_in, wrap

__all__ = ["aligned", "pointwise"]


def aligned(func: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
    """`args`/`kwargs` with every ShardedTensor in one layout, ready for `per_shard`; None
    when the result's shape is not one of the operands' (broadcasting up to a shape no
    sharded operand has), which `pointwise` leaves to the fallback.

    The layout is the first operand's for an in-place op, else the first non-replicated
    one of the result's shape. A replicated operand takes its blocks locally, another of
    the same shape is redistributed, a smaller sharded one (broadcast) is taken whole.
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
    if is_inplace(func):
        ref = sharded[0]
        if tuple(ref.shape) != shape:
            return None
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
            if tuple(x.shape) == tuple(ref.shape):
                converted[id(x)] = ref._with_layout(ref._layout, local_in(x, ref._layout))
            else:
                converted[id(x)] = whole(x)
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
        return fallback(func, args, kwargs)
    args, kwargs = ready
    results = per_shard(func, args, kwargs)
    if "out" in kwargs:
        return kwargs["out"]
    if is_inplace(func):
        return args[0]
    ref = next(x for x in sharded_args(args, kwargs))
    return wrap(func, ref, results, args, kwargs)
