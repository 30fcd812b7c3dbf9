"""The built-in handlers of aten ops on a `ShardedTensor`: copies, views, factories,
equality, and the functional collectives `LocalShardsWrapper` handles."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..tensor import ShardedTensor
from .exchange import local_in, replicated, whole
from .per_shard import named, per_shard, registrar
from .pointwise import pointwise

__all__ = ["BUILTIN_HANDLERS", "LIKE_OPS"]

aten = torch.ops.aten

BUILTIN_HANDLERS: dict[Any, Callable[[Any, tuple, dict], Any]] = {}


_handles = registrar(BUILTIN_HANDLERS)


_handles(
    aten.fill_.Scalar,
    aten.fill_.Tensor,
    aten.zero_.default,
    # elementwise, though not tagged pointwise
    aten.masked_fill.Scalar,
    aten.masked_fill.Tensor,
    aten.masked_fill_.Scalar,
    aten.masked_fill_.Tensor,
)(pointwise)


@_handles(aten.copy_.default)
def _copy(func: Any, args: tuple, kwargs: dict) -> Any:
    """Into a ShardedTensor from any layout (redistributed) or a plain tensor (each
    block its part); into a plain tensor from a ShardedTensor (gathered whole)."""
    dst, src = args[0], args[1]
    if not isinstance(dst, ShardedTensor):
        return dst.copy_(whole(src), *args[2:], **kwargs)
    if isinstance(src, ShardedTensor) and src._layout != dst._layout:
        if tuple(src.shape) != tuple(dst.shape):
            src = whole(src)
        else:
            src = dst._with_layout(dst._layout, local_in(src, dst._layout))
    per_shard(func, (dst, src, *args[2:]), kwargs)
    return dst


# -- shard-wise copies and factories --------------------------------------------


# factories that read only their operand's shape, dtype and device
LIKE_OPS = (
    aten.empty_like.default,
    aten.zeros_like.default,
    aten.ones_like.default,
    aten.full_like.default,
    aten.rand_like.default,
    aten.randn_like.default,
)


@_handles(
    aten.detach.default, aten.alias.default, aten.clone.default, aten._to_copy.default, *LIKE_OPS
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
    if size != tuple(ref.shape):  # another shape: a replicated tensor, made locally
        value = func(
            torch.empty((), dtype=ref.dtype, device=ref.device), list(size), *args[2:], **kwargs
        )
        return ref._with_layout(replicated(size, ref._layout.world_size), [value])
    shards = [func(s, list(s.shape), *args[2:], **kwargs) for s in ref._shards]
    return ref._with_shards(
        shards,
        dtype=kwargs.get("dtype") or ref.dtype,
        device=torch.device(kwargs["device"]) if kwargs.get("device") else ref.device,
    )


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
    shards = args[0]._shards
    if shards:
        rows = torch.cat([s.reshape(-1) for s in shards]).view(-1, *shards[0].shape[1:])
    else:
        rows = torch.empty(0, dtype=args[0].dtype, device=args[0].device)
    return func(rows, *args[1:], **kwargs)


@_handles(_c10d.wait_tensor.default)
def _wait_tensor(func: Any, args: tuple, kwargs: dict) -> ShardedTensor:
    for shard in args[0]._shards:
        func(shard)
    return args[0]


# -- losses, as the ops they are made of ---------------------------------------------


_REDUCTIONS = {0: None, 1: aten.mean.default, 2: aten.sum.default}


@_handles(aten.mse_loss.default)
def _mse_loss(func: Any, args: tuple, kwargs: dict) -> Any:
    """(input - target)², reduced: pointwise shard by shard, then one all-reduce."""
    a = named(func, args, kwargs)
    diff = aten.sub.Tensor(a["self"], a["target"])
    squares = aten.mul.Tensor(diff, diff)
    reduce = _REDUCTIONS[a["reduction"]]
    return squares if reduce is None else reduce(squares)


def _smooth(d: Any, beta: float, huber: bool) -> Any:
    """Smooth L1 (`huber`: Huber) of `d`, elementwise: quadratic within `beta` (delta)."""
    size = aten.abs.default(d)
    inside = aten.lt.Scalar(size, beta)
    if huber:
        quad = aten.mul.Tensor(aten.mul.Tensor(d, d), 0.5)
        lin = aten.mul.Tensor(aten.sub.Tensor(size, 0.5 * beta), beta)
    else:
        quad = aten.mul.Tensor(aten.mul.Tensor(d, d), 0.5 / beta) if beta else size
        lin = aten.sub.Tensor(size, 0.5 * beta)
    return aten.where.self(inside, quad, lin)


@_handles(aten.smooth_l1_loss.default, aten.huber_loss.default)
def _smooth_l1_loss(func: Any, args: tuple, kwargs: dict) -> Any:
    """Elementwise on the difference, shard by shard, then reduced as `mse_loss` is."""
    a = named(func, args, kwargs)
    huber = func is aten.huber_loss.default
    beta = a["delta"] if huber else a["beta"]
    losses = _smooth(aten.sub.Tensor(a["self"], a["target"]), beta, huber)
    reduce = _REDUCTIONS[a["reduction"]]
    return losses if reduce is None else reduce(losses)


@_handles(aten.smooth_l1_loss_backward.default, aten.huber_loss_backward.default)
def _smooth_l1_loss_backward(func: Any, args: tuple, kwargs: dict) -> Any:
    a = named(func, args, kwargs)
    huber = func is aten.huber_loss_backward.default
    beta = a["delta"] if huber else a["beta"]
    d = aten.sub.Tensor(a["self"], a["target"])
    inside = aten.lt.Scalar(aten.abs.default(d), beta)
    if huber:  # d within delta, else delta·sign(d)
        slope = aten.where.self(inside, d, aten.mul.Tensor(aten.sign.default(d), beta))
    else:  # d / beta within beta, else sign(d)
        within = aten.div.Tensor(d, beta) if beta else aten.sign.default(d)
        slope = aten.where.self(inside, within, aten.sign.default(d))
    if a["reduction"] == 1:
        slope = aten.mul.Tensor(slope, 1.0 / a["self"].numel())
    return aten.mul.Tensor(slope, a["grad_output"])


@_handles(aten.std_mean.correction, aten.var_mean.correction)
def _std_mean(func: Any, args: tuple, kwargs: dict) -> Any:
    """(std or var, mean): the two reductions, each by its own rule."""
    a = named(func, args, kwargs)
    spread = aten.std.correction if func is aten.std_mean.correction else aten.var.correction
    st, dim, keepdim = a["self"], a.get("dim"), a.get("keepdim", False)
    first = spread(st, dim, correction=a.get("correction"), keepdim=keepdim)
    mean = aten.mean.dim(st, dim, keepdim) if dim is not None else aten.mean.default(st)
    if dim is None and keepdim:
        mean = aten.view.default(mean, [1] * st.ndim)
    return first, mean


@_handles(aten.mse_loss_backward.default)
def _mse_loss_backward(func: Any, args: tuple, kwargs: dict) -> Any:
    a = named(func, args, kwargs)
    diff = aten.sub.Tensor(a["self"], a["target"])
    scale = 2.0 / a["self"].numel() if a["reduction"] == 1 else 2.0
    return aten.mul.Tensor(aten.mul.Tensor(diff, scale), a["grad_output"])
