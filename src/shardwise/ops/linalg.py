"""Matrix products, embeddings and convolutions on ShardedTensors.

`mm` / `addmm` / `bmm` / `baddbmm` (what `matmul`, `linear` and `einsum`
decompose into), by the layouts of the operands, cheapest first:

1. the left operand's blocks span the contracted dimension: each block is
   multiplied by the right operand, taken whole (free when it is replicated,
   a plain tensor or a parameter; else gathered once). The result has the
   left operand's rows: no communication for `linear` on row-sharded inputs.
2. the right operand's blocks span it: the mirror image, the result has its
   columns (column-parallel linear layers).
3. both are sharded along the contracted dimension the same way on every
   rank (the weight gradient `xᵀ·g` of a row-sharded `linear`): each rank
   multiplies its blocks, one all-reduce sums the partial products, the
   result is replicated. Bytes per rank: about 2× the result.
4. batch-aligned `bmm` (both split along the batch only, alike): per block.

Anything else goes to the fallback. `embedding` looks rows up locally in a
column-wise table or for sharded indices, and sums masked lookups of a
row-wise table with one all-reduce of the result (pending, as rule 3's); `convolution` is local for
inputs split along the batch (a halo exchange for split spatial dimensions
is not built: those gather, through the fallback).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from ..layout import Block, Layout
from ..tensor import ShardedTensor
from .exchange import is_replicated, local_in, primary_blocks, replicated, whole_or_plain
from .fallback import fallback
from .halo import conv_backward, conv_forward, conv_plan, sharded_spatial_dims
from .pending import later
from .per_shard import empty_block, named, registrar
from .reductions import spans, summed

__all__ = ["LINALG_HANDLERS"]

aten = torch.ops.aten

LINALG_HANDLERS: dict[Any, Callable[[Any, tuple, dict], Any]] = {}


_handles = registrar(LINALG_HANDLERS)


def _is_whole(x: Any) -> bool:
    return not isinstance(x, ShardedTensor) or is_replicated(x._layout)


@functools.lru_cache(maxsize=4096)
def _product_layout(
    layout: Layout, keep: tuple[int, ...], shape: tuple[int, ...], where: tuple[int, ...]
) -> Layout:
    """Blocks of a product: the operand's extent along its dims `keep`, placed at result
    dims `where`; every other result dim whole."""
    blocks: dict[int, list[Block]] = {}
    for r, rank_blocks in enumerate(layout.blocks):
        out = []
        for b in rank_blocks:
            if b.is_empty():
                out.append(empty_block(len(shape)))
                continue
            offsets, sizes = [0] * len(shape), list(shape)
            for src, dst in zip(keep, where):
                offsets[dst], sizes[dst] = b.offsets[src], b.sizes[src]
            out.append(Block(tuple(offsets), tuple(sizes)))
        blocks[r] = out
    return Layout(shape, blocks, layout.world_size)


def _product(
    left: Any, right: Any, batched: bool, mult: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
) -> Any:
    """The rules 1-4 above for `left @ right` (2-d, or 3-d with a batch); None: no rule."""
    k_left, k_right = (2, 1) if batched else (1, 0)
    ref = left if isinstance(left, ShardedTensor) else right
    m, n = left.shape[-2], right.shape[-1]
    shape = (left.shape[0], m, n) if batched else (m, n)
    dtype = torch.promote_types(left.dtype, right.dtype)
    both = isinstance(left, ShardedTensor) and isinstance(right, ShardedTensor)
    if batched and both and left._layout.world_size == right._layout.world_size:
        aligned = _batch_aligned(left, right)
        if aligned is not None:
            return aligned
    if isinstance(left, ShardedTensor) and spans(left._layout, (k_left,)):
        r = whole_or_plain(right)
        keep = (0, 1) if batched else (0,)
        layout = _product_layout(left._layout, keep, shape, keep)
        shards = [
            mult(s, r[b.slices()[0]] if batched else r)
            for s, b in zip(left._shards, left.local_blocks)
        ]
        return left._with_layout(layout, shards, dtype=dtype, device=left.device)
    if isinstance(right, ShardedTensor) and spans(right._layout, (k_right,)):
        lw = whole_or_plain(left)
        keep, where = ((0, 2), (0, 2)) if batched else ((1,), (1,))
        layout = _product_layout(right._layout, keep, shape, where)
        shards = [
            mult(lw[b.slices()[0]] if batched else lw, s)
            for s, b in zip(right._shards, right.local_blocks)
        ]
        return right._with_layout(layout, shards, dtype=dtype, device=right.device)
    if not both:
        return None
    return _contracted(left, right, batched, shape, dtype, mult, ref)


def _batch_aligned(left: ShardedTensor, right: ShardedTensor) -> ShardedTensor | None:
    if not (spans(left._layout, (1, 2)) and spans(right._layout, (1, 2))):
        return None
    for r in range(left._layout.world_size):
        lb, rb = left._layout.blocks_of(r), right._layout.blocks_of(r)
        if [(b.offsets[0], b.sizes[0]) for b in lb] != [(b.offsets[0], b.sizes[0]) for b in rb]:
            return None
    shape = (left.shape[0], left.shape[1], right.shape[2])
    layout = _product_layout(left._layout, (0,), shape, (0,))
    shards = [torch.bmm(a, b) for a, b in zip(left._shards, right._shards)]
    return left._with_layout(layout, shards, dtype=left.dtype, device=left.device)


def _contracted(
    left: ShardedTensor,
    right: ShardedTensor,
    batched: bool,
    shape: tuple[int, ...],
    dtype: torch.dtype,
    mult: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    ref: ShardedTensor,
) -> ShardedTensor | None:
    """Rule 3: matching splits of the contracted dimension, partial products summed."""
    k_left, k_right = (2, 1) if batched else (1, 0)
    other_left = (0, 1) if batched else (0,)
    other_right = (0, 2) if batched else (1,)
    if not (spans(left._layout, other_left) and spans(right._layout, other_right)):
        return None
    world = left._layout.world_size
    if right._layout.world_size != world:
        return None
    for r in range(world):
        kl = [(b.offsets[k_left], b.sizes[k_left]) for b in left._layout.blocks_of(r)]
        kr = [(b.offsets[k_right], b.sizes[k_right]) for b in right._layout.blocks_of(r)]
        if kl != kr:
            return None
    out = torch.zeros(shape, dtype=dtype, device=ref.device)
    for i in primary_blocks(left._layout, left._rank):
        a, b = left._shards[i], right._shards[i]
        if a.numel() and b.numel():
            out.add_(mult(a, b))
    return later(out, "sum", ref)


@_handles(aten.mm.default)
def _mm(func: Any, args: tuple, kwargs: dict) -> Any:
    out = _product(args[0], args[1], False, torch.mm)
    return fallback(func, args, kwargs) if out is None else out


@_handles(aten.bmm.default)
def _bmm(func: Any, args: tuple, kwargs: dict) -> Any:
    out = _product(args[0], args[1], True, torch.bmm)
    return fallback(func, args, kwargs) if out is None else out


@_handles(aten.addmm.default, aten.baddbmm.default)
def _addmm(func: Any, args: tuple, kwargs: dict) -> Any:
    a = named(func, args, kwargs)
    batched = func is aten.baddbmm.default
    left, right = (a["batch1"], a["batch2"]) if batched else (a["mat1"], a["mat2"])
    product = _product(left, right, batched, torch.bmm if batched else torch.mm)
    if product is None:
        return fallback(func, args, kwargs)
    beta, alpha = a.get("beta", 1), a.get("alpha", 1)
    if alpha != 1:
        product = aten.mul.Tensor(product, alpha)
    bias = a["self"]
    if beta == 0:
        return product
    if beta != 1:
        bias = aten.mul.Tensor(bias, beta)
    return aten.add.Tensor(product, bias)


# -- embeddings ---------------------------------------------------------------------


@_handles(aten.embedding.default)
def _embedding(func: Any, args: tuple, kwargs: dict) -> Any:
    a = named(func, args, kwargs)
    weight, indices = a["weight"], a["indices"]
    rest = (a["padding_idx"], a["scale_grad_by_freq"], a["sparse"])
    dim = weight.shape[1]
    shape = (*indices.shape, dim)
    if (
        isinstance(indices, ShardedTensor)
        and _is_whole(weight)
        and not is_replicated(indices._layout)
    ):
        w = whole_or_plain(weight)
        keep = tuple(range(indices.ndim))
        layout = _product_layout(indices._layout, keep, shape, keep)
        shards = [func(w, s, *rest) for s in indices._shards]
        return indices._with_layout(layout, shards, dtype=weight.dtype, device=indices.device)
    if isinstance(weight, ShardedTensor) and _is_whole(indices):
        idx = whole_or_plain(indices)
        if spans(weight._layout, (0,)):  # column-wise: each block its columns
            layout = _product_layout(weight._layout, (1,), shape, (len(shape) - 1,))
            shards = [func(s, idx, *rest) for s in weight._shards]
            return weight._with_layout(layout, shards, dtype=weight.dtype, device=weight.device)
        if spans(weight._layout, (1,)):  # row-wise: masked local lookups, one sum
            out = torch.zeros(shape, dtype=weight.dtype, device=weight.device)
            blocks = weight._layout.blocks_of(weight._rank)
            for i in primary_blocks(weight._layout, weight._rank):
                lo, size = blocks[i].offsets[0], blocks[i].sizes[0]
                if not size:
                    continue
                mine = (idx >= lo) & (idx < lo + size)
                rows = torch.nn.functional.embedding(
                    (idx - lo).clamp(0, size - 1), weight._shards[i]
                )
                # where, not a product: another rank's row never counts, even as 0·inf
                out.add_(torch.where(mine.unsqueeze(-1), rows, torch.zeros((), dtype=rows.dtype)))
            return later(out, "sum", weight)
    return fallback(func, args, kwargs)


@_handles(aten.embedding_dense_backward.default)
def _embedding_backward(func: Any, args: tuple, kwargs: dict) -> Any:
    a = named(func, args, kwargs)
    grad, indices = a["grad_output"], a["indices"]
    rows = a["num_weights"]
    rest = (rows, a["padding_idx"], a["scale_grad_by_freq"])
    if not isinstance(grad, ShardedTensor) or a["scale_grad_by_freq"]:
        return fallback(func, args, kwargs)
    dim = grad.shape[-1]
    lead = tuple(range(grad.ndim - 1))
    if _is_whole(indices) and spans(grad._layout, lead):  # column-wise table
        idx = whole_or_plain(indices)
        layout = _product_layout(grad._layout, (grad.ndim - 1,), (rows, dim), (1,))
        shards = [func(s, idx, *rest) for s in grad._shards]
        return grad._with_layout(layout, shards)
    if isinstance(indices, ShardedTensor) and spans(grad._layout, (grad.ndim - 1,)):
        if not _same_blocks(indices._layout, grad._layout):
            return fallback(func, args, kwargs)
        out = torch.zeros((rows, dim), dtype=grad.dtype, device=grad.device)
        for i in primary_blocks(grad._layout, grad._rank):
            out.add_(func(grad._shards[i], indices._shards[i], *rest))
        return later(out, "sum", grad)
    return fallback(func, args, kwargs)


# `embedding_bag`: the bags' sums, means or maxima of looked-up rows. On a column-wise
# table each block reduces its own columns (no communication); on a row-wise one each
# rank sums the rows it holds, those of the others weighted 0, and the result is a
# pending sum (`pending`: one all-reduce of bags × dim on first use); a mean divides
# each part by the bag's size. A row-wise maximum has no rule (a row a rank lacks would
# have to be -inf, not 0): it falls back, as sparse gradients do.

_BAG_SUM, _BAG_MEAN, _BAG_MAX = 0, 1, 2


@_handles(aten._embedding_bag.default, aten._embedding_bag_forward_only.default)
def _embedding_bag(func: Any, args: tuple, kwargs: dict) -> Any:
    a = named(func, args, kwargs)
    weight, mode = a["weight"], a["mode"]
    plain = (a["indices"], a["offsets"], a["per_sample_weights"])
    if not isinstance(weight, ShardedTensor) or not all(_is_whole(t) for t in plain):
        return fallback(func, args, kwargs)
    idx, offsets, psw = (whole_or_plain(t) for t in plain)
    flags = {k: a[k] for k in ("scale_grad_by_freq", "sparse", "include_last_offset")}
    rows, dim = weight.shape
    # what depends on the indices alone (bag of each index, bag sizes), from no columns
    empty = torch.empty((rows, 0), dtype=weight.dtype, device=weight.device)

    def bag(table: torch.Tensor) -> Any:
        return func(
            table,
            idx,
            offsets,
            mode=mode,
            per_sample_weights=psw,
            padding_idx=a["padding_idx"],
            **flags,
        )

    aux = bag(empty)
    bags = aux[0].shape[0]
    if spans(weight._layout, (0,)):  # column-wise: each block its columns
        results = [bag(s) for s in weight._shards]
        layout = _product_layout(weight._layout, (1,), (bags, dim), (1,))
        out = weight._with_layout(
            layout, [r[0] for r in results], dtype=weight.dtype, device=weight.device
        )
        if mode != _BAG_MAX:
            return out, aux[1], aux[2], aux[3]
        argmax = weight._with_layout(
            layout, [r[3] for r in results], dtype=aux[3].dtype, device=weight.device
        )
        return out, aux[1], aux[2], argmax
    if mode == _BAG_MAX or not spans(weight._layout, (1,)):
        return fallback(func, args, kwargs)
    # each index's bag, from the offsets (the op's own offset2bag is not filled without grad)
    starts = offsets[:-1] if a["include_last_offset"] else offsets
    positions = torch.arange(idx.numel(), device=idx.device)
    bag_of = torch.searchsorted(starts, positions, right=True) - 1
    keep = (
        idx != a["padding_idx"] if a["padding_idx"] >= 0 else torch.ones_like(idx, dtype=torch.bool)
    )
    parts = torch.zeros((bags, dim), dtype=weight.dtype, device=weight.device)
    blocks = weight._layout.blocks_of(weight._rank)
    for i in primary_blocks(weight._layout, weight._rank):
        lo, size = blocks[i].offsets[0], blocks[i].sizes[0]
        if not size:
            continue
        # only the rows this block holds are read: another's never counts, even as 0·inf
        mine = (idx >= lo) & (idx < lo + size) & keep
        looked = weight._shards[i][idx[mine] - lo]
        if psw is not None:
            looked = looked * psw[mine].unsqueeze(1).to(looked.dtype)
        parts.index_add_(0, bag_of[mine], looked)
    if mode == _BAG_MEAN:  # the same divisor on every rank: each part divided
        sizes = torch.bincount(bag_of[keep], minlength=bags).clamp(min=1)
        parts = parts / sizes.unsqueeze(1).to(parts.dtype)
    return later(parts, "sum", weight), aux[1], aux[2], aux[3]


@_handles(aten._embedding_bag_backward.default)
def _embedding_bag_backward(func: Any, args: tuple, kwargs: dict) -> Any:
    a = named(func, args, kwargs)
    grad = a["grad"]
    plain = ("indices", "offsets", "offset2bag", "bag_size", "per_sample_weights")
    if (
        not isinstance(grad, ShardedTensor)
        or a["sparse"]
        or not all(_is_whole(a[k]) for k in plain)
    ):
        return fallback(func, args, kwargs)
    rest = [whole_or_plain(a[k]) for k in ("indices", "offsets", "offset2bag", "bag_size")]
    tail = (a["num_weights"], a["scale_grad_by_freq"], a["mode"], False)
    after = (whole_or_plain(a["per_sample_weights"]), a["padding_idx"])
    argmax = a["maximum_indices"]
    shape = (a["num_weights"], grad.shape[1])
    if is_replicated(grad._layout):  # a row-wise table's (or a whole) gradient: dense
        value = func(grad._shards[0], *rest, whole_or_plain(argmax), *tail, *after)
        return grad._with_layout(replicated(shape, grad._layout.world_size), [value])
    if not spans(grad._layout, (0,)):
        return fallback(func, args, kwargs)
    # column-wise: each block the gradient of its columns
    if isinstance(argmax, ShardedTensor):
        argmaxes = local_in(argmax, grad._layout)
    else:
        argmaxes = [argmax] * len(grad._shards)
    shards = [func(g, *rest, m, *tail, *after) for g, m in zip(grad._shards, argmaxes)]
    layout = _product_layout(grad._layout, (1,), shape, (1,))
    return grad._with_layout(layout, shards, dtype=grad.dtype, device=grad.device)


@functools.lru_cache(maxsize=512)
def _same_blocks(indices: Layout, grad: Layout) -> bool:
    """Every rank's index blocks are its gradient blocks without the last dim (a decision
    every rank takes alike, from the layouts)."""
    return indices.world_size == grad.world_size and all(
        [b for b in indices.blocks_of(r)]
        == [Block(g.offsets[:-1], g.sizes[:-1]) for g in grad.blocks_of(r)]
        for r in range(grad.world_size)
    )


# -- convolution ----------------------------------------------------------------------


@_handles(aten.convolution.default)
def _convolution(func: Any, args: tuple, kwargs: dict) -> Any:
    a = named(func, args, kwargs)
    x = a["input"]
    if not isinstance(x, ShardedTensor) or not (_is_whole(a["weight"]) and _is_whole(a["bias"])):
        return fallback(func, args, kwargs)
    w, bias = whole_or_plain(a["weight"]), whole_or_plain(a["bias"])
    rest = [a[k] for k in ("stride", "padding", "dilation", "transposed", "output_padding")]
    if not spans(x._layout, tuple(range(1, x.ndim))):
        plan = _halo_plan(x, w, a)
        if plan is None:
            return fallback(func, args, kwargs)
        meta = func(
            torch.empty(x.shape, dtype=x.dtype, device="meta"),
            torch.empty(w.shape, dtype=w.dtype, device="meta"),
            None if bias is None else torch.empty(bias.shape, dtype=bias.dtype, device="meta"),
            *rest,
            a["groups"],
        )
        return conv_forward(func, x, w, bias, a, plan, meta)
    shards = [func(s, w, bias, *rest, a["groups"]) for s in x._shards]
    meta = func(
        torch.empty(x.shape, dtype=x.dtype, device="meta"),
        torch.empty(w.shape, dtype=w.dtype, device="meta"),
        None if bias is None else torch.empty(bias.shape, dtype=bias.dtype, device="meta"),
        *rest,
        a["groups"],
    )
    layout = _product_layout(x._layout, (0,), tuple(meta.shape), (0,))
    return x._with_layout(layout, shards, dtype=meta.dtype, device=x.device)


@_handles(aten.convolution_backward.default)
def _convolution_backward(func: Any, args: tuple, kwargs: dict) -> Any:
    a = named(func, args, kwargs)
    grad, x = a["grad_output"], a["input"]
    if not (isinstance(x, ShardedTensor) and isinstance(grad, ShardedTensor)):
        return fallback(func, args, kwargs)
    if not _is_whole(a["weight"]):
        return fallback(func, args, kwargs)
    if not spans(x._layout, tuple(range(1, x.ndim))):
        plan = _halo_plan(x, whole_or_plain(a["weight"]), a)
        if plan is None:
            return fallback(func, args, kwargs)
        return conv_backward(func, grad, x, whole_or_plain(a["weight"]), a, plan)
    out_layout = _product_layout(x._layout, (0,), tuple(grad.shape), (0,))
    grads = local_in(grad, out_layout)
    w = whole_or_plain(a["weight"])
    rest = [
        a[k]
        for k in (
            "bias_sizes",
            "stride",
            "padding",
            "dilation",
            "transposed",
            "output_padding",
            "groups",
        )
    ]
    mask = list(a["output_mask"])
    grad_in, grad_w, grad_b = [], None, None
    primary = set(primary_blocks(x._layout, x._rank))
    for i, (g, s) in enumerate(zip(grads, x._shards)):
        gi, gw, gb = func(g, s, w, *rest, mask)
        grad_in.append(gi)
        if i in primary and s.numel():
            if mask[1]:
                grad_w = gw if grad_w is None else grad_w + gw
            if mask[2]:
                grad_b = gb if grad_b is None else grad_b + gb
    w_meta = torch.empty(w.shape, dtype=w.dtype, device="meta")
    b_meta = torch.empty(list(a["bias_sizes"] or [0]), dtype=w.dtype, device="meta")
    return (
        x._with_layout(x._layout, grad_in, dtype=x.dtype, device=x.device) if mask[0] else None,
        summed(grad_w, w_meta, x) if mask[1] else None,
        summed(grad_b, b_meta, x) if mask[2] else None,
    )


def _halo_plan(x: ShardedTensor, weight: torch.Tensor, a: dict) -> Any:
    """The halo exchange's plan for an input split along spatial dimensions only, or None."""
    if a["transposed"]:
        return None
    dims = sharded_spatial_dims(x._layout)
    if dims is None:
        return None
    return conv_plan(
        x._layout,
        dims,
        tuple(int(weight.shape[d]) for d in dims),
        tuple(int(a["stride"][d - 2]) for d in dims),
        tuple(int(a["padding"][d - 2]) for d in dims),
        tuple(int(a["dilation"][d - 2]) for d in dims),
    )
