"""Indexing by an integer tensor along one dimension: `x[idx]`, `x[:, idx]`,
`index_select`, and their backward (`index_put`, `index_add_`).

The index (a plain tensor or a replicated ShardedTensor, the same on every
rank) picks positions along one dimension `d` of a ShardedTensor:

- **`d` unsharded** (every block spans it): each block picks its own, the
  result keeps the blocks, `d` replaced by the index's shape. No communication.
- **`d` sharded**: each rank looks up the positions its blocks hold (the
  others count 0), as an embedding lookup on a row-wise table; the result is
  a pending sum (`pending`: one all-reduce of the result's size, 2·O bytes, on
  first use), against the gather fallback's whole tensor.

Writes (`index_put`, `index_add_`: what the backward of a lookup does into a
tensor of zeros) go to the blocks that hold each position, with no
communication beyond gathering a `values` operand that is neither plain nor
replicated. A 1-d boolean mask every rank holds alike, along any dimension: each
block keeps its rows, its place in the result worked out from the mask's running
count, with no communication (writes take the mask's positions). Masks over several
dimensions, masks that differ by rank, several index tensors and anything else fall
back. An index out of range raises torch's `IndexError`.

`gather` and `scatter` (`scatter_add`, `scatter_reduce`, in place too: the backward
of `gather`, `sort`, `max(dim)`, `topk`) pick and write along one dimension `d`
within each row of the others: where the index's blocks span `d`, each block
works alone, against the same rows of `self` (and `src`) brought to its blocks:
no communication when they are laid out alike, else what `local_in` moves.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..layout import Block, Layout
from ..tensor import ShardedTensor
from .exchange import is_replicated, local_in, primary_blocks, whole_or_plain
from .fallback import fallback
from .linalg import _product_layout
from .pending import later
from .per_shard import named, registrar
from .reductions import in_range, spans, widened

__all__ = ["INDEXING_HANDLERS"]

aten = torch.ops.aten

INDEXING_HANDLERS: dict[Any, Callable[[Any, tuple, dict], Any]] = {}

_handles = registrar(INDEXING_HANDLERS)


def _one_index(indices: list[Any], ndim: int, masks: bool = False) -> tuple[int, Any] | None:
    """(d, index) when `indices` is Nones then one integer tensor every rank holds alike
    (with `masks`, also a 1-d boolean mask over `d`); else None."""
    found = [(d, t) for d, t in enumerate(indices) if t is not None]
    if len(found) != 1 or len(indices) > ndim:
        return None
    d, index = found[0]
    if isinstance(index, ShardedTensor) and not is_replicated(index._layout):
        return None
    if index.dtype in (torch.int64, torch.int32) or (
        masks and index.dtype in (torch.bool, torch.uint8) and index.ndim == 1
    ):
        return d, whole_or_plain(index)
    return None


def _mask_fits(mask: torch.Tensor, st: ShardedTensor, d: int) -> None:
    """torch's IndexError (on every rank, the mask being the same) for a mask whose
    length is not the dimension's."""
    if mask.shape[0] != st.shape[d]:
        raise IndexError(
            f"The shape of the mask [{mask.shape[0]}] at index {d} does not match the shape "
            f"of the indexed tensor {list(st.shape)} at index {d}"
        )


def _masked(st: ShardedTensor, d: int, mask: torch.Tensor) -> ShardedTensor:
    """`st` indexed by a boolean `mask` along `d`: every rank holds the mask, so each
    works out every block's place in the result from the mask's running count (O(B)
    for B blocks in the layout, the count O(n) once) and keeps its rows. No
    communication, whether `d` is sharded or not."""
    _mask_fits(mask, st, d)
    mask = mask.to(torch.bool)
    before = torch.zeros(mask.shape[0] + 1, dtype=torch.int64)
    torch.cumsum(mask.cpu(), 0, out=before[1:])
    at = before.tolist()  # at[i]: the kept positions before position i
    shape = tuple(st.shape[:d]) + (at[-1],) + tuple(st.shape[d + 1 :])

    def kept(b: Block) -> Block:  # a block keeping no row keeps its box along the rest
        lo, hi = b.offsets[d], b.offsets[d] + b.sizes[d]
        offsets, sizes = list(b.offsets), list(b.sizes)
        offsets[d], sizes[d] = at[lo], at[hi] - at[lo]
        return Block(tuple(offsets), tuple(sizes))

    layout = Layout(
        shape,
        {r: [kept(b) for b in blocks] for r, blocks in enumerate(st._layout.blocks)},
        st._layout.world_size,
    )
    mask = mask.to(st.device)
    shards = []
    for shard, b, nb in zip(st._shards, st._layout.blocks_of(st._rank), layout.blocks_of(st._rank)):
        if nb.is_empty():  # an empty block's shard has its (zero) sizes
            shards.append(shard.new_empty(nb.sizes))
            continue
        part = mask[b.offsets[d] : b.offsets[d] + b.sizes[d]]
        shards.append(shard[(slice(None),) * d + (part,)])
    return st._with_layout(layout, shards, dtype=st.dtype, device=st.device)


def _checked(index: torch.Tensor, size: int) -> torch.Tensor:
    """`index` with negative positions counted from the end; torch's IndexError (on every
    rank, the index being the same) for one out of range."""
    if index.numel():
        low, high = int(index.min()), int(index.max())
        if low < -size or high >= size:
            bad = low if low < -size else high
            raise IndexError(f"index {bad} is out of bounds for dimension with size {size}")
    return torch.where(index < 0, index + size, index)


def _lookup(st: ShardedTensor, d: int, index: torch.Tensor) -> ShardedTensor:
    """`st` indexed by `index` along `d`, by the rules above."""
    index = _checked(index, st.shape[d])
    k = tuple(index.shape)
    shape = tuple(st.shape[:d]) + k + tuple(st.shape[d + 1 :])
    pick = [None] * d + [index]
    if spans(st._layout, (d,)):  # `d` becomes the index's dims, whole
        rest = tuple(range(d)) + tuple(range(d + 1, st.ndim))
        where = tuple(range(d)) + tuple(range(d + len(k), len(shape)))
        layout = _product_layout(st._layout, rest, shape, where)
        shards = [aten.index.Tensor(s, pick) for s in st._shards]
        return st._with_layout(layout, shards, dtype=st.dtype, device=st.device)
    parts = torch.zeros(shape, dtype=st.dtype, device=st.device)
    blocks = st._layout.blocks_of(st._rank)
    for i in primary_blocks(st._layout, st._rank):
        b, shard = blocks[i], st._shards[i]
        lo, size = b.offsets[d], b.sizes[d]
        if not shard.numel():
            continue
        mine = (index >= lo) & (index < lo + size)
        local = (index - lo).clamp(0, size - 1)
        rows = aten.index.Tensor(shard, [None] * d + [local])
        view = mine.reshape((1,) * d + k + (1,) * (st.ndim - d - 1))
        region = tuple(slice(o, o + n) for o, n in zip(b.offsets[:d], b.sizes[:d]))
        after = tuple(slice(o, o + n) for o, n in zip(b.offsets[d + 1 :], b.sizes[d + 1 :]))
        target = parts[region + (slice(None),) * len(k) + after]
        target.add_(torch.where(view, rows, torch.zeros((), dtype=rows.dtype)))
    return later(parts, "sum", st)


@_handles(aten.index.Tensor)
def _index(func: Any, args: tuple, kwargs: dict) -> Any:
    a = named(func, args, kwargs)
    st = a["self"]
    found = (
        _one_index(list(a["indices"]), st.ndim, masks=True)
        if isinstance(st, ShardedTensor)
        else None
    )
    if found is None:
        return fallback(func, args, kwargs)
    d, index = found
    if not index.is_floating_point() and index.dtype in (torch.bool, torch.uint8):
        return _masked(st, d, index)
    return _lookup(st, d, index)


def _along(a: dict) -> tuple[ShardedTensor, int, torch.Tensor] | None:
    """(self, dim, index) of an op taking `self`, `dim` and a 1-d `index` (`index_select`,
    `index_add`) when this module has a rule for it, else None."""
    st, index = a["self"], a["index"]
    if not isinstance(st, ShardedTensor) or st.ndim == 0 or index.ndim != 1:
        return None
    found = _one_index([index], 1)
    return None if found is None else (st, a["dim"] % st.ndim, found[1])


@_handles(aten.index_select.default)
def _index_select(func: Any, args: tuple, kwargs: dict) -> Any:
    found = _along(named(func, args, kwargs))
    return fallback(func, args, kwargs) if found is None else _lookup(*found)


# -- writes: into the blocks that hold each position ----------------------------------


def _write(
    st: ShardedTensor,
    d: int,
    index: torch.Tensor,
    values: Any,
    write: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None],
) -> None:
    """For each of this rank's blocks: the positions of `index` (flattened) along `d` it
    holds, and `values` (broadcast to the lookup's shape) at them, handed to
    `write(shard, local positions, values)`, which writes them in place."""
    index = _checked(index, st.shape[d])
    before, after = tuple(st.shape[:d]), tuple(st.shape[d + 1 :])
    full = whole_or_plain(values).expand(before + tuple(index.shape) + after)
    index, full = index.reshape(-1), full.reshape(before + (-1,) + after)
    for shard, b in zip(st._shards, st._layout.blocks_of(st._rank)):
        if not shard.numel():
            continue
        lo, size = b.offsets[d], b.sizes[d]
        mine = (index >= lo) & (index < lo + size)
        head = tuple(slice(o, o + n) for o, n in zip(b.offsets[:d], b.sizes[:d]))
        tail = tuple(slice(o, o + n) for o, n in zip(b.offsets[d + 1 :], b.sizes[d + 1 :]))
        write(shard, index[mine] - lo, full[head + (mine,) + tail])


def _one_dim_index(a: dict, st: Any) -> tuple[int, torch.Tensor] | None:
    """(d, integer positions) of a write's one index along `d` (a mask: its positions)."""
    if not isinstance(st, ShardedTensor):
        return None
    found = _one_index(list(a["indices"]), st.ndim, masks=True)
    if found is not None and found[1].dtype in (torch.bool, torch.uint8):
        d, mask = found
        _mask_fits(mask, st, d)
        return d, mask.to(torch.bool).nonzero().reshape(-1)
    return found


@_handles(aten.index_put.default, aten.index_put_.default, aten._index_put_impl_.default)
def _index_put(func: Any, args: tuple, kwargs: dict) -> Any:
    a = named(func, args, kwargs)
    st = a["self"]
    found = _one_dim_index(a, st)
    if found is None:
        return fallback(func, args, kwargs)
    d, index = found
    accumulate = bool(a["accumulate"])
    if func is aten.index_put.default:
        st = st._with_shards([s.clone() for s in st._shards])

    def write(shard: torch.Tensor, local: torch.Tensor, values: torch.Tensor) -> None:
        aten.index_put_.default(shard, [None] * d + [local], values, accumulate)

    _write(st, d, index, a["values"], write)
    return st


@_handles(aten.index_add_.default, aten.index_add.default)
def _index_add(func: Any, args: tuple, kwargs: dict) -> Any:
    a = named(func, args, kwargs)
    found = _along(a)
    if found is None:
        return fallback(func, args, kwargs)
    st, d, index = found
    alpha = a.get("alpha", 1)
    if func is aten.index_add.default:
        st = st._with_shards([s.clone() for s in st._shards])

    def write(shard: torch.Tensor, local: torch.Tensor, values: torch.Tensor) -> None:
        shard.index_add_(d, local, values, alpha=alpha)

    _write(st, d, index, a["source"], write)
    return st


# -- gather and scatter along a dimension every block spans ---------------------------


def _rows_alike(a: torch.Size, b: torch.Size, d: int) -> bool:
    """The same sizes but along `d` (a block of one is then the same rows of the other)."""
    return len(a) == len(b) and all(x == y for e, (x, y) in enumerate(zip(a, b)) if e != d)


def _blocks_of(x: Any, layout: Layout, rank: int) -> list[torch.Tensor]:
    """This rank's shards of `layout` holding `x` (a ShardedTensor or a plain tensor)."""
    if isinstance(x, ShardedTensor):
        return local_in(x, layout)
    return [x[b.slices()] for b in layout.blocks_of(rank)]


def _plain_fits(st: Any, index: Any, dim: int) -> bool:
    """Whether a rule may run: `dim` names a dim of `self` (not 0-d), and an index every
    rank holds (plain, or replicated) is in range there (0 up: gather and scatter take
    no negative index): the fallback's run on the whole tensors raises torch's error
    for either on every rank. (A sharded index is checked by each block's op, on the
    ranks holding it, as DTensor's.)"""
    if st.ndim == 0 or not in_range(dim, st.ndim):
        return False
    if isinstance(index, ShardedTensor) and not is_replicated(index._layout):
        return True
    index = whole_or_plain(index)
    size = st.shape[dim % st.ndim]
    return not index.numel() or (0 <= int(index.min()) and int(index.max()) < size)


def _gather_layouts(st: Any, index: Any, d: int) -> tuple[Layout, Layout] | None:
    """(the index's layout, self's) for a rule along `d`, or None: the index's blocks
    (its own layout, else self's cut to its size along `d`) must span `d`."""
    replicated_index = isinstance(index, ShardedTensor) and is_replicated(index._layout)
    if isinstance(index, ShardedTensor) and not (
        replicated_index and isinstance(st, ShardedTensor)
    ):
        layout = index._layout
    elif isinstance(st, ShardedTensor) and spans(st._layout, (d,)):
        layout = widened(st._layout, d, index.shape[d])
    else:
        return None
    if not spans(layout, (d,)):
        return None
    return layout, widened(layout, d, st.shape[d])


@_handles(aten.gather.default)
def _gather(func: Any, args: tuple, kwargs: dict) -> Any:
    a = named(func, args, kwargs)
    st, index = a["self"], a["index"]
    found = None
    if _plain_fits(st, index, a["dim"]) and not a["sparse_grad"]:
        d = a["dim"] % st.ndim
        if _rows_alike(st.shape, index.shape, d):
            found = _gather_layouts(st, index, d)
    if found is None:
        return fallback(func, args, kwargs)
    at, need = found
    ref = index if isinstance(index, ShardedTensor) else st
    rank = ref._rank
    shards = [
        aten.gather.default(s, d, i)
        for s, i in zip(_blocks_of(st, need, rank), _blocks_of(index, at, rank), strict=True)
    ]
    return ref._with_layout(at, shards, dtype=st.dtype, device=st.device)


_SCATTERS = (
    aten.scatter.src,
    aten.scatter.value,
    aten.scatter.reduce,
    aten.scatter.value_reduce,
    aten.scatter_add.default,
    aten.scatter_reduce.two,
)
_SCATTERS_IN_PLACE = (
    aten.scatter_.src,
    aten.scatter_.value,
    aten.scatter_.reduce,
    aten.scatter_.value_reduce,
    aten.scatter_add_.default,
    aten.scatter_reduce_.two,
)


@_handles(*_SCATTERS, *_SCATTERS_IN_PLACE)
def _scatter(func: Any, args: tuple, kwargs: dict) -> Any:
    """`self` with `src` (or a value) written at `index` along `d`, per block of
    `self`'s layout (its own, else the index's widened to `self`'s size along `d`)."""
    a = named(func, args, kwargs)
    st, index = a["self"], a["index"]
    src = args[3] if len(args) > 3 else None  # a tensor, or the value written
    in_place = func in _SCATTERS_IN_PLACE
    fits = _plain_fits(st, index, a["dim"])
    d = a["dim"] % max(st.ndim, 1)
    layouts = None
    if (
        fits
        and len(args) > 3
        and not any(isinstance(v, torch.Tensor) for v in kwargs.values())
        and _rows_alike(st.shape, index.shape, d)
        and (not isinstance(src, torch.Tensor) or tuple(src.shape) == tuple(index.shape))
        and (isinstance(st, ShardedTensor) or not in_place)
    ):
        if isinstance(st, ShardedTensor) and not is_replicated(st._layout):
            if spans(st._layout, (d,)):
                layouts = (widened(st._layout, d, index.shape[d]), st._layout)
        else:
            layouts = _gather_layouts(st, index, d)
    if layouts is None or (in_place and layouts[1] != st._layout):
        return fallback(func, args, kwargs)
    at, out = layouts
    ref = (
        st
        if isinstance(st, ShardedTensor)
        else next(x for x in (index, src) if isinstance(x, ShardedTensor))
    )
    rank = ref._rank
    selfs = _blocks_of(st, out, rank)
    indices = _blocks_of(index, at, rank)
    srcs = _blocks_of(src, at, rank) if isinstance(src, torch.Tensor) else [src] * len(selfs)
    shards = []
    for s, i, v in zip(selfs, indices, srcs, strict=True):
        shards.append(func(s, d, i, v, *args[4:], **kwargs))
    if in_place:
        return st
    return ref._with_layout(out, shards, dtype=st.dtype, device=st.device)
