"""Reductions combined on use: DTensor's `Partial`, for ShardedTensors.

A reduction along a sharded dimension (`x.sum()`, a row-sharded `linear`'s
weight gradient `gᵀ·x`, a row-wise embedding lookup) leaves each rank a part
of the result, which one all-reduce combines. `later(parts, op, like)` returns
the parts as a *pending* result (`ShardedTensor.pending_reduce`): its layout
is replicated, and the all-reduce runs the first time its values are read
(`_shards`: a rule on a non-linear op, `local_shards()`, `full_tensor()`,
`item()`, a checkpoint), once for the tensor and its aliases. So
`loss = x.sum(); loss.backward()` combines nothing, and a weight gradient is
combined when the optimizer reads it, as with DTensor.

Some ops keep a result pending, because they commute with the combine, exactly
(run on the parts, then combined, they give the same value as on the combined
result); `keep(func, args, kwargs)` runs them on the parts:

- for any combine: `detach`/`alias` (the same record), views and selections
  (`view`, `reshape`, `t`, `transpose`, `permute`, `expand`, `squeeze`,
  `unsqueeze`, `slice`, `select`: a record whose values are that view of the
  base's, so writes through either are seen by both), `clone`;
- `_to_copy` into a dtype that holds the parts exactly for a sum (a float into
  a wider float or complex; rounded parts do not sum to the rounded sum, and
  integers would stop wrapping where their sum wraps), into a floating dtype
  for a maximum or minimum;
- for a sum: `neg`; `sum`/`mean` into such a dtype; a product with a finite
  Python number, a quotient by a nonzero one (a rank's part of 0 would make
  0·inf a nan), and sums and differences of pending sums (a finite `alpha`),
  each keeping the parts' dtype, on parts that are not float16 (whose parts
  can overflow where their sum does not); in place too (`add_` of a pending
  sum into one, `mul_`/`div_`: autograd accumulating a weight gradient over
  steps), written into the parts;
- `zero_` for any combine (zero parts combine to zero);
- `empty_like`/`zeros_like`/`ones_like`/`full_like`/`rand_like`/`randn_like`
  read only the shape (autograd's `ones_like(loss)`): their result is a plain
  replicated one, nothing combined.

Any other op reads the values and so combines first. Every API reads values,
never parts: `to_local()`, `local_shards()`, `placements` (`Replicate()`: what
the values are), a checkpoint (saving combines every pending tensor on every
rank first). Cost: a pending result's all-reduce, about 2× its bytes per rank
(a floating maximum or minimum twice that: a NaN flag rides along, as torch's
`amax` keeps a NaN that gloo's and NCCL's MAX drop),
runs at most once; a result that is never read costs none. As with DTensor,
reading a pending value is collective: every rank of the group must read it
(`if rank == 0: loss.item()` waits for the others; printing is not reading:
`repr` shows `pending='sum'`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from ..tensor import ShardedTensor
from ..tensor.pending import Pending
from .builtin import LIKE_OPS
from .exchange import _distributed, replicated
from .per_shard import named

__all__ = ["KEEPS_PENDING", "combine", "keep", "later"]

aten = torch.ops.aten

_REDUCE_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


def later(parts: torch.Tensor, op: str, like: ShardedTensor) -> ShardedTensor:
    """This rank's part of a result the group combines by `op` ("sum", "max", "min"), as a
    replicated ShardedTensor on `like`'s group, combined on first use. On a group of
    one rank the part is the value, and nothing waits."""
    layout = replicated(tuple(parts.shape), like._layout.world_size)
    out = like._with_layout(layout, [parts], dtype=parts.dtype, device=parts.device)
    if _distributed(like):
        out._pending = Pending(op, [parts])
    return out


def combine(st: ShardedTensor, pending: Pending) -> list[torch.Tensor]:
    """`st`'s values: its parts all-reduced over its group, into new tensors (the parts
    stay as they are, for views of them)."""
    value = pending.parts[0].clone(memory_format=torch.contiguous_format)
    if not _distributed(st):
        return [value]
    if pending.op != "sum" and value.dtype.is_floating_point:
        return [_extreme(value, pending.op == "max", st.group)]
    dist.all_reduce(value, op=_REDUCE_OPS[pending.op], group=st.group)
    return [value]


def _extreme(value: torch.Tensor, high: bool, group: Any) -> torch.Tensor:
    """The maximum (`high`) or minimum over the group of floating `value`, NaN where any
    rank's is, as torch's `amax`: gloo's and NCCL's MAX skip or keep a NaN as it comes,
    so a NaN flag rides along in the same all-reduce (a minimum as the maximum of the
    negated values, exact)."""
    nan = torch.isnan(value)
    plain = torch.where(nan, torch.full_like(value, -math.inf), value if high else -value)
    both = torch.stack([nan.to(value.dtype), plain])
    dist.all_reduce(both, op=dist.ReduceOp.MAX, group=group)
    best = both[1] if high else -both[1]
    return torch.where(both[0] > 0, torch.full_like(best, math.nan), best)


# -- ops run on the parts --------------------------------------------------------------


def _parts(x: ShardedTensor) -> Pending | None:
    """`x`'s record while its values need a combine, else None."""
    pending = x._pending
    return pending if pending is not None and not pending.done else None


def _part(x: Any) -> Any:
    """What an op on the parts takes for `x`: a pending operand's part, a ShardedTensor's
    (replicated) value, anything else as it is."""
    if isinstance(x, ShardedTensor):
        pending = _parts(x)
        return pending.parts[0] if pending is not None else x._shards[0]
    return x


def _on_parts(
    func: Any, args: tuple, kwargs: dict, op: str, ref: ShardedTensor, view: bool = False
) -> Any:
    """`func` on the parts of the pending operands (the values of the others), pending
    with `op`; with `view` (a view op on one pending operand), a record whose values are
    the same view of its base's values. None when the result is not one tensor."""

    out = func(*map(_part, args), **{k: _part(v) for k, v in kwargs.items()})
    if not isinstance(out, torch.Tensor):
        return None
    layout = replicated(tuple(out.shape), ref._layout.world_size)
    result = ref._with_layout(layout, [out], dtype=out.dtype, device=out.device)
    if view:
        rest, named_rest = args[1:], dict(kwargs)
        result._pending = Pending(
            op, [out], base=ref._pending, derive=lambda t: func(t, *rest, **named_rest)
        )
    else:
        result._pending = Pending(op, [out])
    return result


def _alias(func: Any, args: tuple, kwargs: dict) -> Any:
    """`detach` / `alias`: a new tensor sharing the record (one combine for both)."""
    st = args[0]
    pending = st._pending
    out = st._with_shards(list(pending.parts))
    out._pending = pending
    return out


def _like(func: Any, args: tuple, kwargs: dict) -> Any:
    """A factory that reads only the shape: run on the parts, nothing pending."""
    st = args[0]
    return st._with_shards([func(s, *args[1:], **kwargs) for s in st._pending.parts])


# dtype -> the dtypes that hold each of its values exactly, with at least its range (a
# sum of converted parts is then the converted sum, up to the order of the additions).
# Integers convert to nothing else: a float rounds them, a wider integer would not wrap
# where their sum does.
_WIDER = {
    torch.float16: {torch.float32, torch.float64, torch.complex64, torch.complex128},
    torch.bfloat16: {torch.float32, torch.float64, torch.complex64, torch.complex128},
    torch.float32: {torch.float64, torch.complex64, torch.complex128},
    torch.float64: {torch.complex128},
    torch.complex64: {torch.complex128},
}

# parts whose arithmetic can overflow where their sum does not (65,504 is float16's
# largest value): combined before any arithmetic
_NARROW = (torch.float16,)


def _widens(src: torch.dtype, dst: torch.dtype | None) -> bool:
    """Whether `src` values convert exactly into `dst` (None: `src` itself)."""
    return dst is None or dst == src or dst in _WIDER.get(src, ())


def _copy_or_view(func: Any, args: tuple, kwargs: dict) -> Any:
    """A copy or a view, which commute with every combine; a dtype conversion only where
    exact for a sum (widening) or order-keeping for a maximum (real to floating)."""
    st = args[0]
    pending = _parts(st)
    if pending is None or any(isinstance(x, ShardedTensor) for x in (*args[1:], *kwargs.values())):
        return None
    if func is aten._to_copy.default:
        src, dst = st.dtype, kwargs.get("dtype")
        if pending.op == "sum" and not _widens(src, dst):
            return None  # rounded parts do not sum to the rounded sum
        if (
            pending.op != "sum"
            and dst is not None
            and not (dst.is_floating_point and not src.is_complex)
        ):
            return None  # a maximum's fill (-inf) has no integer; complex has no order
    if func not in _VIEW_OPS:
        return _on_parts(func, args, kwargs, pending.op, st)
    try:
        return _on_parts(func, args, kwargs, pending.op, st, view=True)
    except RuntimeError:  # `view` of parts laid out otherwise (a transposed gradient)
        return None  # combined first: the op's own rule reshapes the values


def _finite_number(x: Any, nonzero: bool = False) -> bool:
    """A Python number every rank passes alike; finite, so a part of 0 stays 0 (0·inf is
    nan), and nonzero for a divisor."""
    if type(x) is bool:
        return not nonzero or x
    return type(x) in (int, float) and math.isfinite(x) and (not nonzero or x != 0)


def _keeps(dtype: torch.dtype, number: Any, nonzero: bool = False) -> bool:
    """A finite (nonzero) number that combined with `dtype` parts keeps their dtype."""
    return (
        _finite_number(number, nonzero)
        and torch.result_type(torch.empty((), dtype=dtype), number) == dtype
    )


def _linear_in_sum(func: Any, args: tuple, kwargs: dict) -> bool:
    """Whether `func` is linear in its pending-sum operands, exactly: `neg`; `sum`/`mean`
    into a dtype that holds the parts; a product with a finite number, a quotient by a
    nonzero one, sums and differences of pending sums (a finite `alpha`), each keeping the
    parts' dtype (no promotion: an integer sum times 1.0 would round its parts), on parts
    whose arithmetic cannot overflow where the sum would not (not float16)."""
    sharded = [x for x in (*args, *kwargs.values()) if isinstance(x, ShardedTensor)]
    pendings = [p for p in map(_parts, sharded) if p is not None]
    if any(p.op != "sum" for p in pendings):
        return False
    dtype = pendings[0].parts[0].dtype
    if func is aten.neg.default:
        return True
    if dtype in _NARROW:
        return False
    if func in _ADDS:
        # a pending sum plus a value would add the value once per rank
        operands = args[:2]
        return (
            all(isinstance(x, ShardedTensor) and _parts(x) is not None for x in operands)
            and all(x.dtype == dtype for x in operands)
            and _keeps(dtype, kwargs.get("alpha", 1))
        )
    if func in _PRODUCTS:
        first, second = args[0], args[1]
        first_pending = isinstance(first, ShardedTensor) and _parts(first) is not None
        number = second if first_pending else first
        if func in _QUOTIENTS and not first_pending:
            return False  # a value divided by a pending sum is not linear in it
        return (
            kwargs.get("rounding_mode") is None
            and _keeps(dtype, number, nonzero=func in _QUOTIENTS)
            and (func not in _QUOTIENTS or dtype.is_floating_point or dtype.is_complex)
        )
    if func in _REDUCTIONS:
        return _widens(dtype, named(func, args, kwargs).get("dtype"))
    return True


def _sum_only(func: Any, args: tuple, kwargs: dict) -> Any:
    """An op linear in its pending-sum operands, run on the parts."""
    if not _linear_in_sum(func, args, kwargs):
        return None
    ref = next(x for x in args if isinstance(x, ShardedTensor) and _parts(x) is not None)
    return _on_parts(func, args, kwargs, "sum", ref)


def _sum_in_place(func: Any, args: tuple, kwargs: dict) -> Any:
    """`add_` / `sub_` of a pending sum into one, `mul_` / `div_` of one by a finite number
    (autograd accumulating a weight gradient, a loss scaled): into the parts, so the
    tensor, its aliases and views stay pending (and see the write, as they would)."""
    dst = args[0]
    pending = _parts(dst) if isinstance(dst, ShardedTensor) else None
    if pending is None or not _linear_in_sum(func, args, kwargs):
        return None

    func(pending.parts[0], *map(_part, args[1:]), **kwargs)
    return dst


def _zero(func: Any, args: tuple, kwargs: dict) -> Any:
    """`zero_` (an optimizer's `zero_grad(set_to_none=False)`): zero parts combine to zero
    under every combine, so the parts are zeroed and nothing is combined."""
    dst = args[0]
    pending = _parts(dst)
    if pending is None:
        return None
    pending.parts[0].zero_()
    return dst


# ops whose result is a view of their operand: a pending result's view shares its storage
_VIEW_OPS = frozenset(
    {
        aten.view.default,
        aten._unsafe_view.default,
        aten._reshape_alias.default,
        aten.reshape.default,
        aten.t.default,
        aten.transpose.int,
        aten.permute.default,
        aten.expand.default,
        aten.squeeze.default,
        aten.squeeze.dim,
        aten.squeeze.dims,
        aten.unsqueeze.default,
        aten.slice.Tensor,
        aten.select.int,
    }
)

_REDUCTIONS = (aten.sum.default, aten.sum.dim_IntList, aten.mean.default, aten.mean.dim)

_SUM_OPS = (
    aten.neg.default,
    *_REDUCTIONS,
    aten.mul.Tensor,
    aten.mul.Scalar,
    aten.div.Tensor,
    aten.div.Scalar,
    aten.add.Tensor,
    aten.sub.Tensor,
)

_ADDS = (aten.add.Tensor, aten.sub.Tensor, aten.add_.Tensor, aten.sub_.Tensor)
_QUOTIENTS = (aten.div.Tensor, aten.div.Scalar, aten.div_.Tensor, aten.div_.Scalar)
_PRODUCTS = (aten.mul.Tensor, aten.mul.Scalar, aten.mul_.Tensor, aten.mul_.Scalar, *_QUOTIENTS)

_SUM_IN_PLACE_OPS = (
    aten.add_.Tensor,
    aten.sub_.Tensor,
    aten.mul_.Tensor,
    aten.mul_.Scalar,
    aten.div_.Tensor,
    aten.div_.Scalar,
)

# op -> its rule on a pending operand (None from the rule: combine first, as any op)
KEEPS_PENDING: dict[Any, Callable[[Any, tuple, dict], Any]] = {
    aten.detach.default: _alias,
    aten.alias.default: _alias,
    aten.clone.default: _copy_or_view,
    aten._to_copy.default: _copy_or_view,
    **{op: _copy_or_view for op in _VIEW_OPS},
    **{op: _sum_only for op in _SUM_OPS},
    **{op: _sum_in_place for op in _SUM_IN_PLACE_OPS},
    aten.zero_.default: _zero,
    **{op: _like for op in LIKE_OPS},
}


def keep(func: Any, args: tuple, kwargs: dict) -> Any:
    """`func`'s result kept pending when an operand is pending and `func` commutes with its
    combine; None otherwise (the caller runs the op's own rule, which combines)."""
    for x in args:  # every op's pending operand is positional; most calls have none
        if isinstance(x, ShardedTensor) and x._pending is not None and not x._pending.done:
            return KEEPS_PENDING[func](func, args, kwargs)
    return None
