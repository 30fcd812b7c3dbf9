"""Shape ops as layout transforms: the blocks move, the data does not.

`t`/`transpose`/`permute` permute every block's dimensions; `unsqueeze`,
`squeeze` and `expand` add, drop or broadcast dimensions of extent 1;
`view`/`reshape` map each block to a block of the new shape when its
elements stay a box (always for dimensions a block spans whole, or for a
split or merge that keeps each block's rows whole); slicing (`slice` with any
step, `select`, `narrow`, `split`) intersects the blocks with the slice and
views each shard; `cat`/`stack` lay the operands' blocks side by side, a rank's
blocks that make a box merged into one (a copy, as torch's); `roll`, `pad` and
`repeat` move, cut, extend or tile blocks. None of them communicates; a `view`
whose blocks are no box in the new shape goes to the fallback. Empty blocks stay
empty.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..errors import LayoutError
from ..layout import Block, Layout
from ..tensor import ShardedTensor
from .exchange import is_replicated, replicated
from .fallback import fallback
from .per_shard import blocks_mapped, empty_block, named, registrar, sharded_args
from .reductions import in_range, spans

__all__ = ["SHAPE_HANDLERS"]

aten = torch.ops.aten

SHAPE_HANDLERS: dict[Any, Callable[[Any, tuple, dict], Any]] = {}


_handles = registrar(SHAPE_HANDLERS)


_MAPPED: dict[tuple[Any, ...], Layout | None] = {}


def _mapped(
    layout: Layout,
    shape: tuple[int, ...],
    how: Callable[[Block], Block | None],
    key: tuple[Any, ...],
) -> Layout | None:
    """`layout` with every block mapped by `how` (empty blocks stay empty); None when a
    block has no image. Cached by `key` (what `how` depends on besides the block)."""
    full_key = (layout, shape, *key)
    if full_key in _MAPPED:
        return _MAPPED[full_key]
    if len(_MAPPED) > 4096:
        _MAPPED.clear()
    _MAPPED[full_key] = result = blocks_mapped(layout, shape, how)
    return result


def _result(
    st: ShardedTensor,
    layout: Layout,
    view: Callable[[torch.Tensor, Block, Block], torch.Tensor],
) -> ShardedTensor:
    old, new = st._layout.blocks_of(st._rank), layout.blocks_of(st._rank)
    shards = []
    for shard, b, nb in zip(st._shards, old, new):
        if b.is_empty() or nb.is_empty():
            shards.append(shard.new_empty(nb.sizes))
        else:
            shards.append(view(shard, b, nb))
    return st._with_layout(layout, shards, dtype=st.dtype, device=st.device)


# -- permutations ----------------------------------------------------------------


def _permuted(order: tuple[int, ...]) -> Callable[[Block], Block]:
    return lambda b: Block(tuple(b.offsets[d] for d in order), tuple(b.sizes[d] for d in order))


def _permute(st: ShardedTensor, order: Sequence[int]) -> ShardedTensor:
    n = st.ndim
    order = tuple(d % n for d in order) if n else ()
    shape = tuple(st.shape[d] for d in order)
    layout = _mapped(st._layout, shape, _permuted(order), ("permute", order))
    assert layout is not None
    return _result(st, layout, lambda s, b, nb: s.permute(order))


@_handles(aten.permute.default)
def _permute_op(func: Any, args: tuple, kwargs: dict) -> Any:
    a = named(func, args, kwargs)
    return _permute(a["self"], a["dims"])


@_handles(aten.transpose.int)
def _transpose(func: Any, args: tuple, kwargs: dict) -> Any:
    a = named(func, args, kwargs)
    st = a["self"]
    order = list(range(st.ndim))
    if st.ndim:
        d0, d1 = a["dim0"] % st.ndim, a["dim1"] % st.ndim
        order[d0], order[d1] = order[d1], order[d0]
    return _permute(st, order)


@_handles(aten.t.default)
def _t(func: Any, args: tuple, kwargs: dict) -> Any:
    st = args[0]
    return _permute(st, list(reversed(range(st.ndim))))


@_handles(aten.flip.default)
def _flip(func: Any, args: tuple, kwargs: dict) -> Any:
    """`flip`: each block mirrored to the far side of the flipped dims, its shard
    flipped (a copy, as torch's). No communication."""
    a = named(func, args, kwargs)
    st = a["self"]
    if not in_range(a["dims"], st.ndim):
        return fallback(func, args, kwargs)  # torch's error, on every rank
    dims = tuple(sorted({d % st.ndim for d in a["dims"]})) if st.ndim else ()
    return _result(st, _flipped(st._layout, dims), lambda s, b, nb: s.flip(dims))


@functools.lru_cache(maxsize=1024)
def _flipped(layout: Layout, dims: tuple[int, ...]) -> Layout:
    """`layout` mirrored across `dims` (cached: a layout's validation costs more than the
    flip of a small shard, and a `cumsum`'s backward flips twice per step)."""
    shape = layout.global_shape

    def how(b: Block) -> Block:
        offsets = tuple(
            shape[d] - o - n if d in dims else o for d, (o, n) in enumerate(zip(b.offsets, b.sizes))
        )
        return Block(offsets, b.sizes)

    # every block mirrored, an empty one too: its box keeps spanning what it spanned
    return Layout(
        shape,
        {r: [how(b) for b in blocks] for r, blocks in enumerate(layout.blocks)},
        layout.world_size,
        allow_holes=layout.allow_holes,
    )


# -- roll, pad, repeat: blocks moved, cut at the wrap, extended at the edges, tiled -------
#
# Along a dim a block spans, the op runs on its shard; along any other, the block moves
# (a rank may end with several blocks: a rolled block cut where it wraps, a repeated one
# copied once per tile). Every rank computes the new layout from the old one; nothing is
# sent. Each result shard is new memory (a copy of the rank's elements), as torch's is.

# Blocks one block may become (a roll's cut, a repeat's tiles); past this, the fallback.
# A view splitting blocks keeps to the same bound.
_MAX_PIECES = 256

# (layout, shape, op, its arguments) -> (the new layout, each rank's blocks' pieces)
_PIECES: dict[tuple[Any, ...], tuple[Layout, list[list[list[tuple[Block, Any]]]]]] = {}


def _moved(
    st: ShardedTensor,
    shape: tuple[int, ...],
    key: tuple[Any, ...],
    pieces: Callable[[Block], list[tuple[Block, Any]] | None],
    data: Callable[[torch.Tensor, Block, list[tuple[Block, Any]]], list[torch.Tensor]],
) -> ShardedTensor | None:
    """`st` with each block replaced by `pieces(block)` (new boxes, each with what `data`
    needs to cut its shard); None where a block would have too many pieces (`pieces`
    says None, or more than `_MAX_PIECES`). Every rank maps every rank's blocks, once per
    layout and arguments (cached)."""
    full_key = (st._layout, st._layout.allow_holes, shape, *key)
    found = _PIECES.get(full_key)
    if found is None:
        if len(_PIECES) > 4096:
            _PIECES.clear()
        found_pieces = [[pieces(b) for b in blocks] for blocks in st._layout.blocks]
        per_rank = [[p for p in rank if p is not None] for rank in found_pieces]
        if any(len(p) != len(q) for p, q in zip(per_rank, found_pieces)) or any(
            len(p) > _MAX_PIECES for rank in per_rank for p in rank
        ):
            return None
        blocks = [[b for p in rank for b, _ in p] for rank in per_rank]
        layout = Layout(shape, blocks, st._layout.world_size, allow_holes=st._layout.allow_holes)
        found = _PIECES[full_key] = (layout, per_rank)
    layout, per_rank = found
    shards: list[torch.Tensor] = []
    for shard, b, p in zip(st._shards, st._layout.blocks_of(st._rank), per_rank[st._rank]):
        shards.extend(data(shard, b, p))
    return st._with_layout(layout, shards, dtype=st.dtype, device=st.device)


def _replaced(seq: Sequence[int], d: int, value: int) -> tuple[int, ...]:
    out = list(seq)
    out[d] = value
    return tuple(out)


@_handles(aten.roll.default)
def _roll(func: Any, args: tuple, kwargs: dict) -> Any:
    """`roll` along given dims: along a dim a block spans, its shard rolls; along any
    other, the block moves by the shift, cut in two where it wraps. No communication."""
    a = named(func, args, kwargs)
    st, dims, shifts = a["self"], list(a["dims"]), list(a["shifts"])
    ndim = st.ndim
    if not dims or len(dims) != len(shifts) or not ndim or any(not -ndim <= d < ndim for d in dims):
        return fallback(func, args, kwargs)  # a flattened roll; torch's errors (a dim may repeat)
    shape = tuple(st.shape)
    moves = tuple((d % ndim, s % shape[d]) for d, s in zip(dims, shifts) if shape[d])
    if len(moves) != len(dims):
        return fallback(func, args, kwargs)  # an empty dim

    def pieces(b: Block) -> list[tuple[Block, Any]]:
        # each piece: its box, and the (dim, start, length) cuts of the shard it takes
        out: list[tuple[Block, Any]] = [(b, ())]
        for d, s in moves:
            n = shape[d]
            step: list[tuple[Block, Any]] = []
            for box, cuts in out:
                o, size = box.offsets[d], box.sizes[d]
                if size == n or s == 0:  # spans d: the shard rolls
                    step.append((box, cuts))
                    continue
                start = (o + s) % n
                if start + size <= n or box.is_empty():
                    size = size if start + size <= n else n - start
                    step.append(
                        (
                            Block(_replaced(box.offsets, d, start), _replaced(box.sizes, d, size)),
                            cuts,
                        )
                    )
                    continue
                head = n - start  # up to the end; the rest wraps to the start
                step.append(
                    (
                        Block(_replaced(box.offsets, d, start), _replaced(box.sizes, d, head)),
                        (*cuts, (d, 0, head)),
                    )
                )
                step.append(
                    (
                        Block(_replaced(box.offsets, d, 0), _replaced(box.sizes, d, size - head)),
                        (*cuts, (d, head, size - head)),
                    )
                )
            out = step
        return out

    def data(shard: torch.Tensor, b: Block, p: list[tuple[Block, Any]]) -> list[torch.Tensor]:
        spanned = [(s, d) for d, s in moves if b.sizes[d] == shape[d] and s]
        if spanned:
            shard = func(shard, [s for s, _ in spanned], [d for _, d in spanned])
        out = []
        for box, cuts in p:
            if box.is_empty():
                out.append(shard.new_empty(box.sizes))
                continue
            piece = shard
            for d, start, length in cuts:
                piece = piece.narrow(d, start, length)
            out.append(piece if spanned else piece.clone())  # a rolled shard is a copy
        return out

    moved = _moved(st, shape, ("roll", moves), pieces, data)
    return moved if moved is not None else fallback(func, args, kwargs)


@_handles(aten.constant_pad_nd.default)
def _pad(func: Any, args: tuple, kwargs: dict) -> Any:
    """`F.pad` (constant) in any layout: every block moves by the left pad; a block at an
    edge of a padded dim takes that edge's new elements, and a negative pad crops the
    blocks it reaches (the backward). One `constant_pad_nd` per block, no communication."""
    a = named(func, args, kwargs)
    st, pad = a["self"], list(a["pad"])
    if len(pad) % 2 or len(pad) // 2 > st.ndim:
        return fallback(func, args, kwargs)  # torch's error
    shape = list(st.shape)
    edges: list[tuple[int, int, int]] = []  # (dim, left, right)
    for i in range(len(pad) // 2):
        d = st.ndim - 1 - i
        if pad[2 * i] or pad[2 * i + 1]:
            edges.append((d, pad[2 * i], pad[2 * i + 1]))
            shape[d] += pad[2 * i] + pad[2 * i + 1]
    new_shape = tuple(shape)
    if any(st.shape[d] == 0 or new_shape[d] <= 0 for d, _l, _r in edges):
        return fallback(func, args, kwargs)  # torch's errors and empty dims
    # a fill value the dtype cannot hold raises torch's error on every rank, a rank whose
    # blocks are all empty included
    func(torch.empty(0, dtype=st.dtype), [1, 0], a["value"])

    def pieces(b: Block) -> list[tuple[Block, Any]]:
        offsets, sizes = list(b.offsets), list(b.sizes)
        local = [0] * (2 * st.ndim)  # this shard's pad, in constant_pad_nd's order
        for d, left, right in edges:
            n, o, size = st.shape[d], b.offsets[d], b.sizes[d]
            lo, hi = max(o, -left, 0), min(o + size, n + min(right, 0))
            # a block at an edge takes that edge's new elements, even when the other
            # side's crop keeps none of its own (`F.pad(x, (-n, 1))`)
            grow_lo = left if left > 0 and o == 0 and size else 0
            grow_hi = right if right > 0 and o + size == n and size else 0
            if size == 0 or (lo >= hi and not grow_lo and not grow_hi):  # nothing along d
                offsets[d] = min(max(o + left, 0), new_shape[d])
                sizes[d] = 0
                continue
            kept = max(hi - lo, 0)
            start = lo + left - grow_lo if kept else (0 if grow_lo else new_shape[d] - grow_hi)
            offsets[d], sizes[d] = start, kept + grow_lo + grow_hi
            at = 2 * (st.ndim - 1 - d)
            if kept:
                local[at], local[at + 1] = grow_lo - (lo - o), grow_hi - (o + size - hi)
            else:  # all of the shard cropped from the side that does not grow
                local[at], local[at + 1] = (grow_lo, -size) if grow_lo else (-size, grow_hi)
        return [(Block(tuple(offsets), tuple(sizes)), tuple(local))]

    def data(shard: torch.Tensor, b: Block, p: list[tuple[Block, Any]]) -> list[torch.Tensor]:
        box, local = p[0]
        if box.is_empty() or b.is_empty():
            return [shard.new_empty(box.sizes)]
        return [func(shard, list(local), a["value"])]  # new memory, even with no pad

    moved = _moved(st, new_shape, ("pad", tuple(edges)), pieces, data)
    assert moved is not None  # one piece per block
    return moved


@_handles(aten.repeat.default)
def _repeat(func: Any, args: tuple, kwargs: dict) -> Any:
    """`repeat`: along a dim a block spans, its shard repeats; along any other, the block
    is copied once per tile (at `tile * size + offset`), on the same rank. No
    communication; each copy is new memory."""
    a = named(func, args, kwargs)
    st, times = a["self"], list(a["repeats"])
    if len(times) < st.ndim or any(t <= 0 for t in times):
        return fallback(func, args, kwargs)  # torch's error; a zero repeat
    lead = len(times) - st.ndim
    old = (1,) * lead + tuple(st.shape)
    shape = tuple(n * t for n, t in zip(old, times))

    def pieces(b: Block) -> list[tuple[Block, Any]] | None:
        offsets, sizes = (0,) * lead + b.offsets, (1,) * lead + b.sizes
        tiles: list[list[tuple[int, int]]] = []  # per dim: (offset, size) of each copy
        for o, size, n, t in zip(offsets, sizes, old, times):
            if size == n or t == 1:
                tiles.append([(o, size * t if size == n else size)])
            elif b.is_empty():
                tiles.append([(o, size)])
            else:
                tiles.append([(k * n + o, size) for k in range(t)])
        if math.prod(len(x) for x in tiles) > _MAX_PIECES:
            return None  # too many: the fallback's
        return [
            (Block(tuple(o for o, _ in combo), tuple(n for _, n in combo)), None)
            for combo in itertools.product(*tiles)
        ]

    def data(shard: torch.Tensor, b: Block, p: list[tuple[Block, Any]]) -> list[torch.Tensor]:
        sizes = (1,) * lead + b.sizes
        local = [t if size == n else 1 for size, n, t in zip(sizes, old, times)]
        first = func(shard, local)  # new memory, spanned dims repeated
        return [first] + [first.clone() for _ in p[1:]]

    moved = _moved(st, shape, ("repeat", tuple(times)), pieces, data)
    return moved if moved is not None else fallback(func, args, kwargs)


@_handles(aten.tril.default, aten.triu.default, aten.tril_.default, aten.triu_.default)
def _triangle(func: Any, args: tuple, kwargs: dict) -> Any:
    """`tril`/`triu` of the last two dims, in any layout: each block keeps its part of
    the triangle, its diagonal shifted by where the block starts (element (i, j) of a
    block at rows r0, columns c0 is (i + r0, j + c0) of the whole). No communication."""
    a = named(func, args, kwargs)
    st, k = a["self"], a["diagonal"]
    if not isinstance(st, ShardedTensor) or st.ndim < 2:
        return fallback(func, args, kwargs)  # torch's error for fewer than 2 dims
    shards = []
    for shard, b in zip(st._shards, st._layout.blocks_of(st._rank)):
        shift = 0 if b.is_empty() else b.offsets[-2] - b.offsets[-1]
        shards.append(func(shard, k + shift))
    if func._schema.name.endswith("_"):
        return st
    return st._with_layout(st._layout, shards, dtype=st.dtype, device=st.device)


# -- extent-1 dimensions -----------------------------------------------------------


@_handles(aten.unsqueeze.default)
def _unsqueeze(func: Any, args: tuple, kwargs: dict) -> Any:
    a = named(func, args, kwargs)
    st, dim = a["self"], a["dim"] % (a["self"].ndim + 1)
    shape = (*st.shape[:dim], 1, *st.shape[dim:])

    def how(b: Block) -> Block:
        return Block((*b.offsets[:dim], 0, *b.offsets[dim:]), (*b.sizes[:dim], 1, *b.sizes[dim:]))

    layout = _mapped(st._layout, tuple(shape), how, ("unsqueeze", dim))
    assert layout is not None
    return _result(st, layout, lambda s, b, nb: s.unsqueeze(dim))


@_handles(aten.squeeze.default, aten.squeeze.dim, aten.squeeze.dims)
def _squeeze(func: Any, args: tuple, kwargs: dict) -> Any:
    a = named(func, args, kwargs)
    st = a["self"]
    if "dim" in a:
        wanted = [a["dim"]] if isinstance(a["dim"], int) else list(a["dim"])
    else:
        wanted = list(range(st.ndim))
    dims = {d % st.ndim for d in wanted if st.ndim and st.shape[d % st.ndim] == 1}
    keep = [d for d in range(st.ndim) if d not in dims]
    shape = tuple(st.shape[d] for d in keep)
    layout = _mapped(
        st._layout,
        shape,
        lambda b: Block(tuple(b.offsets[d] for d in keep), tuple(b.sizes[d] for d in keep)),
        ("squeeze", tuple(keep)),
    )
    assert layout is not None
    return _result(st, layout, lambda s, b, nb: s.reshape(nb.sizes))


@_handles(aten.expand.default)
def _expand(func: Any, args: tuple, kwargs: dict) -> Any:
    a = named(func, args, kwargs)
    st, size = a["self"], list(a["size"])
    lead = len(size) - st.ndim
    shape = tuple(
        (st.shape[d - lead] if s == -1 else s) if d >= lead else s for d, s in enumerate(size)
    )
    if is_replicated(st._layout):
        whole = replicated(shape, st._layout.world_size)
        return st._with_layout(whole, [st._shards[0].expand(shape)])

    def how(b: Block) -> Block:
        offsets, sizes = [0] * lead, list(shape[:lead])
        for d in range(st.ndim):
            grows = st.shape[d] == 1 and shape[lead + d] != 1
            offsets.append(0 if grows else b.offsets[d])
            sizes.append(shape[lead + d] if grows else b.sizes[d])
        return Block(tuple(offsets), tuple(sizes))

    layout = _mapped(st._layout, shape, how, ("expand",))
    assert layout is not None
    return _result(st, layout, lambda s, b, nb: s.expand(nb.sizes))


# -- view / reshape ------------------------------------------------------------------


def _groups(old: Sequence[int], new: Sequence[int]) -> list[tuple[list[int], list[int]]] | None:
    """Matching groups of old and new dimensions (of extent > 1) with equal products."""
    o = [d for d, n in enumerate(old) if n != 1]
    w = [d for d, n in enumerate(new) if n != 1]
    groups, i, j = [], 0, 0
    while i < len(o) and j < len(w):
        go, gw = [o[i]], [w[j]]
        po, pw = old[o[i]], new[w[j]]
        while po != pw:
            if po < pw:
                i += 1
                if i >= len(o):
                    return None
                go.append(o[i])
                po *= old[o[i]]
            else:
                j += 1
                if j >= len(w):
                    return None
                gw.append(w[j])
                pw *= new[w[j]]
        groups.append((go, gw))
        i, j = i + 1, j + 1
    return groups if i == len(o) and j == len(w) else None


def _range_in(block: Block, dims: list[int], shape: Sequence[int]) -> tuple[int, int] | None:
    """The block along `dims` as a flat range [start, stop) of their row-major order, if it
    is one: single indices before some dimension k, any extent along k, whole after it."""
    strides = [math.prod(shape[e] for e in dims[k + 1 :]) for k in range(len(dims))]
    for k in range(len(dims)):
        if all(block.sizes[dims[q]] == 1 for q in range(k)) and all(
            block.sizes[dims[q]] == shape[dims[q]] for q in range(k + 1, len(dims))
        ):
            start = sum(block.offsets[dims[q]] * strides[q] for q in range(k + 1))
            return start, start + block.sizes[dims[k]] * strides[k]
    return None


def _box_in(start: int, stop: int, dims: list[int], shape: Sequence[int]) -> dict | None:
    """The flat range [start, stop) as a box of `dims` (offset, size per dim), if it is one."""
    strides = [math.prod(shape[e] for e in dims[k + 1 :]) for k in range(len(dims))]
    length = stop - start
    for k, d in enumerate(dims):
        s = strides[k]
        if s <= length:
            if length % s or start % s:
                return None
            first, count = (start // s) % shape[d], length // s
            if first + count > shape[d]:
                return None
            box = {}
            for q in range(k):
                box[dims[q]] = ((start // strides[q]) % shape[dims[q]], 1)
            box[d] = (first, count)
            for q in range(k + 1, len(dims)):
                box[dims[q]] = (0, shape[dims[q]])
            return box
    return None


# A view may split a block into up to `_MAX_PIECES` pieces (a sequence-split [B, S, D]
# viewed as [B*S, D] gives B pieces per block); past that the view gathers instead.

# One piece of an old block: its index along the dimensions split to unit extent
# (relative to the block; -1 where the dimension is kept whole), and its new block.
Piece = tuple[tuple[int, ...], Block]


def _pieces(
    b: Block, groups: list[tuple[list[int], list[int]]], old: Sequence[int], shape: Sequence[int]
) -> list[Piece] | None:
    """`b` as boxes of the new shape: whole when its elements stay a box, else split to unit
    extent along the leading dimensions of a group (each piece then a box); None if not."""
    split: list[int] = []
    for go, _ in groups:
        partial = [k for k, d in enumerate(go) if b.sizes[d] != old[d]]
        if partial:
            k = partial[0]
            if any(b.sizes[go[q]] != old[go[q]] for q in range(k + 1, len(go))):
                return None
            split += [go[q] for q in range(k) if b.sizes[go[q]] != 1]
    if math.prod(b.sizes[d] for d in split) > _MAX_PIECES:
        return None
    pieces: list[Piece] = []
    for combo in itertools.product(*(range(b.sizes[d]) for d in split)):
        offsets, sizes = list(b.offsets), list(b.sizes)
        index = [-1] * len(old)
        for d, k in zip(split, combo):
            offsets[d], sizes[d], index[d] = b.offsets[d] + k, 1, k
        unit = Block(tuple(offsets), tuple(sizes))
        new_offsets, new_sizes = [0] * len(shape), [1] * len(shape)
        for go, gw in groups:
            flat = _range_in(unit, go, old)
            box = None if flat is None else _box_in(*flat, gw, shape)
            if box is None:
                return None
            for d, (off, size) in box.items():
                new_offsets[d], new_sizes[d] = off, size
        pieces.append((tuple(index), Block(tuple(new_offsets), tuple(new_sizes))))
    return pieces


@functools.lru_cache(maxsize=4096)
def _view_plan(
    layout: Layout, shape: tuple[int, ...]
) -> tuple[Layout, tuple[tuple[tuple[Piece, ...], ...], ...]] | None:
    """The layout of `layout` viewed as `shape`, and per rank, per old block, its pieces."""
    old = layout.global_shape
    groups = _groups(old, shape)
    if groups is None:
        return None
    plan, blocks = [], {}
    for rank, rank_blocks in enumerate(layout.blocks):
        per_block, new_blocks = [], []
        for b in rank_blocks:
            if b.is_empty():
                pieces: list[Piece] | None = [((-1,) * len(old), empty_block(len(shape)))]
            else:
                pieces = _pieces(b, groups, old, shape)
            if pieces is None:
                return None
            per_block.append(tuple(pieces))
            new_blocks += [nb for _, nb in pieces]
        plan.append(tuple(per_block))
        blocks[rank] = new_blocks
    return Layout(shape, blocks, layout.world_size), tuple(plan)


@_handles(
    aten.view.default, aten._unsafe_view.default, aten._reshape_alias.default, aten.reshape.default
)
def _view(func: Any, args: tuple, kwargs: dict) -> Any:
    st, size = args[0], list(args[1])
    if size.count(-1) == 1:
        known = math.prod(s for s in size if s != -1)
        size[size.index(-1)] = st.numel() // known if known else 0
    torch.empty(st.shape, device="meta").view(list(args[1]))  # torch's own error if invalid
    shape = tuple(size)
    if shape == tuple(st.shape):
        return st._with_shards([s.view(s.shape) for s in st._shards])
    if is_replicated(st._layout):
        whole = replicated(shape, st._layout.world_size)
        return st._with_layout(whole, [st._shards[0].reshape(shape)])
    planned = _view_plan(st._layout, shape) if st.numel() else None
    if planned is None:
        return fallback(aten.reshape.default, (st, list(shape)), {})
    layout, plan = planned
    shards = []
    for shard, pieces in zip(st._shards, plan[st._rank]):
        for index, nb in pieces:
            if nb.is_empty():
                shards.append(shard.new_empty(nb.sizes))
                continue
            part = shard[tuple(slice(None) if k < 0 else k for k in index)]
            shards.append(part.reshape(nb.sizes))
    return st._with_layout(layout, shards, dtype=st.dtype, device=st.device)


# -- slicing -------------------------------------------------------------------------


def _slice(st: ShardedTensor, dim: int, start: int, stop: int, step: int) -> ShardedTensor:
    n = st.shape[dim]
    count = max(0, -(-(stop - start) // step))
    shape = tuple(count if d == dim else s for d, s in enumerate(st.shape))

    def how(b: Block) -> Block:
        lo, hi = b.offsets[dim], b.offsets[dim] + b.sizes[dim]
        first = max(0, -(-(lo - start) // step))  # first k with start + k*step >= lo
        last = min(count, -(-(hi - start) // step))  # first k with start + k*step >= hi
        offsets, sizes = list(b.offsets), list(b.sizes)
        if last <= first:
            return empty_block(len(shape))
        offsets[dim], sizes[dim] = first, last - first
        return Block(tuple(offsets), tuple(sizes))

    del n
    layout = _mapped(st._layout, shape, how, ("slice", dim, start, step))
    assert layout is not None

    def view(s: torch.Tensor, b: Block, nb: Block) -> torch.Tensor:
        begin = start + nb.offsets[dim] * step - b.offsets[dim]
        index = [slice(None)] * st.ndim
        index[dim] = slice(begin, begin + (nb.sizes[dim] - 1) * step + 1, step)
        return s[tuple(index)]

    return _result(st, layout, view)


def _bounds(n: int, start: Any, end: Any) -> tuple[int, int]:
    start = 0 if start is None else start
    end = n if end is None else end
    start = start + n if start < 0 else start
    end = end + n if end < 0 else end
    return min(max(start, 0), n), min(max(end, 0), n)


@_handles(aten.slice.Tensor)
def _slice_op(func: Any, args: tuple, kwargs: dict) -> Any:
    a = named(func, args, kwargs)
    st = a["self"]
    dim = a["dim"] % st.ndim
    start, stop = _bounds(st.shape[dim], a["start"], a["end"])
    return _slice(st, dim, start, max(start, stop), a["step"])


@_handles(aten.select.int)
def _select(func: Any, args: tuple, kwargs: dict) -> Any:
    a = named(func, args, kwargs)
    st = a["self"]
    dim = a["dim"] % st.ndim
    torch.empty(st.shape, device="meta").select(
        dim, a["index"]
    )  # torch's own error if out of range
    index = a["index"] + st.shape[dim] if a["index"] < 0 else a["index"]
    one = _slice(st, dim, index, index + 1, 1)
    return _squeeze(aten.squeeze.dim, (one, dim), {})


@_handles(aten.split.Tensor, aten.split_with_sizes.default)
def _split(func: Any, args: tuple, kwargs: dict) -> Any:
    a = named(func, args, kwargs)
    st = a["self"]
    dim = a["dim"] % st.ndim
    n = st.shape[dim]
    if "split_sizes" in a:
        sizes = list(a["split_sizes"])
    else:
        step = a["split_size"]
        sizes = [min(step, n - i) for i in range(0, n, step)] if step else [n]
    out, start = [], 0
    for size in sizes:
        out.append(_slice(st, dim, start, start + size, 1))
        start += size
    return out


@_handles(aten.unbind.int)
def _unbind(func: Any, args: tuple, kwargs: dict) -> Any:
    a = named(func, args, kwargs)
    st = a["self"]
    dim = a["dim"] % st.ndim
    return [_select(aten.select.int, (st, dim, i), {}) for i in range(st.shape[dim])]


# -- cat / stack -------------------------------------------------------------------


@functools.lru_cache(maxsize=1024)
def _cat_layout(layouts: tuple[Layout, ...], dim: int) -> Layout:
    world = layouts[0].world_size
    shape = list(layouts[0].global_shape)
    shape[dim] = sum(layout.global_shape[dim] for layout in layouts)
    blocks: dict[int, list[Block]] = {r: [] for r in range(world)}
    base = 0
    for layout in layouts:
        for r in range(world):
            for b in layout.blocks_of(r):
                if b.is_empty():
                    blocks[r].append(empty_block(len(shape)))
                    continue
                offsets = list(b.offsets)
                offsets[dim] += base
                blocks[r].append(Block(tuple(offsets), b.sizes))
        base += layout.global_shape[dim]
    return Layout(tuple(shape), blocks, world)


def _as_sharded(x: Any, like: ShardedTensor) -> ShardedTensor:
    """A plain operand as a replicated ShardedTensor on `like`'s group."""
    if isinstance(x, ShardedTensor):
        return x
    return like._with_layout(replicated(tuple(x.shape), like._layout.world_size), [x])


@_handles(aten.cat.default)
def _cat(func: Any, args: tuple, kwargs: dict) -> Any:
    a = named(func, args, kwargs)
    tensors = list(a["tensors"])
    like = sharded_args((tensors,), {})[0]
    # torch's legacy rule: 1-d empty tensors are skipped
    tensors = [t for t in tensors if not (t.ndim == 1 and t.shape[0] == 0)] or tensors[:1]
    ndim = tensors[0].ndim
    dim = a["dim"] % ndim
    parts = [_as_sharded(t, like) for t in tensors]
    if any(p._layout.world_size != like._layout.world_size for p in parts) or any(
        tuple(p.shape[:dim]) + tuple(p.shape[dim + 1 :])
        != tuple(like.shape[:dim]) + tuple(like.shape[dim + 1 :])
        for p in parts
    ):
        return fallback(func, args, kwargs)
    layout = _cat_layout(tuple(p._layout for p in parts), dim)
    dtype = functools.reduce(torch.promote_types, [p.dtype for p in parts])
    shards = [s for p in parts for s in p._shards]
    merged, recipes = _coalesced(layout)
    # new memory, as torch's `cat`: the result never aliases an operand
    out = [
        shards[r].to(dtype, copy=True) if isinstance(r, int) else _joined_shard(r, shards).to(dtype)
        for r in recipes[like._rank]
    ]
    return like._with_layout(merged, out, dtype=dtype, device=like.device)


# A merged block's shard: an old block's index, or (dim, parts) concatenated along dim.
Recipe = Any


@functools.lru_cache(maxsize=1024)
def _coalesced(layout: Layout) -> tuple[Layout, tuple[tuple[Recipe, ...], ...]]:
    """`layout` with each rank's blocks that together make a box merged into one (a `cat`
    of operands split alike: each rank's operand blocks side by side), and per rank how
    to build each new block's shard from the old ones. Only blocks held by the same
    ranks merge, each set in an order of their own (offsets), so every holder merges a
    replicated pair alike. Rules that need whole dims (a convolution, a norm) then see
    one block per rank, as after torch's `cat`."""
    merged_blocks: dict[int, list[Block]] = {}
    recipes = []
    for rank, blocks in enumerate(layout.blocks):
        groups: dict[tuple[int, ...], list[tuple[Block, Recipe]]] = {}
        for i, b in enumerate(blocks):
            key = () if b.is_empty() else layout.ranks_holding(b)
            groups.setdefault(key, []).append((b, i))
        items: list[tuple[Block, Recipe]] = []
        for key, group in groups.items():
            items.extend(group if not key else _merged(sorted(group, key=lambda e: e[0].offsets)))
        merged_blocks[rank] = [b for b, _ in items]
        recipes.append(tuple(r for _, r in items))
    merged = Layout(
        layout.global_shape, merged_blocks, layout.world_size, allow_holes=layout.allow_holes
    )
    return merged, tuple(recipes)


def _merged(items: list[tuple[Block, Recipe]]) -> list[tuple[Block, Recipe]]:
    """Pairs of boxes side by side merged, first pair first, until none is left."""
    changed = True
    while changed:
        changed = False
        for i, j in itertools.combinations(range(len(items)), 2):
            joined = _joined(items[i][0], items[j][0])
            if joined is None:
                continue
            box, dim, first = joined
            parts = [items[i][1], items[j][1]] if first else [items[j][1], items[i][1]]
            items[i] = (box, (dim, parts))
            del items[j]
            changed = True
            break
    return items


def _joined(a: Block, b: Block) -> tuple[Block, int, bool] | None:
    """The box two non-empty blocks make side by side along one dim (with that dim and
    whether `a` comes first), or None."""
    if a.is_empty() or b.is_empty():
        return None
    differ = [
        d for d in range(len(a.offsets)) if (a.offsets[d], a.sizes[d]) != (b.offsets[d], b.sizes[d])
    ]
    if len(differ) != 1:
        return None
    d = differ[0]
    if a.offsets[d] + a.sizes[d] == b.offsets[d]:
        first = True
    elif b.offsets[d] + b.sizes[d] == a.offsets[d]:
        first = False
    else:
        return None
    lo = min(a.offsets[d], b.offsets[d])
    offsets = tuple(lo if e == d else o for e, o in enumerate(a.offsets))
    sizes = tuple(a.sizes[d] + b.sizes[d] if e == d else n for e, n in enumerate(a.sizes))
    return Block(offsets, sizes), d, first


def _joined_shard(recipe: Recipe, shards: list[torch.Tensor]) -> torch.Tensor:
    """A merged block's shard: its parts concatenated (in new memory)."""
    if isinstance(recipe, int):
        return shards[recipe]
    dim, parts = recipe
    return torch.cat([_joined_shard(p, shards) for p in parts], dim)


@_handles(aten.stack.default)
def _stack(func: Any, args: tuple, kwargs: dict) -> Any:
    a = named(func, args, kwargs)
    tensors = list(a["tensors"])
    like = sharded_args((tensors,), {})[0]
    dim = a["dim"] % (tensors[0].ndim + 1)
    lifted = [_unsqueeze(aten.unsqueeze.default, (_as_sharded(t, like), dim), {}) for t in tensors]
    return _cat(aten.cat.default, (lifted, dim), {})


# -- the backward of slicing: zeros around the gradient, in its blocks -------------------


def _widened(st: ShardedTensor, sizes: tuple[int, ...], dim: int, key: tuple) -> Layout:
    """`st`'s blocks (which span `dim`) stretched along `dim` to the input's extent."""

    def how(b: Block) -> Block:
        offsets, extent = list(b.offsets), list(b.sizes)
        offsets[dim], extent[dim] = 0, sizes[dim]
        return Block(tuple(offsets), tuple(extent))

    layout = _mapped(st._layout, sizes, how, key)
    assert layout is not None
    return layout


@_handles(aten.slice_backward.default)
def _slice_backward(func: Any, args: tuple, kwargs: dict) -> Any:
    a = named(func, args, kwargs)
    grad, sizes, dim = a["grad_output"], tuple(a["input_sizes"]), a["dim"] % len(a["input_sizes"])
    if not isinstance(grad, ShardedTensor):
        return fallback(func, args, kwargs)
    start, stop = _bounds(sizes[dim], a["start"], a["end"])
    step = a["step"]
    if not spans(grad._layout, (dim,)):
        # a contiguous slice's gradient is the gradient zero-padded back to the input's
        # extent: `pad`'s rule, in any layout (the edge blocks take the zeros)
        if step == 1 and grad.shape[dim] == stop - start:
            pad = [0, 0] * (len(sizes) - 1 - dim) + [start, sizes[dim] - stop]
            return _pad(aten.constant_pad_nd.default, (grad, pad, 0), {})
        strided = _strided_slice_backward(grad, sizes, dim, start, step)
        return strided if strided is not None else fallback(func, args, kwargs)
    layout = _widened(grad, sizes, dim, ("slice_backward", dim))
    shards = []
    for shard, nb in zip(grad._shards, layout.blocks_of(grad._rank)):
        out = shard.new_zeros(nb.sizes)
        if not nb.is_empty():
            index = [slice(None)] * len(sizes)
            index[dim] = slice(start, max(start, stop), step)
            out[tuple(index)] = shard
        shards.append(out)
    return grad._with_layout(layout, shards, dtype=grad.dtype, device=grad.device)


def _strided_slice_backward(
    grad: ShardedTensor, sizes: tuple[int, ...], dim: int, start: int, step: int
) -> ShardedTensor | None:
    """The gradient of `x[start::step]` along a split dim, in the input's shape, nothing
    sent: each gradient block, covering elements j0..j1 of the slice, becomes the input
    block from element j0's position up to element j1's (the first from 0, the last to
    the end), its elements spread `step` apart among zeros. None where the gradient's
    blocks do not tile the slice (holes: the fallback)."""
    n, count = sizes[dim], grad.shape[dim]
    if count == 0 or start + step * (count - 1) >= n:
        return None

    def how(b: Block) -> Block:
        j0, j1 = b.offsets[dim], b.offsets[dim] + b.sizes[dim]
        lo = 0 if j0 == 0 else start + step * j0
        hi = n if j1 == count else start + step * j1
        offsets, extent = list(b.offsets), list(b.sizes)
        offsets[dim], extent[dim] = lo, hi - lo
        return Block(tuple(offsets), tuple(extent))

    try:
        layout = _mapped(grad._layout, sizes, how, ("strided slice_backward", dim, start, step))
    except LayoutError:  # the gradient's blocks leave holes along the dim
        return None
    if layout is None:
        return None
    shards = []
    for shard, b, nb in zip(
        grad._shards, grad._layout.blocks_of(grad._rank), layout.blocks_of(grad._rank)
    ):
        out = shard.new_zeros(nb.sizes)
        if not nb.is_empty() and not b.is_empty():
            begin = start + step * b.offsets[dim] - nb.offsets[dim]
            index = [slice(None)] * len(sizes)
            index[dim] = slice(begin, begin + step * (b.sizes[dim] - 1) + 1, step)
            out[tuple(index)] = shard
        shards.append(out)
    return grad._with_layout(layout, shards, dtype=grad.dtype, device=grad.device)


@_handles(aten.select_backward.default)
def _select_backward(func: Any, args: tuple, kwargs: dict) -> Any:
    a = named(func, args, kwargs)
    grad, sizes = a["grad_output"], tuple(a["input_sizes"])
    dim = a["dim"] % len(sizes)
    if not isinstance(grad, ShardedTensor):
        return fallback(func, args, kwargs)
    index = a["index"] + sizes[dim] if a["index"] < 0 else a["index"]
    lifted = _unsqueeze(aten.unsqueeze.default, (grad, dim), {})
    layout = _widened(lifted, sizes, dim, ("select_backward", dim))
    shards = []
    for shard, nb in zip(lifted._shards, layout.blocks_of(grad._rank)):
        out = shard.new_zeros(nb.sizes)
        if not nb.is_empty():
            out.narrow(dim, index, 1).copy_(shard)
        shards.append(out)
    return grad._with_layout(layout, shards, dtype=grad.dtype, device=grad.device)
