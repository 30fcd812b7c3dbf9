"""Convolutions and pooling along a sharded spatial dimension: a halo exchange,
PhysicsNeMo's main use (pooling: the section at the end).

An input `[N, C, *spatial]` split along spatial dimensions only (every block
spanning the batch and channels, no replicas; along several dims, any grid of
uneven boxes): each block computes the outputs whose window starts
(`j·stride`) fall in it along each split dim, the first block from output 0
and the last one to the end. For that it needs the input rows of its windows:
its own rows plus a halo of up to `dilation·(kernel−1)` rows (less the padding)
along each split dim — the corners included — from the blocks that hold them,
fetched in one all-to-all (`regions`, which takes any box); rows beyond the
tensor's edges are the convolution's zero padding. The local convolution then
runs without padding along the split dims.

Backward: the same halo is fetched again, the local `convolution_backward`
gives the gradient of the block's extended rows, and the halo parts of it are
sent back and added to their owners' blocks (`add_regions`, the reverse
all-to-all); weight and bias gradients are summed by one all-reduce.

Bytes per rank: the halo rows (about `dilation·(kernel−1)·N·C·(other extents)`
elements) each way, forward and backward, plus 2× the weight in backward.
Planning is O(blocks of the layout) per rank, from the layout every rank has.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

from ..comm.communicator import communicator
from ..layout import Block, Layout
from ..tensor import ShardedTensor
from .exchange import _distributed, local_in
from .per_shard import blocks_mapped, empty_block
from .reductions import summed

__all__ = [
    "add_regions",
    "conv_backward",
    "conv_forward",
    "conv_plan",
    "pool_backward",
    "pool_forward",
    "regions",
    "sharded_spatial_dim",
    "sharded_spatial_dims",
    "upsample_backward",
    "upsample_factor",
    "upsample_forward",
    "upsample_input_layout",
    "upsample_plan",
]


# -- the region exchange ----------------------------------------------------------------

# (destination rank, index of its wanted region, source rank, source block, intersection)
_Move = tuple[int, int, int, int, Block]


@functools.lru_cache(maxsize=512)
def _moves(layout: Layout, wants: tuple[tuple[Block, ...], ...]) -> tuple[_Move, ...]:
    """Every piece of every rank's wanted regions, with the one rank that holds it."""
    out = []
    for q, regions in enumerate(wants):
        for i, region in enumerate(regions):
            for src in range(layout.world_size):
                for k, block in enumerate(layout.blocks_of(src)):
                    if block.is_empty() or layout.ranks_holding(block)[0] != src:
                        continue
                    part = block.intersect(region)
                    if part is not None and not part.is_empty():
                        out.append((q, i, src, k, part))
    return tuple(out)


def _view(t: torch.Tensor, outer: Block, part: Block) -> torch.Tensor:
    return t[part.relative_to(outer).slices()]


def regions(st: ShardedTensor, wants: tuple[tuple[Block, ...], ...]) -> list[torch.Tensor]:
    """This rank's wanted regions (`wants[rank]`, boxes of the global tensor) filled from
    `st`, in one all-to-all; every rank passes the same `wants`."""
    me, layout = st._rank, st._layout
    blocks = layout.blocks_of(me)
    out = [torch.empty(r.sizes, dtype=st.dtype, device=st.device) for r in wants[me]]
    sends: list[list[torch.Tensor]] = [[] for _ in range(layout.world_size)]
    recvs: list[list[tuple[int, Block]]] = [[] for _ in range(layout.world_size)]
    for q, i, src, k, part in _moves(layout, wants):
        if src == me and q == me:
            _view(out[i], wants[me][i], part).copy_(_view(st._shards[k], blocks[k], part))
        elif src == me:
            sends[q].append(_view(st._shards[k], blocks[k], part).reshape(-1))
        elif q == me:
            recvs[src].append((i, part))
    _all_to_all(st, sends, recvs, out, wants[me], add=False)
    return out


def add_regions(
    st: ShardedTensor, wants: tuple[tuple[Block, ...], ...], values: list[torch.Tensor]
) -> list[torch.Tensor]:
    """The reverse of `regions`: each rank's `values` (one per wanted region) summed into
    the blocks of `st`'s layout that hold those elements. Returns this rank's shards."""
    me, layout = st._rank, st._layout
    blocks = layout.blocks_of(me)
    out = [
        torch.zeros(b.sizes, dtype=values[0].dtype if values else st.dtype, device=st.device)
        for b in blocks
    ]
    sends: list[list[torch.Tensor]] = [[] for _ in range(layout.world_size)]
    recvs: list[list[tuple[int, Block]]] = [[] for _ in range(layout.world_size)]
    for q, i, src, k, part in _moves(layout, wants):
        # reversed: the wanting rank q sends its values of `part` to the holder src
        if src == me and q == me:
            _view(out[k], blocks[k], part).add_(_view(values[i], wants[me][i], part))
        elif q == me:
            sends[src].append(_view(values[i], wants[me][i], part).reshape(-1))
        elif src == me:
            recvs[q].append((k, part))
    _all_to_all(st, sends, recvs, out, blocks, add=True)
    return out


def _all_to_all(
    st: ShardedTensor,
    sends: list[list[torch.Tensor]],
    recvs: list[list[tuple[int, Block]]],
    out: list[torch.Tensor],
    outers: tuple[Block, ...],
    *,
    add: bool,
) -> None:
    if not _distributed(st):
        return
    world = st._layout.world_size
    send_counts = [sum(t.numel() for t in ts) for ts in sends]
    recv_counts = [sum(p.numel for _, p in rs) for rs in recvs]
    dtype = out[0].dtype if out else st.dtype
    send = (
        torch.cat([t for ts in sends for t in ts]).to(dtype)
        if any(send_counts)
        else torch.empty(0, dtype=dtype, device=st.device)
    )
    recv = torch.empty(sum(recv_counts), dtype=dtype, device=st.device)
    size = recv.element_size()  # as bytes: any dtype on any backend (gloo sends no int16)
    communicator(st.group).all_to_all_single(
        recv.view(torch.uint8),
        send.view(torch.uint8),
        [n * size for n in recv_counts],
        [n * size for n in send_counts],
    ).wait()
    at = 0
    for src in range(world):
        for i, part in recvs[src]:
            piece = recv[at : at + part.numel].view(part.sizes)
            target = _view(out[i], outers[i], part)
            target.add_(piece) if add else target.copy_(piece)
            at += part.numel


# -- the convolution plan ---------------------------------------------------------------


class ConvPlan:
    """Per rank, per block, per split dim: its output rows and the input rows its windows
    need. `dims` are the split spatial dims; the other entries are per split dim."""

    def __init__(
        self,
        layout: Layout,
        dims: tuple[int, ...],
        kernel: tuple[int, ...],
        stride: tuple[int, ...],
        padding: tuple[int, ...],
        dilation: tuple[int, ...],
        out_lengths: tuple[int, ...] | None = None,
    ) -> None:
        shape = layout.global_shape
        self.dims = dims
        self.lengths = tuple(shape[d] for d in dims)
        if out_lengths is None:  # a convolution's; a pooling in ceil mode may have one more
            out_lengths = tuple(
                (n + 2 * p - d * (k - 1) - 1) // s + 1
                for n, k, s, p, d in zip(self.lengths, kernel, stride, padding, dilation)
            )
        self.out_lengths = out_lengths
        # per rank, per block, per split dim: [o0, o1) of the output, [lo, hi) of the input
        # (unclipped: rows past the edges are padding)
        self.outputs: list[list[tuple[tuple[int, int], ...]]] = []
        self.inputs: list[list[tuple[tuple[int, int], ...]]] = []
        wants = []
        for rank_blocks in layout.blocks:
            outs, ins, want = [], [], []
            for b in rank_blocks:
                offsets, sizes = list(b.offsets), list(b.sizes)
                block_outs, block_ins = [], []
                for i, dim in enumerate(dims):
                    o0, o1, lo, hi = _rows(
                        b, dim, self.lengths[i], out_lengths[i],
                        kernel[i], stride[i], padding[i], dilation[i],
                    )  # fmt: skip
                    block_outs.append((o0, o1))
                    block_ins.append((lo, hi))
                    offsets[dim] = min(max(lo, 0), self.lengths[i])
                    sizes[dim] = max(0, min(hi, self.lengths[i]) - offsets[dim]) if o1 > o0 else 0
                outs.append(tuple(block_outs))
                ins.append(tuple(block_ins))
                want.append(Block(tuple(offsets), tuple(sizes)))
            self.outputs.append(outs)
            self.inputs.append(ins)
            wants.append(tuple(want))
        self.wants = tuple(wants)


def _rows(
    b: Block, dim: int, length: int, out_length: int, k: int, s: int, p: int, d: int
) -> tuple[int, int, int, int]:
    """Along `dim`: the outputs `[o0, o1)` whose windows start in block `b` (the first
    block from 0, the last to the end) and the input rows `[lo, hi)` they read."""
    a, e = b.offsets[dim], b.offsets[dim] + b.sizes[dim]
    if b.is_empty():
        o0 = o1 = 0
    else:
        o0 = 0 if a == 0 else -(-a // s)
        o1 = out_length if e == length else -(-e // s)
        o1 = min(o1, out_length)
    o1 = max(o0, o1)
    lo = o0 * s - p
    hi = (o1 - 1) * s - p + d * (k - 1) + 1 if o1 > o0 else lo
    return o0, o1, lo, hi


def _produces(outs: tuple[tuple[int, int], ...]) -> bool:
    """Whether a block has outputs: some along every split dim."""
    return all(o1 > o0 for o0, o1 in outs)


def _emptied(shape: Sequence[int], plan: ConvPlan) -> list[int]:
    """The shape of a block's result that has no outputs."""
    out = list(shape)
    out[plan.dims[0]] = 0
    return out


@functools.lru_cache(maxsize=512)
def conv_plan(
    layout: Layout,
    dims: tuple[int, ...],
    kernel: tuple[int, ...],
    stride: tuple[int, ...],
    padding: tuple[int, ...],
    dilation: tuple[int, ...],
    out_lengths: tuple[int, ...] | None = None,
) -> ConvPlan | None:
    """The plan when `layout` splits only spatial dimensions `dims` and has no replicas."""
    if not _split_only_along(layout, dims):
        return None
    return ConvPlan(layout, dims, kernel, stride, padding, dilation, out_lengths)


def _split_only_along(layout: Layout, dims: tuple[int, ...]) -> bool:
    """Every block whole along every dim but `dims`, and no replicas (the region exchange
    sends each element from its one holder, and adds gradients into it)."""
    shape = layout.global_shape
    for rank_blocks in layout.blocks:
        for b in rank_blocks:
            if b.is_empty():
                continue
            if any(
                b.offsets[e] != 0 or b.sizes[e] != shape[e]
                for e in range(len(shape))
                if e not in dims
            ):
                return False
    if layout.allow_holes:  # a hole's rows hold nothing to send
        return False
    return not any(not b.is_empty() for b in layout.replica_groups)


def sharded_spatial_dims(layout: Layout) -> tuple[int, ...] | None:
    """The spatial dimensions (≥ 2) some block does not span, if any and only those."""
    shape = layout.global_shape
    split = {
        e
        for rank_blocks in layout.blocks
        for b in rank_blocks
        if not b.is_empty()
        for e in range(len(shape))
        if b.sizes[e] != shape[e]
    }
    if split and min(split) >= 2:
        return tuple(sorted(split))
    return None


def sharded_spatial_dim(layout: Layout) -> int | None:
    """The one spatial dimension (≥ 2) some block does not span, if exactly one."""
    dims = sharded_spatial_dims(layout)
    return dims[0] if dims is not None and len(dims) == 1 else None


def _padded(x: torch.Tensor, dim: int, before: int, after: int, fill: float) -> torch.Tensor:
    if before <= 0 and after <= 0:
        return x
    pads = [0, 0] * (x.ndim - dim - 1) + [max(before, 0), max(after, 0)]
    return torch.nn.functional.pad(x, pads, value=fill)


def _extended(st: ShardedTensor, plan: ConvPlan, fill: float = 0.0) -> list[torch.Tensor]:
    """Each block's input rows with their halo, padded with `fill` past the tensor's edges
    (a convolution's and an average's zeros, a max pool's -inf), along each split dim."""
    fetched = regions(st, plan.wants)
    out = []
    for x, ins in zip(fetched, plan.inputs[st._rank]):
        for dim, (lo, hi) in zip(plan.dims, ins):
            before = _before(lo, hi)
            x = _padded(x, dim, before, hi - lo - before - x.shape[dim], fill)
        out.append(x)
    return out


def _before(lo: int, hi: int) -> int:
    """How many of the input rows `[lo, hi)` lie before the tensor's first row (all of
    them for windows wholly in a padding wider than the kernel's reach)."""
    return min(max(-lo, 0), hi - lo)


def _trimmed(g: torch.Tensor, plan: ConvPlan, ins: Any, want: Block) -> torch.Tensor:
    """The gradient of a block's extended rows without the padding past the edges: its
    wanted (clipped) rows, along each split dim."""
    for dim, (lo, hi) in zip(plan.dims, ins):
        g = g.narrow(dim, _before(lo, hi), want.sizes[dim])
    return g


def _out_layout(x: ShardedTensor, plan: ConvPlan, shape: tuple[int, ...]) -> Layout:
    return _out_layout_cached(x._layout, plan, shape)


@functools.lru_cache(maxsize=512)
def _out_layout_cached(layout: Layout, plan: ConvPlan, shape: tuple[int, ...]) -> Layout:
    blocks: dict[int, list[Block]] = {}
    for r, outs in enumerate(plan.outputs):
        row = []
        for block_outs in outs:
            if not _produces(block_outs):
                row.append(empty_block(len(shape)))
                continue
            offsets, sizes = [0] * len(shape), list(shape)
            for dim, (o0, o1) in zip(plan.dims, block_outs):
                offsets[dim], sizes[dim] = o0, o1 - o0
            row.append(Block(tuple(offsets), tuple(sizes)))
        blocks[r] = row
    return Layout(shape, blocks, layout.world_size)


def _geometry(a: dict, padding: list[int]) -> tuple[Any, ...]:
    """The convolution's arguments after its tensors, with the local `padding`."""
    return (
        a["stride"],
        padding,
        a["dilation"],
        a["transposed"],
        a["output_padding"],
        a["groups"],
    )


def _unpadded(padding: Sequence[int], plan: ConvPlan) -> list[int]:
    """The op's padding with none along the split dims (their halo holds it)."""
    out = list(padding)
    for dim in plan.dims:
        out[dim - 2] = 0
    return out


def conv_forward(
    func: Any, x: ShardedTensor, weight: torch.Tensor, bias: Any, a: dict, plan: ConvPlan, meta: Any
) -> ShardedTensor:
    padding = _unpadded(a["padding"], plan)
    shards = []
    for ext, outs in zip(_extended(x, plan), plan.outputs[x._rank]):
        if not _produces(outs):
            shards.append(
                torch.empty(_emptied(meta.shape, plan), dtype=meta.dtype, device=x.device)
            )
            continue
        shards.append(func(ext, weight, bias, *_geometry(a, padding)))
    layout = _out_layout(x, plan, tuple(meta.shape))
    return x._with_layout(layout, shards, dtype=meta.dtype, device=x.device)


def conv_backward(
    func: Any, grad: ShardedTensor, x: ShardedTensor, weight: torch.Tensor, a: dict, plan: ConvPlan
) -> tuple[Any, Any, Any]:
    padding = _unpadded(a["padding"], plan)
    out_layout = _out_layout(x, plan, tuple(grad.shape))
    grads = local_in(grad, out_layout)
    mask = list(a["output_mask"])
    ext_grads: list[torch.Tensor] = []
    grad_w = grad_b = None
    for g, ext, outs, ins, want in zip(
        grads, _extended(x, plan), plan.outputs[x._rank], plan.inputs[x._rank], plan.wants[x._rank]
    ):
        if not _produces(outs):
            ext_grads.append(torch.zeros(want.sizes, dtype=x.dtype, device=x.device))
            continue
        gi, gw, gb = func(
            g,
            ext,
            weight,
            a["bias_sizes"],
            *_geometry(a, padding),
            [True, mask[1], mask[2]],
        )
        ext_grads.append(_trimmed(gi, plan, ins, want))
        if mask[1]:
            grad_w = gw if grad_w is None else grad_w + gw
        if mask[2]:
            grad_b = gb if grad_b is None else grad_b + gb
    grad_in = add_regions(x, plan.wants, ext_grads) if mask[0] else []
    out_in = x._with_layout(x._layout, grad_in, dtype=x.dtype, device=x.device) if mask[0] else None

    w_meta = torch.empty(weight.shape, dtype=weight.dtype, device="meta")
    b_meta = torch.empty(list(a["bias_sizes"] or [0]), dtype=weight.dtype, device="meta")
    w = summed(grad_w, w_meta, x) if mask[1] else None
    b = summed(grad_b, b_meta, x) if mask[2] else None
    return out_in, w, b


# -- pooling --------------------------------------------------------------------------
#
# A pooling window is a convolution's without weights: the same plan, each block's
# outputs those whose windows start in it, its rows fetched with their halo. Past the
# tensor's edges a max pool's rows hold -inf (an integer pool's: its minimum; torch
# skips them), an average's zeros; the local op runs without padding along the split
# dims and sums its windows (`divisor_override=1`), and each sum is divided once by
# torch's count for its window (the padding counted or not, a ceil-mode window cut at
# the padded edge): the same rounding as torch's.
# A max pool's indices are flat over the whole spatial extent, as torch's: each block's
# are moved by where its rows start, and a window whose elements are all the fill picks
# its first row in the tensor, as torch's does.
# Backward: the local backward on each block's extended rows (a max pool's by the
# indices, an average's spread), the halo parts sent back to their owners and added.


_HALF = (torch.float16, torch.bfloat16)


class PoolArgs(NamedTuple):
    """A pooling op's geometry, one entry per spatial dim."""

    kernel: tuple[int, ...]
    stride: tuple[int, ...]
    padding: tuple[int, ...]
    dilation: tuple[int, ...]


def pool_args(a: dict, spatial: int) -> PoolArgs:
    def each(v: Any, default: Any) -> tuple[int, ...]:
        v = list(v) if isinstance(v, (list, tuple)) else [v]
        v = v or list(default)
        return tuple(int(e) for e in (v * spatial if len(v) == 1 else v))

    kernel = each(a["kernel_size"], ())
    return PoolArgs(
        kernel,
        each(a["stride"], kernel),
        each(a["padding"], (0,)),
        each(a.get("dilation", 1), (1,)),
    )


def pool_plan(x: ShardedTensor, g: PoolArgs, out_shape: Sequence[int]) -> ConvPlan | None:
    """The halo plan for a batched input split along spatial dims only (the op's output
    of `out_shape`), or None."""
    dims = sharded_spatial_dims(x._layout)
    if dims is None or x.ndim != 2 + len(g.kernel) or len(out_shape) != x.ndim:
        return None

    def each(values: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(values[d - 2] for d in dims)

    return conv_plan(
        x._layout,
        dims,
        each(g.kernel),
        each(g.stride),
        each(g.padding),
        each(g.dilation),
        tuple(int(out_shape[d]) for d in dims),
    )


def _divisors(
    g: PoolArgs, plan: ConvPlan, outs: Any, include_pad: bool, out: torch.Tensor,
    whole: Sequence[int],
) -> torch.Tensor:  # fmt: skip
    """Per output element of a block (`out`): torch's divisor, its window's count (the
    padding counted or not), a product of one count per spatial dim of the whole input
    `whole`, shaped to broadcast over `out`. The local op sums (`divisor_override=1`)
    and this divides once, as torch does: the same rounding."""
    split = dict(zip(plan.dims, outs))
    result: torch.Tensor | None = None
    for i, n in enumerate(whole):
        dim = i + 2
        k, s, p = g.kernel[i], g.stride[i], g.padding[i]
        o0, o1 = split.get(dim, (0, out.shape[dim]))
        counts = []
        for j in range(o0, o1):
            start = j * s - p
            end = min(start + k, n + p)
            counts.append(end - start if include_pad else min(end, n) - max(start, 0))
        shape = [1] * out.ndim
        shape[dim] = o1 - o0
        count = torch.tensor(counts, dtype=out.dtype, device=out.device).view(shape)
        result = count if result is None else result * count
    assert result is not None  # a pooling has spatial dims
    return result


def _unravel(idx: torch.Tensor, spatial: Sequence[int]) -> list[torch.Tensor]:
    """Flat indices over a `spatial` extent as one coordinate per spatial dim."""
    coords = []
    for n in reversed(spatial):
        coords.append(idx.remainder(n))
        idx = idx.div(n, rounding_mode="floor")
    return coords[::-1]


def _ravel(coords: list[torch.Tensor], spatial: Sequence[int]) -> torch.Tensor:
    out = coords[0]
    for c, n in zip(coords[1:], spatial[1:]):
        out = out * n + c
    return out


def _global_indices(
    idx: torch.Tensor, plan: ConvPlan, g: PoolArgs, ext: tuple[int, ...], ins: Any, outs: Any,
    whole: tuple[int, ...],
) -> torch.Tensor:  # fmt: skip
    """A block's max-pool indices over its extended rows (spatial extent `ext`, from
    global rows `ins[i][0]` along each split dim) as the whole tensor's (extent `whole`).
    A window whose real elements are all -inf (or the integer minimum) picks its first
    element here, in a padding row; torch picks its first row in the tensor."""
    coords = _unravel(idx, ext)
    for dim, (lo, _hi), (o0, _o1) in zip(plan.dims, ins, outs):
        i = dim - 2
        row = coords[i] + lo
        s, p, d = g.stride[i], g.padding[i], g.dilation[i]
        starts = [j * s - p for j in range(o0, o0 + idx.shape[dim])]
        first = [h if h >= 0 else h + (-h + d - 1) // d * d for h in starts]
        shape = [1] * idx.ndim
        shape[dim] = len(first)
        first_rows = torch.tensor(first, dtype=row.dtype, device=row.device).view(shape)
        coords[i] = torch.where(row < 0, first_rows, row)
    return _ravel(coords, whole)


def _local_indices(
    idx: torch.Tensor, plan: ConvPlan, whole: tuple[int, ...], ext: tuple[int, ...], ins: Any
) -> torch.Tensor:
    """The whole tensor's max-pool indices (spatial extent `whole`) as a block's over its
    extended rows (extent `ext`, from global rows `ins[i][0]` along each split dim)."""
    coords = _unravel(idx, whole)
    for dim, (lo, _hi) in zip(plan.dims, ins):
        coords[dim - 2] = coords[dim - 2] - lo
    return _ravel(coords, ext)


def _pool_fill(dtype: torch.dtype) -> float:
    """What a max pool's rows past the edges hold: below every element (ties lose)."""
    return float("-inf") if dtype.is_floating_point else float(torch.iinfo(dtype).min)


def pool_forward(
    func: Any, x: ShardedTensor, a: dict, g: PoolArgs, plan: ConvPlan, meta: Any
) -> Any:
    """A pooling op's result (a max pool's with its indices) along the split dims."""
    is_max = "max" in func._schema.name
    metas = meta if isinstance(meta, (tuple, list)) else (meta,)
    rank, padding = x._rank, _unpadded(g.padding, plan)
    fill = _pool_fill(x.dtype) if is_max else 0.0
    whole = tuple(x.shape[2:])
    results: list[list[torch.Tensor]] = [[] for _ in metas]
    for ext, outs, ins in zip(_extended(x, plan, fill), plan.outputs[rank], plan.inputs[rank]):
        if not _produces(outs):
            for j, m in enumerate(metas):
                results[j].append(
                    torch.empty(_emptied(m.shape, plan), dtype=m.dtype, device=x.device)
                )
            continue
        if is_max:
            out, idx = func(ext, list(g.kernel), list(g.stride), padding, list(g.dilation),
                            a["ceil_mode"])  # fmt: skip
            results[0].append(out)
            spatial = tuple(ext.shape[2:])
            results[1].append(_global_indices(idx, plan, g, spatial, ins, outs, whole))
            continue
        # an average of half-precision rows in float32, rounded once (as torch's kernel)
        wide = ext.float() if ext.dtype in _HALF else ext
        divisor = a["divisor_override"]
        out = func(wide, list(g.kernel), list(g.stride), padding, a["ceil_mode"],
                   a["count_include_pad"], 1 if divisor is None else divisor)  # fmt: skip
        if divisor is None:  # the window sums, divided by torch's counts
            out = out / _divisors(g, plan, outs, a["count_include_pad"], out, whole)
        results[0].append(out.to(metas[0].dtype))
    results_out = []
    for j, m in enumerate(metas):
        layout = _out_layout(x, plan, tuple(m.shape))
        results_out.append(x._with_layout(layout, results[j], dtype=m.dtype, device=x.device))
    return tuple(results_out) if isinstance(meta, (tuple, list)) else results_out[0]


def pool_backward(
    func: Any, grad: ShardedTensor, x: ShardedTensor, a: dict, g: PoolArgs, plan: ConvPlan
) -> ShardedTensor:
    """The input's gradient of a pooling op along the split dims."""
    is_max = "max" in func._schema.name
    rank, padding = x._rank, _unpadded(g.padding, plan)
    out_layout = _out_layout(x, plan, tuple(grad.shape))
    grads = local_in(grad, out_layout)
    if is_max:
        indices = a["indices"]
        if not isinstance(indices, ShardedTensor):
            indices = x._with_layout(
                out_layout,
                [indices[b.slices()] for b in out_layout.blocks_of(rank)],
                dtype=indices.dtype,
                device=x.device,
            )
        idxs = local_in(indices, out_layout)
    ext_grads = []
    for n, (gr, outs, ins, want) in enumerate(
        zip(grads, plan.outputs[rank], plan.inputs[rank], plan.wants[rank])
    ):
        if not _produces(outs):
            ext_grads.append(torch.zeros(want.sizes, dtype=x.dtype, device=x.device))
            continue
        shape = list(want.sizes)
        for dim, (lo, hi) in zip(plan.dims, ins):
            shape[dim] = hi - lo
        ext = torch.empty(shape, dtype=x.dtype, device=x.device)  # its shape is all it reads
        if is_max:
            local = _local_indices(idxs[n], plan, tuple(x.shape[2:]), tuple(shape[2:]), ins)
            gi = func(gr, ext, list(g.kernel), list(g.stride), padding, list(g.dilation),
                      a["ceil_mode"], local)  # fmt: skip
        else:
            if gr.dtype in _HALF:
                gr, ext = gr.float(), ext.float()
            divisor = a["divisor_override"]
            if divisor is None:  # each output's gradient divided by torch's count first
                whole = tuple(x.shape[2:])
                gr = gr / _divisors(g, plan, outs, a["count_include_pad"], gr, whole)
            gi = func(gr, ext, list(g.kernel), list(g.stride), padding, a["ceil_mode"],
                      a["count_include_pad"], 1 if divisor is None else divisor)  # fmt: skip
            gi = gi.to(x.dtype)
        ext_grads.append(_trimmed(gi, plan, ins, want))
    shards = add_regions(x, plan.wants, ext_grads)
    return x._with_layout(x._layout, shards, dtype=x.dtype, device=x.device)


# -- upsampling by a whole factor along the split dim -----------------------------------
#
# `interpolate(scale_factor=s)` for a whole `s` maps input row `r` to output rows
# `[r·s, (r+1)·s)`, so a block of rows `[a, a+n)` gives output rows `[a·s, (a+n)·s)`:
# each block upsamples its own rows, nearest with no halo, linear modes
# (`align_corners=False`) with one row from each neighbour, and keeps the middle of its
# result. The backward, whose arguments name no input, finds the input's blocks by
# dividing the gradient's by `s`; a linear one sends the halo rows' gradients back.
# Another factor, `align_corners=True` or replicas: the per-block rule's (the fallback).


class UpsamplePlan(NamedTuple):
    """Per rank, per block: the input rows its outputs read, `[lo, hi)` along `dim`."""

    dim: int
    factor: int
    rows: tuple[tuple[tuple[int, int, int, int], ...], ...]  # per block: a, n, lo, hi
    wants: tuple[tuple[Block, ...], ...]


@functools.lru_cache(maxsize=512)
def upsample_plan(layout: Layout, dim: int, factor: int, halo: int) -> UpsamplePlan | None:
    shape = layout.global_shape
    if not _split_only_along(layout, (dim,)):
        return None
    rows, wants = [], []
    for blocks in layout.blocks:
        rank_rows, rank_wants = [], []
        for b in blocks:
            a, n = (b.offsets[dim], b.sizes[dim]) if not b.is_empty() else (0, 0)
            lo, hi = (max(a - halo, 0), min(a + n + halo, shape[dim])) if n else (0, 0)
            offsets = tuple(lo if e == dim else 0 for e in range(len(shape)))
            sizes = tuple(hi - lo if e == dim else shape[e] for e in range(len(shape)))
            rank_rows.append((a, n, lo, hi))
            rank_wants.append(Block(offsets, sizes))
        rows.append(tuple(rank_rows))
        wants.append(tuple(rank_wants))
    return UpsamplePlan(dim, factor, tuple(rows), tuple(wants))


def _upsample_call(func: Any, a: dict, first: Any, dim: int, rows: int, factor: int) -> list:
    """`func`'s arguments for a block of `rows` extended rows: sizes along `dim` local,
    its scale the whole factor (so the local map is the global one, shifted)."""
    i = dim - 2
    scales = [arg.name for arg in func._schema.arguments if arg.name.startswith("scales")]
    call = []
    for arg in func._schema.arguments:
        v = a[arg.name]
        if arg.name in ("self", "grad_output"):
            v = first
        elif arg.name == "output_size":
            v = list(v)
            v[i] = rows * factor
        elif arg.name == "input_size":
            v = list(v)
            v[dim] = rows
        elif arg.name == scales[i]:
            v = float(factor)
        call.append(v)
    return call


def upsample_factor(a: dict, func: Any, in_rows: int, out_rows: int, dim: int) -> int | None:
    """The whole factor along `dim`, or None where the op's map is not `r -> r·s`."""
    if in_rows <= 0 or out_rows % in_rows or a.get("align_corners"):
        return None
    factor = out_rows // in_rows
    if "nearest" in func._schema.name and factor & (factor - 1):
        # torch maps output j to input floor(j · fl(1/s)); for an s whose reciprocal is
        # inexact that can round one below j / s (s = 41: output 41 reads input 0), which
        # a block's own map, counted from its start, would not reproduce
        return None
    scales = [arg.name for arg in func._schema.arguments if arg.name.startswith("scales")]
    given = a[scales[dim - 2]]
    return factor if given is None or float(given) == float(factor) else None


def _needs_halo(plan: UpsamplePlan) -> bool:
    """Whether any rank's block reads rows beyond its own (decided alike on every rank)."""
    return any(lo < a or hi > a + n for rank in plan.rows for a, n, lo, hi in rank)


def upsample_forward(func: Any, x: ShardedTensor, a: dict, plan: UpsamplePlan, meta: Any) -> Any:
    dim, s = plan.dim, plan.factor
    halo = _needs_halo(plan)
    exts = regions(x, plan.wants) if halo else [shard.contiguous() for shard in x._shards]
    shards = []
    for ext, (start, n, lo, hi) in zip(exts, plan.rows[x._rank]):
        if n == 0:
            shape = list(meta.shape)
            shape[dim] = 0
            shards.append(torch.empty(shape, dtype=meta.dtype, device=x.device))
            continue
        out = func(*_upsample_call(func, a, ext, dim, hi - lo, s))
        shards.append(out.narrow(dim, (start - lo) * s, n * s))
    layout = _scaled_layout(x._layout, dim, s, 1, tuple(meta.shape))
    return x._with_layout(layout, shards, dtype=meta.dtype, device=x.device)


@functools.lru_cache(maxsize=512)
def _scaled_layout(
    layout: Layout, dim: int, times: int, over: int, shape: tuple[int, ...]
) -> Layout:
    """`layout`'s blocks with their rows along `dim` scaled by `times / over`, whole along
    the other dims of `shape`."""

    def how(b: Block) -> Block:
        a, n = b.offsets[dim] * times // over, b.sizes[dim] * times // over
        offsets = tuple(a if e == dim else 0 for e in range(len(shape)))
        sizes = tuple(n if e == dim else shape[e] for e in range(len(shape)))
        return Block(offsets, sizes)

    scaled = blocks_mapped(layout, shape, how)
    assert scaled is not None  # `how` maps every block
    return scaled


def upsample_input_layout(grad: ShardedTensor, dim: int, factor: int, shape: tuple) -> Any:
    """The input's layout, from the gradient's: its rows divided by `factor`; None where
    a block's rows are no whole multiple of it."""
    for b in (b for blocks in grad._layout.blocks for b in blocks if not b.is_empty()):
        if b.offsets[dim] % factor or b.sizes[dim] % factor:
            return None
    return _scaled_layout(grad._layout, dim, 1, factor, tuple(shape))


def upsample_backward(
    func: Any, grad: ShardedTensor, a: dict, in_layout: Layout, plan: UpsamplePlan
) -> ShardedTensor:
    dim, s, rank = plan.dim, plan.factor, grad._rank
    halo = _needs_halo(plan)
    ext_grads = []
    for g, (start, n, lo, hi), want in zip(grad._shards, plan.rows[rank], plan.wants[rank]):
        if n == 0:
            ext_grads.append(torch.zeros(want.sizes, dtype=grad.dtype, device=grad.device))
            continue
        if halo:  # the block's output rows in place, the neighbours' rows zero
            shape = list(g.shape)
            shape[dim] = (hi - lo) * s
            local = g.new_zeros(shape)
            local.narrow(dim, (start - lo) * s, n * s).copy_(g)
        else:
            local = g.contiguous()
        ext_grads.append(func(*_upsample_call(func, a, local, dim, hi - lo, s)))
    if not halo:
        return grad._with_layout(in_layout, ext_grads, dtype=grad.dtype, device=grad.device)
    blocks = in_layout.blocks_of(rank)
    like = grad._with_layout(
        in_layout, [torch.empty(b.sizes, dtype=grad.dtype, device=grad.device) for b in blocks]
    )  # where `add_regions` sends each row's gradient
    shards = add_regions(like, plan.wants, ext_grads)
    return like._with_layout(in_layout, shards, dtype=grad.dtype, device=grad.device)
