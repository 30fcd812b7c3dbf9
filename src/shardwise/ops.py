"""How aten ops run on a `ShardedTensor`: shard by shard, never on the whole.

Three sources of handlers, consulted in order:
1. the user registry (`register_op` / `unregister_op`), so a user can override anything;
2. the built-in table below (copies, views, factories, equality);
3. every op tagged `torch.Tag.pointwise`, applied to matching shards.
Anything else raises `NotImplementedError` naming the op.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_map

from .errors import LayoutError
from .tensor import ShardedTensor
from .tensor.provided import provide

__all__ = ["register_dispatch_handler", "register_op", "unregister_op"]

aten = torch.ops.aten
Handler = Callable[..., Any]

_USER_HANDLERS: dict[Any, Handler] = {}
_BUILTIN_HANDLERS: dict[Any, Callable[[Any, tuple, dict], Any]] = {}


def register_op(op: torch._ops.OpOverload, handler: Handler) -> None:
    """Run `handler(*args, **kwargs)` for `op` on ShardedTensors; its result is returned as is."""
    if not isinstance(op, torch._ops.OpOverload):
        raise TypeError(
            f"register_op needs an OpOverload such as torch.ops.aten.sum.default, got {op!r}"
        )
    _USER_HANDLERS[op] = handler


def register_dispatch_handler(op: torch._ops.OpOverload, handler: Handler) -> None:
    """PhysicsNeMo's name (`ShardTensor.register_dispatch_handler`) for `register_op`."""
    register_op(op, handler)


def unregister_op(op: torch._ops.OpOverload) -> None:
    """Remove the handler `register_op` installed for `op`; built-in handling applies again.

    Raises `KeyError` naming `op` when no handler is registered for it.
    """
    try:
        del _USER_HANDLERS[op]
    except KeyError:
        raise KeyError(
            f"no handler registered for {op}; register_op({op}, handler) installs one"
        ) from None


def dispatch(func: Any, args: tuple, kwargs: dict) -> Any:
    user = _USER_HANDLERS.get(func)
    if user is not None:
        return user(*args, **kwargs)
    builtin = _BUILTIN_HANDLERS.get(func)
    if builtin is not None:
        return builtin(func, args, kwargs)
    if torch.Tag.pointwise in func.tags:
        return _pointwise(func, args, kwargs)
    raise NotImplementedError(
        f"{func} is not supported on shardwise.ShardedTensor; register a handler with "
        f"shardwise.register_op({func}, handler), or work on st.local_shards()"
    )


def _handles(*ops: Any) -> Callable[[Callable], Callable]:
    def register(fn: Callable) -> Callable:
        for op in ops:
            _BUILTIN_HANDLERS[op] = fn
        return fn

    return register


# -- helpers ------------------------------------------------------------------


def _sharded_args(args: tuple, kwargs: dict) -> list[ShardedTensor]:
    leaves, _ = tree_flatten((args, kwargs))
    return [x for x in leaves if isinstance(x, ShardedTensor)]


def _common(func: Any, sharded: list[ShardedTensor]) -> ShardedTensor:
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


def _piece(func: Any, ref: ShardedTensor, i: int) -> Callable[[Any], Any]:
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


def _result_meta(func: Any, args: tuple, kwargs: dict) -> tuple[torch.dtype, torch.device]:
    """dtype/device of `func`'s result, for a rank with no shard to compute on."""
    ref = _sharded_args(args, kwargs)[0]

    def to_meta(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return torch.empty((), dtype=x.dtype, device="meta")
        return x

    meta_args, meta_kwargs = tree_map(to_meta, (args, kwargs))
    out = func(*meta_args, **meta_kwargs)
    first = out[0] if isinstance(out, (tuple, list)) else out
    return first.dtype, ref.device


def _per_shard(func: Any, args: tuple, kwargs: dict) -> list[Any]:
    ref = _common(func, _sharded_args(args, kwargs))
    results = []
    for i in range(len(ref._shards)):
        a, k = tree_map(_piece(func, ref, i), (args, kwargs))
        results.append(func(*a, **k))
    return results


def _wrap(func: Any, ref: ShardedTensor, results: list[Any], args: tuple, kwargs: dict) -> Any:
    """Turn per-shard results into ShardedTensor(s) of `ref`'s layout."""
    if results and isinstance(results[0], (tuple, list)):
        return type(results[0])(
            _wrap(func, ref, [r[j] for r in results], args, kwargs) for j in range(len(results[0]))
        )
    if results:
        return ref._with_shards(results)
    dtype, device = _result_meta(func, args, kwargs)
    return ref._with_shards([], dtype=dtype, device=device)


def _is_inplace(func: Any) -> bool:
    return func._schema.name.endswith("_")


# -- pointwise -------------------------------------------------------------------


def _pointwise(func: Any, args: tuple, kwargs: dict) -> Any:
    if _is_inplace(func) and not isinstance(args[0], ShardedTensor):
        raise NotImplementedError(
            f"{func} writes into a plain tensor from a ShardedTensor; that needs "
            f"communication: use st.full_tensor() first"
        )
    results = _per_shard(func, args, kwargs)
    if "out" in kwargs:
        return kwargs["out"]
    if _is_inplace(func):
        return args[0]
    ref = _sharded_args(args, kwargs)[0]
    return _wrap(func, ref, results, args, kwargs)


_handles(aten.fill_.Scalar, aten.fill_.Tensor, aten.zero_.default)(_pointwise)


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
    _per_shard(func, args, kwargs)
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
    results = _per_shard(func, args, kwargs)
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


provide(dispatch=dispatch, register_dispatch_handler=register_dispatch_handler)
