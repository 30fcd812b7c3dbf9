"""The built-in handlers of aten ops on a `ShardedTensor`: copies, views, factories,
equality, and the functional collectives `LocalShardsWrapper` handles."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..errors import LayoutError
from ..tensor import ShardedTensor
from .per_shard import per_shard, pointwise

__all__ = ["BUILTIN_HANDLERS"]

aten = torch.ops.aten

BUILTIN_HANDLERS: dict[Any, Callable[[Any, tuple, dict], Any]] = {}


def _handles(*ops: Any) -> Callable[[Callable], Callable]:
    def register(fn: Callable) -> Callable:
        for op in ops:
            BUILTIN_HANDLERS[op] = fn
        return fn

    return register


_handles(aten.fill_.Scalar, aten.fill_.Tensor, aten.zero_.default)(pointwise)


@_handles(aten.copy_.default)
def _copy(func: Any, args: tuple, kwargs: dict) -> Any:
    dst, src = args[0], args[1]
    if not isinstance(dst, ShardedTensor):
        raise NotImplementedError(
            "copying a ShardedTensor into a plain tensor needs communication; "
            "use st.full_tensor() or st.gather()"
        )
    if isinstance(src, ShardedTensor) and src._layout != dst._layout:
        raise LayoutError(
            f"copy_ between different layouts ({src._layout} into {dst._layout}); "
            f"use src.redistribute(dst.layout_spec) first"
        )
    per_shard(func, args, kwargs)
    return dst


# -- shard-wise copies and factories --------------------------------------------


@_handles(
    aten.detach.default,
    aten.alias.default,
    aten.clone.default,
    aten._to_copy.default,
    aten.empty_like.default,
    aten.zeros_like.default,
    aten.ones_like.default,
    aten.full_like.default,
    aten.rand_like.default,
    aten.randn_like.default,
)
def _shardwise(func: Any, args: tuple, kwargs: dict) -> ShardedTensor:
    ref = args[0]
    results = per_shard(func, args, kwargs)
    if results:
        return ref._with_shards(results)
    return ref._with_shards(
        [],
        dtype=kwargs.get("dtype") or ref.dtype,
        device=torch.device(kwargs["device"]) if kwargs.get("device") else ref.device,
    )


@_handles(
    aten.new_empty.default, aten.new_zeros.default, aten.new_ones.default, aten.new_full.default
)
def _new_factory(func: Any, args: tuple, kwargs: dict) -> ShardedTensor:
    ref, size = args[0], tuple(args[1])
    if size != tuple(ref.shape):
        raise NotImplementedError(
            f"{func} with size {size} on a ShardedTensor of global shape "
            f"{tuple(ref.shape)}: only the same global shape keeps a layout"
        )
    shards = [func(s, list(s.shape), *args[2:], **kwargs) for s in ref._shards]
    return ref._with_shards(
        shards,
        dtype=kwargs.get("dtype") or ref.dtype,
        device=torch.device(kwargs["device"]) if kwargs.get("device") else ref.device,
    )


# -- views ---------------------------------------------------------------------


@_handles(
    aten.view.default, aten._unsafe_view.default, aten._reshape_alias.default, aten.reshape.default
)
def _view(func: Any, args: tuple, kwargs: dict) -> ShardedTensor:
    ref = args[0]
    shape = tuple(ref.shape)
    size = list(args[1])
    if size.count(-1) == 1 and ref.numel():
        known = 1
        for s in size:
            known *= s if s != -1 else 1
        size[size.index(-1)] = ref.numel() // known
    if tuple(size) != shape:
        raise NotImplementedError(
            f"{func} to {tuple(args[1])} on a ShardedTensor of global shape {shape}: "
            f"blocks do not survive a change of shape; only a view to the same "
            f"global shape is supported"
        )
    return ref._with_shards([s.view(s.shape) for s in ref._shards])


# -- comparisons -----------------------------------------------------------------


@_handles(aten.equal.default)
def _equal(func: Any, args: tuple, kwargs: dict) -> bool:
    """This rank's answer, no communication (as LocalShardsWrapper): shards and layouts."""
    a, b = args[0], args[1]
    if tuple(a.shape) != tuple(b.shape) or a.dtype != b.dtype:
        return False
    if isinstance(a, ShardedTensor) and isinstance(b, ShardedTensor):
        if a._layout != b._layout or a._rank != b._rank:
            return False
        return all(torch.equal(x, y) for x, y in zip(a._shards, b._shards))
    st, plain = (a, b) if isinstance(a, ShardedTensor) else (b, a)
    return all(
        torch.equal(shard, plain[block.slices()])
        for shard, block in zip(st._shards, st.local_blocks)
    )


@_handles(aten.is_same_size.default)
def _is_same_size(func: Any, args: tuple, kwargs: dict) -> bool:
    return tuple(args[0].shape) == tuple(args[1].shape)


# -- functional collectives, as LocalShardsWrapper handles them -------------------

_c10d = torch.ops._c10d_functional


@_handles(_c10d.all_gather_into_tensor.default)
def _all_gather_into_tensor(func: Any, args: tuple, kwargs: dict) -> torch.Tensor:
    """Gather this rank's shards, concatenated flat and viewed as rows of the
    first shard's trailing shape (LocalShardsWrapper's convention, in N-d)."""
    shards = args[0].local_shards()
    if shards:
        rows = torch.cat([s.reshape(-1) for s in shards]).view(-1, *shards[0].shape[1:])
    else:
        rows = torch.empty(0, dtype=args[0].dtype, device=args[0].device)
    return func(rows, *args[1:], **kwargs)


@_handles(_c10d.wait_tensor.default)
def _wait_tensor(func: Any, args: tuple, kwargs: dict) -> ShardedTensor:
    for shard in args[0].local_shards():
        func(shard)
    return args[0]
