"""Ops that work on each index of the leading dims alone: pooling, upsampling, attention,
group norm, and their backward; and batch norm, per channel.

`max_pool2d` pools each (sample, channel) plane on its own; `interpolate` resizes
each plane; `scaled_dot_product_attention` attends within each (batch, head);
`group_norm` normalises each sample. So where every block of the operands spans the
trailing dims the op works on (a batch-sharded activation, a head-sharded query),
each block's result is its own: the op runs per block, the results keep the
blocks' leading offsets, whole along their own trailing dims. No communication; a
weight gradient (`group_norm`'s) is a sum over the blocks, left pending until read.

Operands that share the leading dims must be laid out alike along them (the same
blocks in the same order on every rank, as autograd's saved tensors are); a plain
or replicated one is sliced per block. Anything else falls back. An op whose
arguments name the input's whole shape (`upsample_*_backward`'s `input_size`,
`group_norm`'s `N`) is called with the block's.

Per rank: O(B) for its B blocks; nothing sent but a pending weight gradient (2·W
bytes on first use, W its size).

Where the blocks split a spatial dim instead (a domain-parallel field), pooling and
upsampling by a whole factor exchange halo rows with the neighbours (`halo.py`), and
group norm reduces its statistics across ranks. Batch norm runs per block wherever the
blocks span the channels; in training its statistics are the whole batch's, two
all-reduces of C elements forward and one of 2·C backward.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from ..layout import Block, Layout
from ..tensor import ShardedTensor
from .exchange import (
    all_reduce,
    is_replicated,
    local_in,
    primary_blocks,
    replicated,
    whole_or_plain,
)
from .fallback import fallback
from .halo import (
    pool_args,
    pool_backward,
    pool_forward,
    pool_plan,
    sharded_spatial_dim,
    upsample_backward,
    upsample_factor,
    upsample_forward,
    upsample_input_layout,
    upsample_plan,
)
from .pending import later
from .per_shard import empty_block, named
from .reductions import _meta, spans

__all__ = ["BATCHED_HANDLERS"]

aten = torch.ops.aten

BATCHED_HANDLERS: dict[Any, Callable[[Any, tuple, dict], Any]] = {}


class _Spec(NamedTuple):
    """How an op's arguments relate to the leading dims."""

    batched: tuple[int, ...]  # positions of the tensors sharing the leading dims
    trailing: Callable[[tuple, ShardedTensor], int]  # trailing dims of the first one
    sizes: tuple[int, ...] = ()  # int lists naming the first one's whole shape
    counts: tuple[int, ...] = ()  # ints naming its first dim's size
    summed: tuple[int, ...] = ()  # outputs summed over the blocks (weight gradients)
    alike: tuple[int, ...] = ()  # outputs every block gives alike (empty statistics)


@functools.lru_cache(maxsize=4096)
def _leading(layout: Layout, lead: int) -> tuple[tuple[Any, ...], ...]:
    """Each rank's blocks along the leading dims, in order (None: an empty block)."""
    return tuple(
        tuple(None if b.is_empty() else (b.offsets[:lead], b.sizes[:lead]) for b in blocks)
        for blocks in layout.blocks
    )


@functools.lru_cache(maxsize=4096)
def _result_layout(layout: Layout, lead: int, shape: tuple[int, ...]) -> Layout:
    """`layout`'s blocks along the leading dims, whole along the result's trailing dims."""
    blocks = {
        r: [
            empty_block(len(shape))
            if b.is_empty()
            else Block(b.offsets[:lead] + (0,) * (len(shape) - lead), b.sizes[:lead] + shape[lead:])
            for b in rank_blocks
        ]
        for r, rank_blocks in enumerate(layout.blocks)
    }
    return Layout(shape, blocks, layout.world_size)


def _per_block(spec: _Spec) -> Callable[[Any, tuple, dict], Any]:
    def handler(func: Any, args: tuple, kwargs: dict) -> Any:
        first = args[spec.batched[0]]
        if not isinstance(first, ShardedTensor):
            return fallback(func, args, kwargs)
        lead = first.ndim - spec.trailing(args, first)
        if lead < 1 or not spans(first._layout, tuple(range(lead, first.ndim))):
            return fallback(func, args, kwargs)
        layout, rank = first._layout, first._rank
        blocks = layout.blocks_of(rank)
        head = tuple(first.shape[:lead])
        # each batched operand's tensor for each block
        per: dict[int, list[Any]] = {}
        for pos in spec.batched:
            x = args[pos] if pos < len(args) else None
            if x is None:
                continue
            if isinstance(x, ShardedTensor) and not is_replicated(x._layout):
                if (
                    x.ndim < lead
                    or tuple(x.shape[:lead]) != head
                    or _leading(x._layout, lead) != _leading(layout, lead)
                    or not spans(x._layout, tuple(range(lead, x.ndim)))
                ):
                    return fallback(func, args, kwargs)
                # contiguous, as the whole tensor torch's composite passes is (a block of a
                # transposed tensor is a strided view; `native_group_norm` refuses one)
                per[pos] = [shard.contiguous() for shard in x._shards]
            else:
                full = whole_or_plain(x)
                if tuple(full.shape[:lead]) != head:
                    return fallback(func, args, kwargs)
                per[pos] = [full[b.slices()[:lead]].contiguous() for b in blocks]
        kw = {}
        for name, v in kwargs.items():
            if isinstance(v, torch.Tensor):  # an attention mask: broadcast over the leading dims
                v = whole_or_plain(v)
                if any(n != 1 for n in v.shape[: max(v.ndim - (first.ndim - lead), 0)]):
                    return fallback(func, args, kwargs)
            kw[name] = v
        # the others (a weight, saved statistics) whole: per block they are all needed
        rest = [
            whole_or_plain(a) if isinstance(a, ShardedTensor) and pos not in per else a
            for pos, a in enumerate(args)
        ]
        meta = _meta(func, args, kwargs)
        metas = meta if isinstance(meta, (tuple, list)) else (meta,)
        results: list[list[torch.Tensor | None]] = [[] for _ in metas]
        for i, b in enumerate(blocks):
            if b.is_empty():  # nothing to run on: an empty result (a sum's zeros)
                for j, m in enumerate(metas):
                    if m is None or j in spec.alike:
                        results[j].append(None)
                        continue
                    shape = (0,) * m.ndim if j not in spec.summed else tuple(m.shape)
                    results[j].append(torch.zeros(shape, dtype=m.dtype, device=first.device))
                continue
            call = list(rest)
            for pos, shards in per.items():
                call[pos] = shards[i]
            for pos in spec.sizes:
                call[pos] = list(b.sizes[:lead]) + list(args[pos][lead:])
            for pos in spec.counts:
                call[pos] = b.sizes[0]
            out = func(*call, **kw)
            for j, o in enumerate(out if isinstance(out, (tuple, list)) else (out,)):
                results[j].append(o)
        mine = set(primary_blocks(layout, rank))
        outs: list[Any] = []
        for j, m in enumerate(metas):
            if m is None:
                outs.append(None)  # not asked for (`output_mask`)
                continue
            got = [r for r in results[j] if r is not None]  # with `m`, every block's
            if j in spec.alike:  # the same on every block and rank: replicated
                value = got[0] if got else torch.zeros(tuple(m.shape), dtype=m.dtype)
                whole_layout = replicated(tuple(m.shape), layout.world_size)
                outs.append(first._with_layout(whole_layout, [value.to(first.device)]))
                continue
            if j in spec.summed:
                part = torch.zeros(tuple(m.shape), dtype=m.dtype, device=first.device)
                for i in sorted(mine):
                    part = part + got[i]
                outs.append(later(part, "sum", first))
                continue
            if tuple(m.shape[:lead]) != head:
                return fallback(func, args, kwargs)
            out_layout = _result_layout(layout, lead, tuple(m.shape))
            outs.append(first._with_layout(out_layout, got, dtype=m.dtype, device=first.device))
        return type(meta)(outs) if isinstance(meta, (tuple, list)) else outs[0]

    return handler


def _spatial(n: int) -> Callable[[tuple, ShardedTensor], int]:
    return lambda args, first: n


def _output_size(pos: int) -> Callable[[tuple, ShardedTensor], int]:
    return lambda args, first: len(args[pos])


def _all_but_first(args: tuple, first: ShardedTensor) -> int:
    return first.ndim - 1


_SPECS: dict[Any, _Spec] = {
    # pooling: each (sample, channel) plane
    aten.max_pool2d_with_indices.default: _Spec((0,), _spatial(2)),
    aten.max_pool2d_with_indices_backward.default: _Spec((0, 1, 7), _spatial(2)),
    aten.max_pool3d_with_indices.default: _Spec((0,), _spatial(3)),
    aten.max_pool3d_with_indices_backward.default: _Spec((0, 1, 7), _spatial(3)),
    aten.avg_pool2d.default: _Spec((0,), _spatial(2)),
    aten.avg_pool2d_backward.default: _Spec((0, 1), _spatial(2)),
    aten.avg_pool3d.default: _Spec((0,), _spatial(3)),
    aten.avg_pool3d_backward.default: _Spec((0, 1), _spatial(3)),
    aten._adaptive_avg_pool2d.default: _Spec((0,), _spatial(2)),
    aten._adaptive_avg_pool2d_backward.default: _Spec((0, 1), _spatial(2)),
    aten._adaptive_avg_pool3d.default: _Spec((0,), _spatial(3)),
    aten._adaptive_avg_pool3d_backward.default: _Spec((0, 1), _spatial(3)),
    aten.adaptive_max_pool2d.default: _Spec((0,), _spatial(2)),
    aten.adaptive_max_pool2d_backward.default: _Spec((0, 1, 2), _spatial(2)),
    # upsampling: each plane; the backward names the input's whole shape
    aten.upsample_nearest1d.default: _Spec((0,), _output_size(1)),
    aten.upsample_nearest2d.default: _Spec((0,), _output_size(1)),
    aten.upsample_nearest3d.default: _Spec((0,), _output_size(1)),
    aten.upsample_linear1d.default: _Spec((0,), _output_size(1)),
    aten.upsample_bilinear2d.default: _Spec((0,), _output_size(1)),
    aten.upsample_bicubic2d.default: _Spec((0,), _output_size(1)),
    aten.upsample_trilinear3d.default: _Spec((0,), _output_size(1)),
    aten.upsample_nearest1d_backward.default: _Spec((0,), _output_size(1), sizes=(2,)),
    aten.upsample_nearest2d_backward.default: _Spec((0,), _output_size(1), sizes=(2,)),
    aten.upsample_nearest3d_backward.default: _Spec((0,), _output_size(1), sizes=(2,)),
    aten.upsample_linear1d_backward.default: _Spec((0,), _output_size(1), sizes=(2,)),
    aten.upsample_bilinear2d_backward.default: _Spec((0,), _output_size(1), sizes=(2,)),
    aten.upsample_bicubic2d_backward.default: _Spec((0,), _output_size(1), sizes=(2,)),
    aten.upsample_trilinear3d_backward.default: _Spec((0,), _output_size(1), sizes=(2,)),
    # attention: each (batch, head); the CPU kernel (CUDA's return RNG state besides)
    aten._scaled_dot_product_flash_attention_for_cpu.default: _Spec((0, 1, 2), _spatial(2)),
    aten._scaled_dot_product_flash_attention_for_cpu_backward.default: _Spec(
        (0, 1, 2, 3, 4, 5), _spatial(2)
    ),
    # group norm: each sample; the weight and bias gradients summed over the blocks
    aten.native_group_norm.default: _Spec((0,), _all_but_first, counts=(3,)),
    aten.native_group_norm_backward.default: _Spec(
        (0, 1, 2, 3), _all_but_first, counts=(5,), summed=(1, 2)
    ),
}

for _op, _spec in _SPECS.items():
    BATCHED_HANDLERS[_op] = _per_block(_spec)


# -- group norm along a split channel or spatial dim --------------------------------------
#
# Composed of aten ops on the ShardedTensors (each dispatched to its rule), as layer
# norm along a sharded dim is: the input viewed as [N, G, C/G, *spatial], the mean and
# variance of each (sample, group) reductions across ranks (one all-reduce of N·G
# elements each), everything else pointwise on the blocks; the backward's two means
# the same, the weight and bias gradients sums left pending. DTensor has no rule for
# it: it gathers the input.


def _group_norm_across(a: dict, meta: Any) -> Any:
    x, n, c, g = a["input"], a["N"], a["C"], a["group"]
    if not x.dtype.is_floating_point or not c or c % g or not a["HxW"]:
        return None
    grouped = [n, g, c // g, *x.shape[2:]]
    dims = list(range(2, len(grouped)))
    xg = aten.view.default(x, grouped)
    acc = _at_least_float(meta[1].dtype)  # torch's kernel computes in float, stores in its own
    if acc != x.dtype:
        xg = aten._to_copy.default(xg, dtype=acc)
    mean = aten.mean.dim(xg, dims, True)
    centred = aten.sub.Tensor(xg, mean)
    var = aten.mean.dim(aten.mul.Tensor(centred, centred), dims, True)
    rstd = aten.rsqrt.default(aten.add.Tensor(var, a["eps"]))
    out = aten.view.default(aten.mul.Tensor(centred, rstd), list(x.shape))
    channels = [1, c] + [1] * (x.ndim - 2)
    if a["weight"] is not None:
        out = aten.mul.Tensor(out, aten.view.default(whole_or_plain(a["weight"]), channels))
    if a["bias"] is not None:
        out = aten.add.Tensor(out, aten.view.default(whole_or_plain(a["bias"]), channels))
    if out.dtype != meta[0].dtype:
        out = aten._to_copy.default(out, dtype=meta[0].dtype)
    mean, rstd = aten.view.default(mean, [n, g]), aten.view.default(rstd, [n, g])
    if acc != meta[1].dtype:
        mean = aten._to_copy.default(mean, dtype=meta[1].dtype)
        rstd = aten._to_copy.default(rstd, dtype=meta[1].dtype)
    return out, mean, rstd


def _at_least_float(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def _group_norm_backward_across(a: dict, meta: Any) -> Any:
    x, grad, n, c, g = a["input"], a["grad_out"], a["N"], a["C"], a["group"]
    if not x.dtype.is_floating_point or not c or c % g or not a["HxW"]:
        return None
    grouped = [n, g, c // g, *x.shape[2:]]
    dims = list(range(2, len(grouped)))
    stats = [n, g] + [1] * (len(grouped) - 2)
    mean, rstd = aten.view.default(a["mean"], stats), aten.view.default(a["rstd"], stats)
    acc = _at_least_float(mean.dtype)
    if mean.dtype != acc:
        mean = aten._to_copy.default(mean, dtype=acc)
        rstd = aten._to_copy.default(rstd, dtype=acc)
    xg = aten.view.default(x, grouped)
    if acc != x.dtype:
        xg = aten._to_copy.default(xg, dtype=acc)
    if acc != grad.dtype:
        grad = aten._to_copy.default(grad, dtype=acc)
    xhat = aten.mul.Tensor(aten.sub.Tensor(xg, mean), rstd)
    channels = [1, c] + [1] * (x.ndim - 2)
    weight = whole_or_plain(a["weight"])
    mask = list(a["output_mask"])
    grad_in = grad_w = grad_b = None
    if mask[0]:
        gw = grad if weight is None else aten.mul.Tensor(grad, aten.view.default(weight, channels))
        gg = aten.view.default(gw, grouped)
        inner = aten.add.Tensor(
            aten.mean.dim(gg, dims, True),
            aten.mul.Tensor(xhat, aten.mean.dim(aten.mul.Tensor(gg, xhat), dims, True)),
        )
        grad_in = aten.view.default(
            aten.mul.Tensor(aten.sub.Tensor(gg, inner), rstd), list(x.shape)
        )
        if grad_in.dtype != meta[0].dtype:
            grad_in = aten._to_copy.default(grad_in, dtype=meta[0].dtype)
    others = [0, *range(2, x.ndim)]
    if mask[1]:
        product = aten.mul.Tensor(grad, aten.view.default(xhat, list(x.shape)))
        grad_w = aten.sum.dim_IntList(product, others, False)
        if grad_w.dtype != meta[1].dtype:
            grad_w = aten._to_copy.default(grad_w, dtype=meta[1].dtype)
    if mask[2]:
        grad_b = aten.sum.dim_IntList(grad, others, False)
        if grad_b.dtype != meta[2].dtype:
            grad_b = aten._to_copy.default(grad_b, dtype=meta[2].dtype)
    return grad_in, grad_w, grad_b


def _or_across(
    per_block: Callable[[Any, tuple, dict], Any], across: Callable[[dict, Any], Any]
) -> Callable[[Any, tuple, dict], Any]:
    """Per block where the blocks span every dim but the batch, else `across`."""

    def handler(func: Any, args: tuple, kwargs: dict) -> Any:
        a = named(func, args, kwargs)
        x = a["input"]
        if not isinstance(x, ShardedTensor) or spans(x._layout, tuple(range(1, x.ndim))):
            return per_block(func, args, kwargs)
        out = across(a, _meta(func, args, kwargs))
        return out if out is not None else fallback(func, args, kwargs)

    return handler


BATCHED_HANDLERS[aten.native_group_norm.default] = _or_across(
    BATCHED_HANDLERS[aten.native_group_norm.default], _group_norm_across
)
BATCHED_HANDLERS[aten.native_group_norm_backward.default] = _or_across(
    BATCHED_HANDLERS[aten.native_group_norm_backward.default], _group_norm_backward_across
)


# Pooling along a split spatial dim: the halo exchange convolutions use (`halo.py`).
_POOLS = {
    aten.max_pool2d_with_indices.default: 2,
    aten.max_pool3d_with_indices.default: 3,
    aten.avg_pool2d.default: 2,
    aten.avg_pool3d.default: 3,
}
_POOL_BACKWARDS = {
    aten.max_pool2d_with_indices_backward.default: 2,
    aten.max_pool3d_with_indices_backward.default: 3,
    aten.avg_pool2d_backward.default: 2,
    aten.avg_pool3d_backward.default: 3,
}


def _pool_or_halo(
    spatial: int, backward: bool, per_block: Callable[[Any, tuple, dict], Any]
) -> Callable[[Any, tuple, dict], Any]:
    """Per block where the blocks span the spatial dims, else a halo exchange along the
    one spatial dim they split (the fallback's where there is none)."""

    def handler(func: Any, args: tuple, kwargs: dict) -> Any:
        a = named(func, args, kwargs)
        x = a["self"]
        if not isinstance(x, ShardedTensor) or spans(x._layout, tuple(range(2, x.ndim))):
            return per_block(func, args, kwargs)
        if "avg" in func._schema.name and not x.dtype.is_floating_point:
            return per_block(func, args, kwargs)  # torch's error, on every rank
        g = pool_args(a, spatial)
        if backward:
            grad = a["grad_output"]
            plan = pool_plan(x, g, tuple(grad.shape))
            if plan is None or not isinstance(grad, ShardedTensor):
                return per_block(func, args, kwargs)
            return pool_backward(func, grad, x, a, g, plan)
        meta = _meta(func, args, kwargs)
        plan = pool_plan(x, g, tuple((meta[0] if isinstance(meta, tuple) else meta).shape))
        if plan is None:
            return per_block(func, args, kwargs)
        return pool_forward(func, x, a, g, plan, meta)

    return handler


# Upsampling by a whole factor along a split spatial dim: each block its own rows, with
# the rows a linear (1) or cubic (2) mode reads from each neighbour (`halo.py`).
_UPSAMPLES = {
    aten.upsample_nearest1d.default: 0,
    aten.upsample_nearest2d.default: 0,
    aten.upsample_nearest3d.default: 0,
    aten.upsample_linear1d.default: 1,
    aten.upsample_bilinear2d.default: 1,
    aten.upsample_trilinear3d.default: 1,
    aten.upsample_bicubic2d.default: 2,
}
_UPSAMPLE_BACKWARDS = {
    aten.upsample_nearest1d_backward.default: 0,
    aten.upsample_nearest2d_backward.default: 0,
    aten.upsample_nearest3d_backward.default: 0,
    aten.upsample_linear1d_backward.default: 1,
    aten.upsample_bilinear2d_backward.default: 1,
    aten.upsample_trilinear3d_backward.default: 1,
    aten.upsample_bicubic2d_backward.default: 2,
}


def _upsample_or_halo(
    halo: int, backward: bool, per_block: Callable[[Any, tuple, dict], Any]
) -> Callable[[Any, tuple, dict], Any]:
    """Per block where the blocks span the spatial dims, else each block its own rows
    along the one spatial dim they split (the per-block rule's, which falls back, where
    the map is not `r -> r·s` for a whole `s`)."""

    def handler(func: Any, args: tuple, kwargs: dict) -> Any:
        a = named(func, args, kwargs)
        x = a["grad_output"] if backward else a["self"]
        if not isinstance(x, ShardedTensor) or spans(x._layout, tuple(range(2, x.ndim))):
            return per_block(func, args, kwargs)
        dim = sharded_spatial_dim(x._layout)
        if dim is None:
            return per_block(func, args, kwargs)
        if backward:
            shape = tuple(a["input_size"])
            factor = upsample_factor(a, func, shape[dim], x.shape[dim], dim)
            layout = None if factor is None else upsample_input_layout(x, dim, factor, shape)
            plan = None if layout is None else upsample_plan(layout, dim, factor, halo)
            if plan is None or layout is None:
                return per_block(func, args, kwargs)
            return upsample_backward(func, x, a, layout, plan)
        meta = _meta(func, args, kwargs)
        factor = upsample_factor(a, func, x.shape[dim], meta.shape[dim], dim)
        plan = None if factor is None else upsample_plan(x._layout, dim, factor, halo)
        if plan is None:
            return per_block(func, args, kwargs)
        return upsample_forward(func, x, a, plan, meta)

    return handler


for _op, _n in _UPSAMPLES.items():
    BATCHED_HANDLERS[_op] = _upsample_or_halo(_n, False, BATCHED_HANDLERS[_op])
for _op, _n in _UPSAMPLE_BACKWARDS.items():
    BATCHED_HANDLERS[_op] = _upsample_or_halo(_n, True, BATCHED_HANDLERS[_op])
for _op, _n in _POOLS.items():
    BATCHED_HANDLERS[_op] = _pool_or_halo(_n, False, BATCHED_HANDLERS[_op])
for _op, _n in _POOL_BACKWARDS.items():
    BATCHED_HANDLERS[_op] = _pool_or_halo(_n, True, BATCHED_HANDLERS[_op])


# -- batch norm --------------------------------------------------------------------------
#
# Per channel, so per block wherever the blocks span the channels (any split of the
# samples or the spatial dims). In eval mode each element is normalised by the running
# statistics: nothing is sent but the weight and bias gradients, sums over the blocks
# left pending until read (2·C elements). In training the statistics are the whole
# batch's, as SyncBatchNorm's: each rank sums its primary blocks per channel, and the
# forward all-reduces the sums (C elements), then the squared deviations from the mean
# (C more: two passes, as exact as torch's); the backward all-reduces the two sums its
# formula needs (2·C). The running statistics, plain buffers on every rank, are updated
# alike on every rank. DTensor has no sharding rule for it: it gathers the batch.


def _batch_norm_operands(a: dict, names: tuple[str, ...]) -> tuple[Any, ...] | None:
    """(input, the channel shape to broadcast with, the named per-channel operands whole)
    where the input is a ShardedTensor whose blocks all span the channels, else None."""
    st = a["input"]
    if not isinstance(st, ShardedTensor) or st.ndim < 2 or not spans(st._layout, (1,)):
        return None
    others = []
    for name in names:
        x = a[name]
        if isinstance(x, ShardedTensor) and not is_replicated(x._layout):
            return None
        others.append(whole_or_plain(x) if isinstance(x, ShardedTensor) else x)
    shape = (1, st.shape[1]) + (1,) * (st.ndim - 2)
    return st, shape, others


def _channel_sums(
    st: ShardedTensor, parts: list[torch.Tensor], dims: list[int], dtype: torch.dtype
) -> torch.Tensor:
    """Per channel, the sum of `parts` (one per block of `st`) over this rank's primary
    blocks: this rank's addend of the whole batch's sum."""
    total = torch.zeros(st.shape[1], dtype=dtype, device=st.device)
    for i in primary_blocks(st._layout, st._rank):
        total += parts[i].sum(dims)
    return total


def _batch_norm(func: Any, args: tuple, kwargs: dict) -> Any:
    a = named(func, args, kwargs)
    found = _batch_norm_operands(a, ("weight", "bias", "running_mean", "running_var"))
    if found is None:
        return fallback(func, args, kwargs)
    st, shape, (weight, bias, running_mean, running_var) = found
    count = math.prod(st.shape) // st.shape[1] if st.shape[1] else 0
    training = a["training"]
    if (training and count < 2) or (not training and (running_mean is None or running_var is None)):
        return fallback(func, args, kwargs)  # torch's errors
    meta = _meta(func, args, kwargs)
    acc, dims = meta[1].dtype, [0, *range(2, st.ndim)]
    xs = [x.to(acc) for x in st._shards]
    if training:
        mean = all_reduce(_channel_sums(st, xs, dims, acc), dist.ReduceOp.SUM, st) / count
        deviations = [(x - mean.view(shape)).square() for x in xs]
        var = all_reduce(_channel_sums(st, deviations, dims, acc), dist.ReduceOp.SUM, st) / count
    else:
        mean, var = running_mean.to(acc), running_var.to(acc)
    invstd = (var + a["eps"]).rsqrt()
    outs = []
    for x in xs:
        y = (x - mean.view(shape)) * invstd.view(shape)
        if weight is not None:
            y = y * weight.view(shape)
        if bias is not None:
            y = y + bias.view(shape)
        outs.append(y.to(meta[0].dtype))
    out = st._with_layout(st._layout, outs, dtype=meta[0].dtype, device=st.device)
    if not training:  # what torch returns for the saved statistics in eval mode
        saved = [torch.zeros(m.shape, dtype=m.dtype, device=st.device) for m in meta[1:]]
        return out, *saved
    momentum = a["momentum"]
    with torch.no_grad():
        if running_mean is not None:
            running_mean.mul_(1 - momentum).add_(mean.to(running_mean.dtype), alpha=momentum)
        if running_var is not None:
            unbiased = (var * count / (count - 1)).to(running_var.dtype)
            running_var.mul_(1 - momentum).add_(unbiased, alpha=momentum)
    return out, mean, invstd


def _batch_norm_backward(func: Any, args: tuple, kwargs: dict) -> Any:
    a = named(func, args, kwargs)
    names = ("weight", "running_mean", "running_var", "save_mean", "save_invstd")
    found = _batch_norm_operands(a, names)
    if found is None:
        return fallback(func, args, kwargs)
    st, shape, (weight, running_mean, running_var, save_mean, save_invstd) = found
    training = a["train"]
    if training and (save_mean is None or save_invstd is None):
        return fallback(func, args, kwargs)
    if not training and (running_mean is None or running_var is None):
        return fallback(func, args, kwargs)
    grad = a["grad_out"]
    if isinstance(grad, ShardedTensor) and not is_replicated(grad._layout):
        if tuple(grad.shape) != tuple(st.shape):
            return fallback(func, args, kwargs)
        grads = list(local_in(grad, st._layout))  # the elements it lacks, if laid out otherwise
    else:
        g = whole_or_plain(grad)
        grads = [g[b.slices()] for b in st._layout.blocks_of(st._rank)]
    if training:
        acc, mean, invstd = save_mean.dtype, save_mean, save_invstd
    else:
        # at least float32, as the forward's statistics and torch's kernels
        acc = _at_least_float(torch.promote_types(running_var.dtype, st.dtype))
        mean, invstd = running_mean.to(acc), (running_var.to(acc) + a["eps"]).rsqrt()
    dims = [0, *range(2, st.ndim)]
    dys = [g.to(acc) for g in grads]
    xmus = [x.to(acc) - mean.view(shape) for x in st._shards]
    sum_dy = _channel_sums(st, dys, dims, acc)
    sum_dy_xmu = _channel_sums(st, [dy * xmu for dy, xmu in zip(dys, xmus)], dims, acc)
    count = math.prod(st.shape) // st.shape[1]
    if training:  # the whole batch's sums: grad_input needs them
        sums = all_reduce(torch.stack([sum_dy, sum_dy_xmu]), dist.ReduceOp.SUM, st)
        sum_dy, sum_dy_xmu = sums[0], sums[1]
    mask = list(a["output_mask"])
    grad_input = None
    if mask[0]:
        scale = (invstd if weight is None else invstd * weight.to(acc)).view(shape)
        if training:
            k = (sum_dy_xmu * invstd.square() / count).view(shape)
            mean_dy = (sum_dy / count).view(shape)
            shards = [((dy - mean_dy - xmu * k) * scale).to(st.dtype) for dy, xmu in zip(dys, xmus)]
        else:
            shards = [(dy * scale).to(st.dtype) for dy in dys]
        grad_input = st._with_layout(st._layout, shards, dtype=st.dtype, device=st.device)
    wdtype = weight.dtype if weight is not None else st.dtype
    outs: list[Any] = [grad_input]
    for wanted, value in ((mask[1], sum_dy_xmu * invstd), (mask[2], sum_dy)):
        if not wanted:
            outs.append(None)
        elif training:
            outs.append(value.to(wdtype))  # summed over the batch already
        else:
            outs.append(later(value.to(wdtype), "sum", st))  # this rank's addend
    return tuple(outs)


BATCHED_HANDLERS[aten.native_batch_norm.default] = _batch_norm
BATCHED_HANDLERS[aten.native_batch_norm_backward.default] = _batch_norm_backward
