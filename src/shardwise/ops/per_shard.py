"""Running an aten op shard by shard: operands picked per shard, results rewrapped.

Every operand ShardedTensor must share the first one's layout and rank; a plain
tensor broadcasts against the global shape and each shard takes its block of it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_map

from ..errors import LayoutError
from ..layout import Block, Layout
from ..tensor import ShardedTensor

__all__ = [
    "blocks_mapped",
    "empty_block",
    "flat",
    "is_inplace",
    "named",
    "per_shard",
    "registrar",
    "sharded_args",
    "tensors_in",
    "wrap",
]


def empty_block(ndim: int) -> Block:
    """The box an empty block of an `ndim`-dim result is written with."""
    return Block((0,) * ndim, (0,) * ndim)


def blocks_mapped(
    layout: Layout, shape: tuple[int, ...], how: Callable[[Block], Block | None]
) -> Layout | None:
    """A layout of `shape` with each block of `layout` mapped by `how` (an empty block,
    or one mapped to nothing, is written as `empty_block`); None when `how` gives some
    block no image."""
    blocks: dict[int, list[Block]] = {}
    for rank, rank_blocks in enumerate(layout.blocks):
        out = []
        for b in rank_blocks:
            if b.is_empty():
                out.append(empty_block(len(shape)))
                continue
            mapped = how(b)
            if mapped is None:
                return None
            out.append(mapped if not mapped.is_empty() else empty_block(len(shape)))
        blocks[rank] = out
    return Layout(shape, blocks, layout.world_size)


# what an aten op's argument is when it is no container: such arguments are their own
# leaves, found without a pytree walk (a third of a small pointwise op's time)
_LEAVES = frozenset(
    {int, float, bool, complex, str, type(None), torch.dtype, torch.device, torch.layout}
)


def flat(args: tuple, kwargs: dict) -> bool:
    """Whether no argument is a container: its leaves are the arguments themselves."""
    return all(isinstance(x, torch.Tensor) or type(x) in _LEAVES for x in (*args, *kwargs.values()))


def tensors_in(args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The tensors among `(args, kwargs)`'s leaves, in pytree's order: arguments and
    lists or tuples of them looked at directly, anything else through pytree."""
    out: list[torch.Tensor] = []
    for x in (*args, *kwargs.values()):
        if isinstance(x, torch.Tensor):
            out.append(x)
        elif type(x) in _LEAVES:
            continue
        elif type(x) in (list, tuple) and all(
            isinstance(y, torch.Tensor) or type(y) in _LEAVES for y in x
        ):
            out.extend(y for y in x if isinstance(y, torch.Tensor))
        else:
            leaves, _ = tree_flatten((args, kwargs))
            return [y for y in leaves if isinstance(y, torch.Tensor)]
    return out


def sharded_args(args: tuple, kwargs: dict) -> list[ShardedTensor]:
    return [x for x in tensors_in(args, kwargs) if isinstance(x, ShardedTensor)]


def common(func: Any, sharded: list[ShardedTensor]) -> ShardedTensor:
    """The first operand, after checking that all share its layout and rank."""
    ref = sharded[0]
    for other in sharded[1:]:
        if other._layout != ref._layout or other._rank != ref._rank:
            raise LayoutError(
                f"{func} mixes ShardedTensors of different layouts ({ref._layout} on "
                f"rank {ref._rank} and {other._layout} on rank {other._rank}); "
                f"redistribute one to the other's layout first"
            )
    return ref


def piece(func: Any, ref: ShardedTensor, i: int) -> Callable[[Any], Any]:
    """Map an operand to what shard `i`'s computation needs of it."""
    block = ref.local_blocks[i]
    shape = torch.Size(ref._layout.global_shape)

    def pick(x: Any) -> Any:
        if isinstance(x, ShardedTensor):
            return x._shards[i]
        if isinstance(x, torch.Tensor) and x.dim() > 0:
            # A plain tensor broadcasts against the global shape; take our block of it.
            try:
                full = x.expand(shape)
            except RuntimeError as e:
                raise LayoutError(
                    f"{func}: a plain tensor of shape {tuple(x.shape)} does not broadcast "
                    f"to the ShardedTensor's global shape {tuple(shape)}"
                ) from e
            return full[block.slices()]
        return x

    return pick


def result_meta(func: Any, args: tuple, kwargs: dict) -> tuple[torch.dtype, torch.device]:
    """dtype/device of `func`'s result, for a rank with no shard to compute on."""
    ref = sharded_args(args, kwargs)[0]

    def to_meta(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return torch.empty((), dtype=x.dtype, device="meta")
        return x

    meta_args, meta_kwargs = tree_map(to_meta, (args, kwargs))
    out = func(*meta_args, **meta_kwargs)
    first = out[0] if isinstance(out, (tuple, list)) else out
    return first.dtype, ref.device


def per_shard(func: Any, args: tuple, kwargs: dict) -> list[Any]:
    ref = common(func, sharded_args(args, kwargs))
    results = []
    plain = flat(args, kwargs)
    for i in range(len(ref._shards)):
        pick = piece(func, ref, i)
        if plain:
            a, k = tuple(map(pick, args)), {n: pick(v) for n, v in kwargs.items()}
        else:
            a, k = tree_map(pick, (args, kwargs))
        results.append(func(*a, **k))
    return results


def wrap(func: Any, ref: ShardedTensor, results: list[Any], args: tuple, kwargs: dict) -> Any:
    """Turn per-shard results into ShardedTensor(s) of `ref`'s layout."""
    if results and isinstance(results[0], (tuple, list)):
        return type(results[0])(
            wrap(func, ref, [r[j] for r in results], args, kwargs) for j in range(len(results[0]))
        )
    if results:
        return ref._with_shards(results)
    dtype, device = result_meta(func, args, kwargs)
    return ref._with_shards([], dtype=dtype, device=device)


def is_inplace(func: Any) -> bool:
    return func._schema.name.endswith("_")


@functools.cache
def _arguments(func: Any) -> tuple[tuple[str, bool, bool, Any], ...]:
    """(name, keyword-only, has a default, the default) of each argument of `func`."""
    return tuple(
        (
            a.name,
            a.kwarg_only,
            a.has_default_value(),
            a.default_value if a.has_default_value() else None,
        )
        for a in func._schema.arguments
    )


def named(func: Any, args: tuple, kwargs: dict) -> dict[str, Any]:
    """`func`'s arguments by schema name, defaults filled in."""
    out: dict[str, Any] = {}
    for i, (name, kwarg_only, has_default, default) in enumerate(_arguments(func)):
        if i < len(args) and not kwarg_only:
            out[name] = args[i]
        elif name in kwargs:
            out[name] = kwargs[name]
        elif has_default:
            out[name] = default
    return out


def registrar(table: dict[Any, Callable[[Any, tuple, dict], Any]]) -> Callable[..., Callable]:
    """A decorator `@handles(op, ...)` that files a rule under each op in `table`."""

    def handles(*ops: Any) -> Callable[[Callable], Callable]:
        def register(fn: Callable) -> Callable:
            for op in ops:
                table[op] = fn
            return fn

        return register

    return handles
