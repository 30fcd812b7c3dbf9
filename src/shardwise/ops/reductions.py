"""Reductions and ops that work along dimensions: sums, extrema, norms, variances,
softmax, layer norm.

Two rules, chosen by where the dimensions an op works along lie:

- **Along unsharded dimensions** (every block spans them whole): each block
  computes on its own. The result keeps the blocks, projected onto the
  remaining dimensions (size 1 where `keepdim`). No communication.
- **Along a sharded dimension** (sums, means, extrema, norms, variances):
  each rank reduces the blocks it is the first holder of (so replicas count
  once) into a buffer of the result's shape, and one all-reduce over the
  group combines the buffers. For sums, means, extrema, `var` and the ∞-, 0-
  norms that all-reduce waits for the result's first use (`pending`, DTensor's
  `Partial`), so a loss that is only differentiated combines nothing; `std`
  and p-norms (a root of the combined value) and the variance's mean run it at
  once. The result is replicated: its layout says the value is whole on every
  rank. Bytes per rank: about 2× the result's size (a scalar for `x.sum()`),
  twice that for a variance (mean, then squares).

`softmax`, `log_softmax` and `logsumexp` along a sharded dimension are composed of
those reductions; `cumsum`, `cumprod` and `logcumsumexp` along one carry each
block's total over to the blocks after it (one all-to-all); `max(dim)` and
`argmax` along one take two all-reduces (the value, then its first index);
`topk` along one gathers each rank's k best. Anything else here (a sort along a
sharded dimension) goes to the fallback. Values
of sharded-dimension reductions equal torch's on the whole tensor up to
floating-point summation order.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_map

from ..comm.communicator import communicator
from ..layout import Block, Layout
from ..tensor import ShardedTensor
from .exchange import (
    _distributed,
    all_reduce,
    is_replicated,
    local_in,
    primary_blocks,
    replicated,
    whole_or_plain,
)
from .fallback import fallback
from .pending import later
from .per_shard import named, registrar, sharded_args

__all__ = ["REDUCTION_HANDLERS", "in_range", "project", "spans", "summed", "widened"]

aten = torch.ops.aten

REDUCTION_HANDLERS: dict[Any, Callable[[Any, tuple, dict], Any]] = {}


_handles = registrar(REDUCTION_HANDLERS)


def in_range(dim: Any, ndim: int) -> bool:
    """Whether `dim` (an int, a list of them, or None) names dims of an `ndim`-dim tensor
    once each, as torch requires (a 0-d tensor takes 0 and -1); a rule leaves any other
    to the fallback, whose run on the whole tensor raises torch's error on every rank."""
    if dim is None:
        return True
    dims = [dim] if isinstance(dim, int) else list(dim)
    bound = max(ndim, 1)
    return all(-bound <= d < bound for d in dims) and len({d % bound for d in dims}) == len(dims)


def _dims(dim: Any, ndim: int) -> tuple[int, ...]:
    """Normalised reduced dimensions; None or [] mean all of them (as torch)."""
    if dim is None:
        return tuple(range(ndim))
    if isinstance(dim, int):
        dim = [dim]
    dims = tuple(sorted({d % ndim if ndim else 0 for d in dim}))
    return dims if dims else tuple(range(ndim))


@functools.lru_cache(maxsize=4096)
def spans(layout: Layout, dims: tuple[int, ...]) -> bool:
    """Every block covers `dims` whole, so work along them is local to each block. (An
    empty block counts only when its box spans them too: rules run their kernels on
    its empty shard, which must then have the sizes along `dims` the kernel expects.)"""
    shape = layout.global_shape
    return all(
        b.offsets[d] == 0 and b.sizes[d] == shape[d]
        for rank_blocks in layout.blocks
        for b in rank_blocks
        for d in dims
    )


def _projected_block(block: Block, dims: tuple[int, ...], keepdim: bool) -> Block:
    offsets, sizes = [], []
    for d, (o, s) in enumerate(zip(block.offsets, block.sizes)):
        if d in dims:
            if keepdim:
                offsets.append(0)
                sizes.append(1)
        else:
            offsets.append(o)
            sizes.append(s)
    return Block(tuple(offsets), tuple(sizes))


@functools.lru_cache(maxsize=4096)
def project(layout: Layout, dims: tuple[int, ...], keepdim: bool) -> Layout:
    """The layout of a result reduced along `dims` when every block spans them."""
    shape = tuple(
        (1 if keepdim else None) if d in dims else n for d, n in enumerate(layout.global_shape)
    )
    blocks = {
        r: [_projected_block(b, dims, keepdim) for b in rank_blocks]
        for r, rank_blocks in enumerate(layout.blocks)
    }
    return Layout(tuple(n for n in shape if n is not None), blocks, layout.world_size)


@functools.lru_cache(maxsize=4096)
def widened(layout: Layout, dim: int, size: int) -> Layout:
    """`layout` (whose blocks span `dim`) with `dim` resized to `size`: each block still
    spans it (a `topk`'s or `gather`'s result along `dim`, the operand a block needs)."""
    shape = list(layout.global_shape)
    shape[dim] = size

    def resized(b: Block) -> Block:
        offsets, sizes = list(b.offsets), list(b.sizes)
        offsets[dim], sizes[dim] = 0, size
        return Block(tuple(offsets), tuple(sizes))

    blocks = {r: [resized(b) for b in rank_blocks] for r, rank_blocks in enumerate(layout.blocks)}
    return Layout(tuple(shape), blocks, layout.world_size)


_META: dict[Any, Any] = {}


def _meta_key(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return ("tensor", tuple(x.shape), x.dtype)
    if isinstance(x, (list, tuple)):
        return tuple(_meta_key(e) for e in x)
    if isinstance(x, dict):
        return tuple(sorted((k, _meta_key(v)) for k, v in x.items()))
    hash(x)  # anything unhashable is not cached (TypeError, caught by the caller)
    return x


def _meta(func: Any, args: tuple, kwargs: dict) -> Any:
    """`func`'s result on meta tensors of the operands' global shapes: shapes and dtypes.
    Cached by the operands' shapes and dtypes: some meta kernels are Python references
    (`native_layer_norm`'s costs milliseconds), and a training step repeats its calls."""
    try:
        key: Any = (func, _meta_key(args), _meta_key(kwargs))
    except TypeError:
        key = None
    if key is not None and key in _META:
        return _META[key]

    def to_meta(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return torch.empty(x.shape, dtype=x.dtype, device="meta")
        return x

    meta_args, meta_kwargs = tree_map(to_meta, (args, kwargs))
    out = func(*meta_args, **meta_kwargs)
    if key is not None:
        if len(_META) > 4096:
            _META.clear()
        _META[key] = out
    return out


def _blockwise(
    func: Any, st: ShardedTensor, args: tuple, kwargs: dict, dims: tuple[int, ...], keepdim: bool
) -> Any:
    """Run `func` on each block (which spans `dims`); results in the projected layout.

    A rank holding no block runs it on an empty stand-in (the dims it works along
    whole, another empty), so that an op torch refuses (`argmin` of a bool tensor)
    raises on that rank too, as on the others, instead of leaving them waiting."""
    layout = project(st._layout, dims, keepdim)
    results = [func(shard, *args[1:], **kwargs) for shard in st._shards]
    if not st._shards and any(d not in dims for d in range(st.ndim)):
        empty = [n if d in dims else 0 for d, n in enumerate(st.shape)]
        func(torch.empty(empty, dtype=st.dtype, device=st.device), *args[1:], **kwargs)
    return _wrap_all(st, layout, results, func, args, kwargs)


def _wrap_all(
    st: ShardedTensor, layout: Layout, results: list[Any], func: Any, args: tuple, kwargs: dict
) -> Any:
    """Per-block results (tensors, or tuples of them) as ShardedTensors of `layout`."""
    sample = results[0] if results else _meta(func, args, kwargs)
    if isinstance(sample, (tuple, list)):
        return type(sample)(
            _wrap(st, layout, [r[j] for r in results], func, args, kwargs, j)
            for j in range(len(sample))
        )
    return _wrap(st, layout, results, func, args, kwargs, None)


def _wrap(
    st: ShardedTensor,
    layout: Layout,
    shards: list[torch.Tensor],
    func: Any,
    args: tuple,
    kwargs: dict,
    index: int | None,
) -> ShardedTensor:
    if shards:
        return st._with_layout(layout, shards)
    out = _meta(func, args, kwargs)
    if index is not None:
        out = out[index]
    return st._with_layout(layout, [], dtype=out.dtype, device=st.device)


# -- sums, means and extrema: local along unsharded dims, else one all-reduce ------

_SUM, _MAX, _MIN = "sum", "max", "min"


def _partial(
    st: ShardedTensor,
    dims: tuple[int, ...],
    kind: str,
    out_dtype: torch.dtype,
    transform: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """This rank's part of the reduction along `dims` of every element, keepdim: the
    reduction of the parts over the group (by `kind`) is the value."""
    shape, regions, whole = _part_plan(st._layout, st._rank, dims)
    if whole and st._shards[regions[0][0]].numel():  # one block makes the whole part
        shard = st._shards[regions[0][0]]
        value = transform(shard) if transform is not None else shard
        if kind == _SUM:
            return value.sum(dim=dims, keepdim=True, dtype=out_dtype)
        if kind == _MAX:
            return value.amax(dim=dims, keepdim=True).to(out_dtype)
        return value.amin(dim=dims, keepdim=True).to(out_dtype)
    if kind == _SUM:
        buffer = torch.zeros(shape, dtype=out_dtype, device=st.device)
    else:
        low = kind == _MAX
        if out_dtype.is_floating_point:
            fill = -math.inf if low else math.inf
        elif out_dtype == torch.bool:
            fill = not low
        else:
            info = torch.iinfo(out_dtype)
            fill = info.min if low else info.max
        buffer = torch.full(shape, fill, dtype=out_dtype, device=st.device)
    for i, where in regions:
        shard = st._shards[i]
        if shard.numel() == 0:
            continue
        value = transform(shard) if transform is not None else shard
        region = buffer[where]
        if kind == _SUM:
            region.add_(value.sum(dim=dims, keepdim=True, dtype=out_dtype))
        elif kind == _MAX:
            torch.maximum(region, value.amax(dim=dims, keepdim=True).to(out_dtype), out=region)
        else:
            torch.minimum(region, value.amin(dim=dims, keepdim=True).to(out_dtype), out=region)
    return buffer


@functools.lru_cache(maxsize=4096)
def _part_plan(
    layout: Layout, rank: int, dims: tuple[int, ...]
) -> tuple[tuple[int, ...], tuple[tuple[int, tuple[slice, ...]], ...], bool]:
    """For `_partial`: the part's shape (keepdim), where in it each block this rank is the
    first holder of lands, and whether one such block covers all of it."""
    shape = tuple(1 if d in dims else n for d, n in enumerate(layout.global_shape))
    blocks = layout.blocks_of(rank)
    projected = [(i, _projected_block(blocks[i], dims, True)) for i in primary_blocks(layout, rank)]
    whole = len(projected) == 1 and projected[0][1].sizes == shape
    return shape, tuple((i, b.slices()) for i, b in projected), whole


_REDUCE_OPS = {_SUM: dist.ReduceOp.SUM, _MAX: dist.ReduceOp.MAX, _MIN: dist.ReduceOp.MIN}


def _combined(parts: torch.Tensor, kind: str, st: ShardedTensor) -> torch.Tensor:
    """The parts reduced over the group now, whole on every rank."""
    return all_reduce(parts, _REDUCE_OPS[kind], st)


def _finish(
    st: ShardedTensor,
    value: torch.Tensor,
    dims: tuple[int, ...],
    keepdim: bool,
    pending: str | None = None,
) -> ShardedTensor:
    """A keepdim result as a replicated ShardedTensor: whole on every rank, or, with
    `pending`, this rank's part of it, combined by that reduction on first use."""
    if not keepdim:
        value = value.reshape([n for d, n in enumerate(value.shape) if d not in dims])
    if pending is not None:
        return later(value, pending, st)
    layout = replicated(tuple(value.shape), st._layout.world_size)
    return st._with_layout(layout, [value])


def _count(st: ShardedTensor, dims: tuple[int, ...]) -> int:
    return math.prod(st.shape[d] for d in dims)


class _Across(NamedTuple):
    """A reduction along a sharded dimension, ready for `_partial`."""

    st: ShardedTensor
    a: dict[str, Any]
    dims: tuple[int, ...]
    keepdim: bool
    out_dtype: torch.dtype


def _across(func: Any, args: tuple, kwargs: dict) -> Any:
    """The reduction's result when no exchange is needed (every block spans the reduced
    dims, or no sharded input), else what `_partial` needs to reduce across ranks."""
    st = args[0]
    if not isinstance(st, ShardedTensor):
        return fallback(func, args, kwargs)
    a = named(func, args, kwargs)
    dims = _dims(a.get("dim"), st.ndim)
    keepdim = bool(a.get("keepdim", False))
    if st.ndim == 0 or spans(st._layout, dims):
        return _blockwise(func, st, args, kwargs, dims, keepdim)
    return _Across(st, a, dims, keepdim, _out_dtype(func, st, a, args, kwargs))


_OUT_DTYPES: dict[tuple[Any, ...], torch.dtype] = {}


def _out_dtype(func: Any, st: ShardedTensor, a: dict, args: tuple, kwargs: dict) -> torch.dtype:
    """A reduction's result dtype: set by the input's and the `dtype` argument alone."""
    key = (func, st.dtype, a.get("dtype"))
    found = _OUT_DTYPES.get(key)
    if found is None:
        found = _OUT_DTYPES[key] = _meta(func, args, kwargs).dtype
    return found


@_handles(
    aten.sum.default,
    aten.sum.dim_IntList,
    aten.mean.default,
    aten.mean.dim,
    aten.amax.default,
    aten.amin.default,
    aten.max.default,
    aten.min.default,
    aten.nansum.default,
)
def _reduce(func: Any, args: tuple, kwargs: dict) -> Any:
    if len(sharded_args(args, kwargs)) > 1:
        return fallback(func, args, kwargs)
    ready = _across(func, args, kwargs)
    if not isinstance(ready, _Across):
        return ready
    st, a, dims, keepdim, out_dtype = ready
    name = func._schema.name
    if name in ("aten::sum", "aten::mean", "aten::nansum"):
        nan = (lambda s: s.nan_to_num(nan=0.0)) if name == "aten::nansum" else None
        kind, value = _SUM, _partial(st, dims, _SUM, out_dtype, nan)
        if name == "aten::mean":
            value = value / _count(st, dims)  # each part divided: the sum of parts is the mean
    elif name in ("aten::amax", "aten::max"):
        kind, value = _MAX, _partial(st, dims, _MAX, out_dtype)
    else:
        kind, value = _MIN, _partial(st, dims, _MIN, out_dtype)
    if a.get("dim") is None and name in ("aten::max", "aten::min"):
        keepdim = False
    return _finish(st, value.to(out_dtype), dims, keepdim, pending=kind)


@_handles(aten.linalg_vector_norm.default)
def _norm(func: Any, args: tuple, kwargs: dict) -> Any:
    ready = _across(func, args, kwargs)
    if not isinstance(ready, _Across):
        return ready
    st, a, dims, keepdim, out_dtype = ready
    ord_ = float(a.get("ord", 2))
    if ord_ == math.inf:
        value = _partial(st, dims, _MAX, out_dtype, lambda s: s.abs().to(out_dtype))
        return _finish(st, value, dims, keepdim, pending=_MAX)
    if ord_ == -math.inf:
        value = _partial(st, dims, _MIN, out_dtype, lambda s: s.abs().to(out_dtype))
        return _finish(st, value, dims, keepdim, pending=_MIN)
    if ord_ == 0:
        value = _partial(st, dims, _SUM, out_dtype, lambda s: (s != 0).to(out_dtype))
        return _finish(st, value, dims, keepdim, pending=_SUM)
    parts = _partial(st, dims, _SUM, out_dtype, lambda s: s.to(out_dtype).abs().pow(ord_))
    value = _combined(parts, _SUM, st).pow(1.0 / ord_)  # the root needs the whole sum
    return _finish(st, value, dims, keepdim)


@_handles(aten.var.correction, aten.std.correction)
def _variance(func: Any, args: tuple, kwargs: dict) -> Any:
    ready = _across(func, args, kwargs)
    if not isinstance(ready, _Across):
        return ready
    st, a, dims, keepdim, out_dtype = ready
    correction = a.get("correction")
    correction = 1 if correction is None else float(correction)
    count = _count(st, dims)
    mean = _combined(_partial(st, dims, _SUM, out_dtype), _SUM, st) / count
    blocks = st._layout.blocks_of(st._rank)
    squares = torch.zeros_like(mean)
    for i in primary_blocks(st._layout, st._rank):
        shard = st._shards[i]
        if shard.numel() == 0:
            continue
        centre = mean[_projected_block(blocks[i], dims, True).slices()]
        region = squares[_projected_block(blocks[i], dims, True).slices()]
        region.add_((shard.to(out_dtype) - centre).pow(2).sum(dim=dims, keepdim=True))
    den = max(count - correction, 0)
    if func._schema.name == "aten::std" or den <= 0:
        # the root needs the whole sum; a zero divisor too (a rank's part of 0 / 0 is nan)
        value = _combined(squares, _SUM, st) / den
        value = value.sqrt() if func._schema.name == "aten::std" else value
        return _finish(st, value, dims, keepdim)
    return _finish(st, squares / den, dims, keepdim, pending=_SUM)


# -- along one dimension, shape kept or reduced: local when every block spans it ---


def _along(dim_arg: str, *, keeps_shape: bool) -> Callable[[Any, tuple, dict], Any]:
    def handler(func: Any, args: tuple, kwargs: dict) -> Any:
        sharded = sharded_args(args, kwargs)
        ref = sharded[0]
        a = named(func, args, kwargs)
        if not in_range(a.get(dim_arg), ref.ndim):
            return fallback(func, args, kwargs)  # torch's IndexError, on every rank
        dims = _dims(a.get(dim_arg), ref.ndim)
        if ref.ndim and not spans(ref._layout, dims):
            across = _ACROSS.get(func)
            out = None
            if across is not None and len(dims) == 1:
                out = across(a, dims[0])
            elif func in _ACROSS_DIMS:
                out = _ACROSS_DIMS[func](a, list(dims))
            return out if out is not None else fallback(func, args, kwargs)
        if len(sharded) > 1:  # backward ops: every operand has the first one's shape
            if any(tuple(x.shape) != tuple(ref.shape) for x in sharded):
                return fallback(func, args, kwargs)
            args = tuple(
                ref._with_layout(ref._layout, local_in(x, ref._layout))
                if isinstance(x, ShardedTensor)
                else x
                for x in args
            )
            results = [
                func(*[x._shards[i] if isinstance(x, ShardedTensor) else x for x in args], **kwargs)
                for i in range(len(ref._shards))
            ]
            return _wrap_all(ref, ref._layout, results, func, args, kwargs)
        if keeps_shape:
            return _blockwise(func, ref, args, kwargs, (), False)
        return _blockwise(func, ref, args, kwargs, dims, bool(a.get("keepdim", False)))

    return handler


# -- softmax along a sharded dimension: the reductions it needs, each one all-reduce ---------
#
# Composed of aten ops on the ShardedTensors themselves (each one dispatched to its rule):
# the row maxima and sums along `dim` are reduced across ranks (2·O bytes each, O the
# size of the result without `dim`), everything else is pointwise on the blocks.


def _softmax_across(a: dict, dim: int) -> Any:
    x = _as_float(a["self"], a.get("half_to_float", False))
    shifted = aten.sub.Tensor(x, aten.amax.default(x, [dim], True))
    e = aten.exp.default(shifted)
    return aten.div.Tensor(e, aten.sum.dim_IntList(e, [dim], True))


def _log_softmax_across(a: dict, dim: int) -> Any:
    x = _as_float(a["self"], a.get("half_to_float", False))
    shifted = aten.sub.Tensor(x, aten.amax.default(x, [dim], True))
    total = aten.sum.dim_IntList(aten.exp.default(shifted), [dim], True)
    return aten.sub.Tensor(shifted, aten.log.default(total))


def _softmax_backward_across(a: dict, dim: int) -> Any:
    grad, out = a["grad_output"], a["output"]
    inner = aten.sum.dim_IntList(aten.mul.Tensor(grad, out), [dim], True)
    return aten.mul.Tensor(out, aten.sub.Tensor(grad, inner))


def _log_softmax_backward_across(a: dict, dim: int) -> Any:
    grad, out = a["grad_output"], a["output"]
    total = aten.sum.dim_IntList(grad, [dim], True)
    return aten.sub.Tensor(grad, aten.mul.Tensor(aten.exp.default(out), total))


def _logsumexp_across(a: dict, dims: list[int]) -> Any:
    """The maxima taken out first, as torch's (an infinite maximum is taken as 0)."""
    x = a["self"]
    if not x.dtype.is_floating_point:
        return None
    top = aten.amax.default(x, dims, True)
    top = aten.where.self(aten.isinf.default(top), aten.zeros_like.default(top), top)
    total = aten.sum.dim_IntList(aten.exp.default(aten.sub.Tensor(x, top)), dims, True)
    out = aten.add.Tensor(aten.log.default(total), top)
    return out if a["keepdim"] else aten.squeeze.dims(out, dims)


# -- scans along a sharded dimension: each block's scan, carried over from the blocks
# before it ----------------------------------------------------------------------------
#
# Where every block spans the other dims (a split along `dim` only, replicas allowed),
# each block's cumulative sum (product, log-sum-exp) is its own joined with the total
# of every block before it along `dim`. Each rank sends, to each holder of a later
# block, the total of its primary blocks before that block (one slice: C elements,
# the other dims' size), in one all-to-all; it receives at most one slice per rank and
# block it holds. Bytes per rank: C per earlier rank, per block (DTensor gathers the
# whole tensor). Blocks, carries and joins run in torch's accumulation type (float64
# for a float32 scan on the CPU), the result rounded once, as torch's is: exact for
# integers; for floats, torch's value unless the two wide sums round to neighbours.
# cumsum's backward (a flip, this, a flip) takes the same route; cumprod's and
# logcumsumexp's are composed of ops with rules of their own.


class _Scan(NamedTuple):
    """This rank's part of a carry exchange along a split dim."""

    sends: tuple[tuple[int, tuple[int, ...]], ...]  # per message: dst rank, my blocks summed
    send_ranks: tuple[int, ...]  # each message's destination
    recvs: tuple[tuple[int, int], ...]  # per message: src rank, my block it adds to
    local: tuple[tuple[int, ...], ...]  # per block of mine: my primary blocks before it


@functools.lru_cache(maxsize=256)
def _scan(layout: Layout, dim: int, me: int) -> _Scan | None:
    shape = layout.global_shape
    if layout.allow_holes:  # no sum to carry over a hole
        return None
    for blocks in layout.blocks:
        for b in blocks:
            if not b.is_empty() and any(
                b.offsets[e] != 0 or b.sizes[e] != shape[e] for e in range(len(shape)) if e != dim
            ):
                return None

    def segments(rank: int) -> list[tuple[int, int]]:  # (end along dim, block index)
        blocks = layout.blocks_of(rank)
        return [
            (blocks[i].offsets[dim] + blocks[i].sizes[dim], i)
            for i in primary_blocks(layout, rank)
            if not blocks[i].is_empty()
        ]

    def before(rank: int, start: int) -> tuple[int, ...]:
        return tuple(i for end, i in segments(rank) if end <= start)

    sends, send_ranks, recvs = [], [], []
    for q in range(layout.world_size):
        for b in layout.blocks_of(q):
            if q == me or b.is_empty():
                continue
            mine = before(me, b.offsets[dim])
            if mine:
                sends.append((q, mine))
                send_ranks.append(q)
    mine_blocks = layout.blocks_of(me)
    for r in range(layout.world_size):
        for k, b in enumerate(mine_blocks):
            if r != me and not b.is_empty() and before(r, b.offsets[dim]):
                recvs.append((r, k))
    local = tuple(() if b.is_empty() else before(me, b.offsets[dim]) for b in mine_blocks)
    return _Scan(tuple(sends), tuple(send_ranks), tuple(recvs), local)


class _ScanOp(NamedTuple):
    """A scan that runs per block and joins a carry in: `run(x, dim, dtype)` on a
    block, `join(carry, x)` (associative), starting from `identity`."""

    run: Callable[[Any, int, Any], Any]
    join: Callable[[Any, Any], Any]
    identity: float


_SCANS: dict[Any, _ScanOp] = {
    aten.cumsum.default: _ScanOp(
        lambda x, d, dtype: aten.cumsum.default(x, d, dtype=dtype), aten.add.Tensor, 0.0
    ),
    aten.cumprod.default: _ScanOp(
        lambda x, d, dtype: aten.cumprod.default(x, d, dtype=dtype), aten.mul.Tensor, 1.0
    ),
    aten.logcumsumexp.default: _ScanOp(
        lambda x, d, dtype: aten.logcumsumexp.default(x, d), aten.logaddexp.default, -math.inf
    ),
}


# what a scan also takes besides the ordered dtypes
_SCANNED = frozenset({torch.bool, torch.complex64, torch.complex128})


def _accumulator(dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The type torch's scan kernels accumulate `dtype` in (`at::acc_type`): half
    precision in float32; on the CPU, float32 in float64 (complex alike)."""
    if dtype in (torch.float16, torch.bfloat16):
        return torch.float32
    if device.type == "cpu" and dtype in (torch.float32, torch.complex64):
        return torch.float64 if dtype == torch.float32 else torch.complex128
    return dtype


def _scan_across(func: Any, a: dict, dim: int) -> Any:
    st = a["self"]
    plan = _scan(st._layout, dim, st._rank)
    if plan is None:
        return None
    scan = _SCANS[func]
    if st.dtype not in _ORDERED and st.dtype not in _SCANNED:
        return None  # torch's error, on every rank from the fallback
    dtype = _meta(func, (st, dim), {k: a[k] for k in ("dtype",) if k in a}).dtype
    if func is aten.logcumsumexp.default and not (dtype.is_floating_point or dtype.is_complex):
        return None
    # blocks, carries and joins in torch's accumulation type, the result rounded once
    wide = _accumulator(dtype, st.device)
    # as torch: the input cast to the result's dtype first, then scanned in the wide one
    cum = [scan.run(x.to(dtype).to(wide), dim, wide) for x in st._shards]
    width = math.prod(st.shape) // max(st.shape[dim], 1)  # one slice along dim
    slice_shape = tuple(1 if e == dim else n for e, n in enumerate(st.shape))

    def total(blocks: tuple[int, ...]) -> torch.Tensor:
        out = torch.full(slice_shape, scan.identity, dtype=wide, device=st.device)
        for i in blocks:
            out = scan.join(out, cum[i].narrow(dim, cum[i].shape[dim] - 1, 1))
        return out

    world = st._layout.world_size
    send_counts, recv_counts = [0] * world, [0] * world
    for q in plan.send_ranks:
        send_counts[q] += width
    for r, _k in plan.recvs:
        recv_counts[r] += width
    send = (
        torch.cat([total(blocks).reshape(-1) for _q, blocks in plan.sends])
        if plan.sends
        else torch.empty(0, dtype=wide, device=st.device)
    )
    recv = torch.empty(sum(recv_counts), dtype=wide, device=st.device)
    if _distributed(st):  # every rank, messages or not: the layout alone decides them
        size = recv.element_size()  # as bytes: any dtype on any backend (gloo: no int16)
        communicator(st.group).all_to_all_single(
            recv.view(torch.uint8),
            send.contiguous().view(torch.uint8),
            [n * size for n in recv_counts],
            [n * size for n in send_counts],
        ).wait()
    carries = [total(blocks) for blocks in plan.local]
    for n, (_r, k) in enumerate(plan.recvs):  # by source rank: the order along dim
        carries[k] = scan.join(carries[k], recv[n * width : (n + 1) * width].view(slice_shape))
    shards = [
        (c if b.is_empty() else scan.join(carry, c)).to(dtype)
        for c, carry, b in zip(cum, carries, st._layout.blocks_of(st._rank))
    ]
    return st._with_layout(st._layout, shards, dtype=dtype, device=st.device)


# -- max(dim), min(dim), argmax, argmin along a sharded dimension -----------------------
#
# Each rank reduces its blocks (torch's first index among equal values, the first NaN
# where there is one), then two all-reduces of O (the result's size) pick, per element,
# torch's answer over the whole dim: the extreme value (a NaN flag first, so a NaN
# wins as torch's does), then the smallest index holding it (a max of zeros: a third,
# the holder's zero, whose sign torch keeps). A vocab-parallel argmax
# (logits split along the classes) is this. DTensor gathers the dim instead.


# the dtypes torch's CPU and CUDA kernels order (max, topk), and that gloo and NCCL reduce
# (not int16: gloo has no reduction for it; such a tensor takes the fallback)
_ORDERED = frozenset(
    {
        torch.float16,
        torch.bfloat16,
        torch.float32,
        torch.float64,
        torch.uint8,
        torch.int8,
        torch.int32,
        torch.int64,
    }
)


def _extremum_across(func: Any, a: dict, dim: int) -> Any:
    st = a["self"]
    if a.get("dim") is None or st.dtype not in _ORDERED or st._layout.allow_holes:
        return None  # torch's error, or the layout's, on every rank from the fallback
    high = func in (aten.max.dim, aten.argmax.default)
    take = torch.gt if high else torch.lt
    floating = st.dtype.is_floating_point
    shape, regions, _whole = _part_plan(st._layout, st._rank, (dim,))
    if floating:
        fill: float = -math.inf if high else math.inf
    else:
        info = torch.iinfo(st.dtype)
        fill = info.min if high else info.max
    n = st.shape[dim]  # larger than every index: "none here"
    value = torch.full(shape, fill, dtype=st.dtype, device=st.device)
    index = torch.full(shape, n, dtype=torch.int64, device=st.device)
    nan = torch.zeros(shape, dtype=torch.bool, device=st.device)
    blocks = st._layout.blocks_of(st._rank)
    for i, where in regions:
        shard = st._shards[i]
        if shard.numel() == 0:
            continue
        v, k = (aten.max.dim if high else aten.min.dim)(shard, dim, True)
        k = k + blocks[i].offsets[dim]
        cv, ck, cn = value[where], index[where], nan[where]
        vn = torch.isnan(v) if floating else torch.zeros_like(cn)
        earlier = k < ck
        beats = take(v, cv) | ((v == cv) & earlier)  # a NaN compares false: flagged apart
        better = (vn & ~cn) | (vn & cn & earlier) | (~vn & ~cn & beats)
        value[where] = torch.where(better, v, cv)
        index[where] = torch.where(better, k, ck)
        nan[where] = cn | vn
    if floating:  # one MAX of the NaN flags and the values (negated for a minimum)
        plain = torch.where(nan, torch.full_like(value, -math.inf), value if high else -value)
        both = all_reduce(torch.stack([nan.to(st.dtype), plain]), dist.ReduceOp.MAX, st)
        any_nan, best = both[0] > 0, both[1] if high else -both[1]
        mine = torch.where(any_nan, nan, ~nan & (value == best))
    else:
        best = all_reduce(value.clone(), dist.ReduceOp.MAX if high else dist.ReduceOp.MIN, st)
        any_nan = torch.zeros_like(nan)
        mine = value == best
    first = all_reduce(torch.where(mine, index, n), dist.ReduceOp.MIN, st)
    keepdim = bool(a.get("keepdim", False))
    indices = _finish(st, first, (dim,), keepdim)
    if func in (aten.argmax.default, aten.argmin.default):
        return indices
    if floating:
        best = torch.where(any_nan, torch.full_like(best, math.nan), best)
        if bool((best == 0).any()):  # the same on every rank: `best` is all-reduced
            # -0.0 and 0.0 tie; torch's value is the element at its index, so its holder
            # sends it and every other rank -0.0, which adds nothing to any value
            held = torch.where(mine & (index == first), value, torch.full_like(value, -0.0))
            best = torch.where(best == 0, all_reduce(held, dist.ReduceOp.SUM, st), best)
    return _finish(st, best, (dim,), keepdim), indices


def _as_float(x: Any, half_to_float: bool) -> Any:
    return aten._to_copy.default(x, dtype=torch.float32) if half_to_float else x


_ACROSS: dict[Any, Callable[[dict, int], Any]] = {
    aten._softmax.default: _softmax_across,
    aten._log_softmax.default: _log_softmax_across,
    aten._softmax_backward_data.default: _softmax_backward_across,
    aten._log_softmax_backward_data.default: _log_softmax_backward_across,
    aten.max.dim: functools.partial(_extremum_across, aten.max.dim),
    aten.min.dim: functools.partial(_extremum_across, aten.min.dim),
    aten.argmax.default: functools.partial(_extremum_across, aten.argmax.default),
    aten.argmin.default: functools.partial(_extremum_across, aten.argmin.default),
    aten.cumsum.default: functools.partial(_scan_across, aten.cumsum.default),
    aten.cumprod.default: functools.partial(_scan_across, aten.cumprod.default),
    aten.logcumsumexp.default: functools.partial(_scan_across, aten.logcumsumexp.default),
}
# along several dims at once, not one only
_ACROSS_DIMS: dict[Any, Callable[[dict, list[int]], Any]] = {
    aten.logsumexp.default: _logsumexp_across,
}


REDUCTION_HANDLERS.update(
    {
        aten._softmax.default: _along("dim", keeps_shape=True),
        aten._log_softmax.default: _along("dim", keeps_shape=True),
        aten._softmax_backward_data.default: _along("dim", keeps_shape=True),
        aten._log_softmax_backward_data.default: _along("dim", keeps_shape=True),
        aten.cumsum.default: _along("dim", keeps_shape=True),
        aten.cumprod.default: _along("dim", keeps_shape=True),
        aten.logcumsumexp.default: _along("dim", keeps_shape=True),
        aten.cummax.default: _along("dim", keeps_shape=True),
        aten.cummin.default: _along("dim", keeps_shape=True),
        aten.sort.default: _along("dim", keeps_shape=True),
        aten.sort.stable: _along("dim", keeps_shape=True),
        aten.logsumexp.default: _along("dim", keeps_shape=False),
        aten.max.dim: _along("dim", keeps_shape=False),
        aten.min.dim: _along("dim", keeps_shape=False),
        aten.argmax.default: _along("dim", keeps_shape=False),
        aten.argmin.default: _along("dim", keeps_shape=False),
    }
)


def _topk(func: Any, args: tuple, kwargs: dict) -> Any:
    """`topk` along a dim every block spans: per block, that dim cut to `k`; along a
    sharded dim, `_topk_across`."""
    a = named(func, args, kwargs)
    st = a["self"]
    if not isinstance(st, ShardedTensor) or st.ndim == 0 or not in_range(a["dim"], st.ndim):
        return fallback(func, args, kwargs)
    d = a["dim"] % st.ndim
    if not spans(st._layout, (d,)):
        out = _topk_across(st, a, d)
        return out if out is not None else fallback(func, args, kwargs)
    layout = widened(st._layout, d, a["k"])
    results = [func(shard, *args[1:], **kwargs) for shard in st._shards]
    return _wrap_all(st, layout, results, func, args, kwargs)


REDUCTION_HANDLERS[aten.topk.default] = _topk


# -- topk along a sharded dimension: each rank's k best, gathered -------------------------
#
# Each rank takes the k best of its blocks along the dim (per slice of the other dims,
# its blocks there joined), with their indices in the whole tensor; one all-gather of
# those k candidates per rank (values and indices, as bytes) gives every rank W·k per
# slice, whose k best are the result, replicated: torch's values exactly, NaN first as
# torch's. Which of equal values is taken is unspecified in torch and may differ
# here. Bytes per rank: W·k values and indices per slice; DTensor gathers the
# whole dim (n per slice). The backward scatters the gradient as `max(dim)`'s does.


def _all_gather(out: torch.Tensor, mine: torch.Tensor, group: Any) -> None:
    """Every rank's `mine`, in rank order, into `out`: torch 2.13's `all_gather_single`,
    which `all_gather_into_tensor` (now warning) was called before."""
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, mine, group=group)


def _topk_across(st: ShardedTensor, a: dict, d: int) -> Any:
    k, largest = a["k"], bool(a.get("largest", True))
    if not 0 <= k <= st.shape[d] or st.dtype not in _ORDERED or st._layout.allow_holes:
        return None  # torch's error, or the layout's, on every rank from the fallback
    shape, regions, _whole = _part_plan(st._layout, st._rank, (d,))
    wide = tuple(k if e == d else n for e, n in enumerate(shape))
    if st.dtype.is_floating_point:
        fill: float = -math.inf if largest else math.inf
    else:
        info = torch.iinfo(st.dtype)
        fill = info.min if largest else info.max
    values = torch.full(wide, fill, dtype=st.dtype, device=st.device)
    indices = torch.full(wide, -1, dtype=torch.int64, device=st.device)  # -1: no candidate
    blocks = st._layout.blocks_of(st._rank)
    for i, where in regions:  # each block's k best, merged with those of the slices it shares
        shard = st._shards[i]
        if shard.numel() == 0:
            continue
        best, which = aten.topk.default(shard, min(k, shard.shape[d]), d, largest, True)
        cut = tuple(slice(0, k) if e == d else w for e, w in enumerate(where))
        merged, merged_at = _best(
            torch.cat([values[cut], best], d),
            torch.cat([indices[cut], which + blocks[i].offsets[d]], d),
            k,
            d,
            largest,
        )
        values[cut], indices[cut] = merged, merged_at
    world = st._layout.world_size
    if _distributed(st):  # values and indices as bytes, in one all-gather
        mine = torch.cat(
            [values.reshape(-1).view(torch.uint8), indices.reshape(-1).view(torch.uint8)]
        )
        gathered = torch.empty((world, mine.numel()), dtype=torch.uint8, device=st.device)
        _all_gather(gathered.view(-1), mine, group=st.group)
        split = values.numel() * values.element_size()
        every = gathered[:, :split].reshape(-1).view(st.dtype).view(world, *wide)
        every_at = gathered[:, split:].reshape(-1).view(torch.int64).view(world, *wide)
    else:
        every, every_at = values[None], indices[None]

    def along(t: torch.Tensor) -> torch.Tensor:  # (W, ..., k, ...) -> (..., W·k, ...)
        return t.movedim(0, d).flatten(d, d + 1)

    top, top_at = _best(along(every), along(every_at), k, d, largest)
    layout = replicated(tuple(top.shape), world)
    return st._with_layout(layout, [top.contiguous()]), st._with_layout(
        layout, [top_at.contiguous()], dtype=torch.int64
    )


def _best(
    values: torch.Tensor, at: torch.Tensor, k: int, d: int, largest: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """The `k` best candidates along `d` and their indices: the best first (NaN first when
    largest, as topk), real ones (index ≥ 0) before the fill, whatever it equals."""
    order = torch.sort(values, dim=d, descending=largest, stable=True).indices
    values, at = values.gather(d, order), at.gather(d, order)
    order = torch.sort((at < 0).to(torch.uint8), dim=d, stable=True).indices
    return values.gather(d, order).narrow(d, 0, k), at.gather(d, order).narrow(d, 0, k)


# -- nll_loss (what cross_entropy becomes) on inputs whose blocks span the classes ----
#
# The loss of each sample (and each pixel, for `nll_loss2d`) reads its own row of
# classes only: where every block of the input spans dim 1 (a batch- or
# pixel-sharded input), each block's loss is its own. Its sum over this rank's
# blocks is a part of a pending sum (one all-reduce of 1 element on first use); a
# mean divides each part by the total weight of the targets first (every rank
# works it out from a target it holds whole; from a sharded target, one all-reduce
# of 1 element at once). The backward is per block, given that total. DTensor
# does the same for a batch-sharded input.


def _nll_operands(a: dict) -> tuple[ShardedTensor, list[Any], list[int]] | None:
    """(input, this rank's target for each of its blocks, the blocks it counts once) when
    the rule applies: the input's blocks span the classes (dim 1), a target it can take
    per block (plain, replicated, or sharded as the input without dim 1)."""
    st, target = a["self"], a["target"]
    if not isinstance(st, ShardedTensor) or st.ndim < 2 or not spans(st._layout, (1,)):
        return None
    weight = a.get("weight")
    if isinstance(weight, ShardedTensor) and not is_replicated(weight._layout):
        return None
    rows = project(st._layout, (1,), False)  # the target's blocks, as the input's
    blocks = rows.blocks_of(st._rank)
    if isinstance(target, ShardedTensor) and not is_replicated(target._layout):
        targets = local_in(target, rows)  # its classes checked by each block's kernel
    else:
        whole_target = whole_or_plain(target)
        # every rank holds it: a class out of range goes to the fallback, whose run on
        # the whole tensors raises torch's error on every rank
        counted = whole_target[whole_target != a["ignore_index"]]
        if counted.numel() and not (0 <= int(counted.min()) and int(counted.max()) < st.shape[1]):
            return None
        targets = [whole_target[b.slices()] for b in blocks]
    return st, targets, primary_blocks(st._layout, st._rank)


def _class_weight(a: dict) -> torch.Tensor | None:
    """The per-class `weight` every rank holds whole, or None."""
    weight = a.get("weight")
    return None if weight is None else whole_or_plain(weight)


def _total_weight(a: dict, st: ShardedTensor, targets: list[Any], mine: list[int]) -> Any:
    """The weight of the targets not ignored, summed over the whole batch (a 0-d tensor
    every rank holds)."""
    weight = _class_weight(a)
    target = a["target"]
    shared = not isinstance(target, ShardedTensor) or is_replicated(target._layout)
    picked = [whole_or_plain(target)] if shared else [targets[i] for i in mine]
    total = torch.zeros((), dtype=st.dtype, device=st.device)
    for t in picked:
        kept = t[t != a["ignore_index"]]
        total = total + (kept.numel() if weight is None else weight[kept].sum().to(st.dtype))
    if not shared:
        all_reduce(total, dist.ReduceOp.SUM, st)
    return total


def _nll_loss(func: Any, args: tuple, kwargs: dict) -> Any:
    a = named(func, args, kwargs)
    found = _nll_operands(a)
    if found is None or a["reduction"] not in (0, 1, 2):
        return fallback(func, args, kwargs)
    st, targets, mine = found
    weight = _class_weight(a)
    ignore, reduction = a["ignore_index"], a["reduction"]
    total = _total_weight(a, st, targets, mine)
    total_st = st._with_layout(replicated((), st._layout.world_size), [total])
    if reduction == 0:  # one loss per sample: the target's blocks
        outs = [func(x, t, weight, 0, ignore)[0] for x, t in zip(st._shards, targets)]
        rows = project(st._layout, (1,), False)
        return st._with_layout(rows, outs, dtype=st.dtype, device=st.device), total_st
    part = torch.zeros((), dtype=st.dtype, device=st.device)
    for i in mine:
        part = part + func(st._shards[i], targets[i], weight, 2, ignore)[0]
    if reduction == 1:
        part = part / total
    return later(part, "sum", st), total_st


def _nll_loss_backward(func: Any, args: tuple, kwargs: dict) -> Any:
    a = named(func, args, kwargs)
    found = _nll_operands(a)
    if found is None:
        return fallback(func, args, kwargs)
    st, targets, _mine = found
    weight = _class_weight(a)
    total = whole_or_plain(a["total_weight"])
    grad = a["grad_output"]
    if a["reduction"] == 0:
        rows = project(st._layout, (1,), False)
        if isinstance(grad, ShardedTensor) and not is_replicated(grad._layout):
            grads = local_in(grad, rows)
        else:
            g = whole_or_plain(grad)
            grads = [g[b.slices()] for b in rows.blocks_of(st._rank)]
    else:
        grads = [whole_or_plain(grad)] * len(st._shards)
    shards = [
        func(g, x, t, weight, a["reduction"], a["ignore_index"], total)
        for g, x, t in zip(grads, st._shards, targets)
    ]
    return st._with_layout(st._layout, shards, dtype=st.dtype, device=st.device)


for _op in (aten.nll_loss_forward.default, aten.nll_loss2d_forward.default):
    REDUCTION_HANDLERS[_op] = _nll_loss
for _op in (aten.nll_loss_backward.default, aten.nll_loss2d_backward.default):
    REDUCTION_HANDLERS[_op] = _nll_loss_backward


# -- layer norm: local when every block spans the normalised dimensions ------------
#
# Along a sharded normalised dimension it is composed of aten ops on the ShardedTensors
# (each dispatched to its rule): the mean and the variance are reductions across ranks,
# one all-reduce of the statistics' size (the leading dims) each, forward; the backward's
# two means the same. Everything else is pointwise on the blocks, the weight and bias
# taking each block's part. DTensor gathers the normalised dims instead (the input's size).


def _layer_norm_across(a: dict, st: ShardedTensor, dims: list[int], meta: Any) -> Any:
    x = st if st.dtype == meta[1].dtype else aten._to_copy.default(st, dtype=meta[1].dtype)
    mean = aten.mean.dim(x, dims, True)
    centred = aten.sub.Tensor(x, mean)
    var = aten.mean.dim(aten.mul.Tensor(centred, centred), dims, True)
    rstd = aten.rsqrt.default(aten.add.Tensor(var, a["eps"]))
    out = aten.mul.Tensor(centred, rstd)
    if a["weight"] is not None:
        out = aten.mul.Tensor(out, a["weight"])
    if a["bias"] is not None:
        out = aten.add.Tensor(out, a["bias"])
    if out.dtype != meta[0].dtype:
        out = aten._to_copy.default(out, dtype=meta[0].dtype)
    return out, mean, rstd


def _layer_norm_backward_across(a: dict, st: ShardedTensor, dims: list[int], meta: Any) -> Any:
    grad, mean, rstd, weight = a["grad_out"], a["mean"], a["rstd"], a["weight"]
    mask = list(a["output_mask"])
    x = st if st.dtype == mean.dtype else aten._to_copy.default(st, dtype=mean.dtype)
    xhat = aten.mul.Tensor(aten.sub.Tensor(x, mean), rstd)
    lead = list(range(st.ndim - len(dims)))
    grad_in = grad_w = grad_b = None
    if mask[0]:
        g = grad if weight is None else aten.mul.Tensor(grad, weight)
        inner = aten.add.Tensor(
            aten.mean.dim(g, dims, True),
            aten.mul.Tensor(xhat, aten.mean.dim(aten.mul.Tensor(g, xhat), dims, True)),
        )
        grad_in = aten.mul.Tensor(aten.sub.Tensor(g, inner), rstd)
        if grad_in.dtype != meta[0].dtype:
            grad_in = aten._to_copy.default(grad_in, dtype=meta[0].dtype)
    if mask[1] and weight is not None:
        product = aten.mul.Tensor(grad, xhat)
        grad_w = aten.sum.dim_IntList(product, lead, False) if lead else product
    if mask[2] and a["bias"] is not None:
        grad_b = aten.sum.dim_IntList(grad, lead, False) if lead else aten.clone.default(grad)
    return grad_in, grad_w, grad_b


@_handles(aten.native_layer_norm.default)
def _layer_norm(func: Any, args: tuple, kwargs: dict) -> Any:
    a = named(func, args, kwargs)
    st, shape = a["input"], tuple(a["normalized_shape"])
    dims = tuple(range(st.ndim - len(shape), st.ndim))
    if not isinstance(st, ShardedTensor):
        return fallback(func, args, kwargs)
    if not spans(st._layout, dims):
        return _layer_norm_across(a, st, list(dims), _meta(func, args, kwargs))
    weight, bias = whole_or_plain(a["weight"]), whole_or_plain(a["bias"])
    results = [func(s, list(shape), weight, bias, a["eps"]) for s in st._shards]
    stats = project(st._layout, dims, True)
    out = [r[0] for r in results]
    meta = _meta(func, (st, list(shape), a["weight"], a["bias"], a["eps"]), {})
    return (
        st._with_layout(st._layout, out, dtype=meta[0].dtype),
        st._with_layout(stats, [r[1] for r in results], dtype=meta[1].dtype),
        st._with_layout(stats, [r[2] for r in results], dtype=meta[2].dtype),
    )


@_handles(aten.native_layer_norm_backward.default)
def _layer_norm_backward(func: Any, args: tuple, kwargs: dict) -> Any:
    a = named(func, args, kwargs)
    grad, st, shape = a["grad_out"], a["input"], tuple(a["normalized_shape"])
    if not all(isinstance(v, ShardedTensor) for v in (st, grad, a["mean"], a["rstd"])):
        return fallback(func, args, kwargs)
    dims = tuple(range(st.ndim - len(shape), st.ndim))
    if not spans(st._layout, dims):
        return _layer_norm_backward_across(a, st, list(dims), _meta(func, args, kwargs))
    stats = project(st._layout, dims, True)
    grads = local_in(grad, st._layout)
    means = local_in(a["mean"], stats)
    rstds = local_in(a["rstd"], stats)
    weight, bias = whole_or_plain(a["weight"]), whole_or_plain(a["bias"])
    mask = list(a["output_mask"])
    grad_in: list[torch.Tensor] = []
    grad_w = grad_b = None
    primary = set(primary_blocks(st._layout, st._rank))
    for i, shard in enumerate(st._shards):
        gi, gw, gb = func(grads[i], shard, list(shape), means[i], rstds[i], weight, bias, mask)
        grad_in.append(gi)
        if i in primary:
            if mask[1] and gw is not None:
                grad_w = gw if grad_w is None else grad_w + gw
            if mask[2] and gb is not None:
                grad_b = gb if grad_b is None else grad_b + gb
    meta = _meta(func, args, kwargs)
    first = st._with_layout(st._layout, grad_in, dtype=meta[0].dtype) if mask[0] else None
    return (
        first,
        summed(grad_w, meta[1], st) if mask[1] else None,
        summed(grad_b, meta[2], st) if mask[2] else None,
    )


def summed(value: torch.Tensor | None, meta: Any, like: ShardedTensor) -> ShardedTensor:
    """A parameter's gradient summed over every block of every rank, replicated: this
    rank's part (its blocks' sum), combined on first use (when the optimizer reads it)."""
    if value is None:
        value = torch.zeros(meta.shape, dtype=meta.dtype, device=like.device)
    return later(value.contiguous(), _SUM, like)
