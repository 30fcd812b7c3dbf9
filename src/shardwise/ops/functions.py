"""What happens one level above `__torch_dispatch__`, where autograd still sees the call.

Two things need the autograd level:

- **Plain tensors that require grad meet a ShardedTensor** (an `nn.Module`'s
  parameters applied to a sharded input, PhysicsNeMo's domain parallelism):
  such a tensor is promoted to a replicated ShardedTensor on the other
  operand's group, by a differentiable step whose backward hands the
  parameter its gradient as a plain tensor, summed over the whole input
  (the rules that produce it all-reduce; a gradient left sharded is gathered).
- **`sum` and `mean`** (`torch.sum`, `Tensor.sum`, `torch.mean`,
  `Tensor.mean`) get a backward that returns the gradient in the input's own
  layout: each block takes its part of the (replicated or projected)
  gradient, with no communication. Through aten's own backward (`expand`) the
  gradient would come back replicated, and every rank would compute the rest
  of the backward pass on the whole tensor.

Everything else goes on to `__torch_dispatch__` as for DTensor.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..layout import Block
from ..tensor import ShardedTensor
from ..tensor.sharded import AUTOGRAD_FUNCTIONS
from .exchange import is_replicated, local_in, replicated, whole
from .reductions import _dims, _projected_block, project

__all__ = ["FUNCTION_RULES", "torch_function"]

aten = torch.ops.aten


class _Promote(torch.autograd.Function):
    """A plain tensor as a replicated ShardedTensor on `like`'s group (no copy)."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, like: ShardedTensor) -> ShardedTensor:
        layout = replicated(tuple(tensor.shape), like._layout.world_size)
        return like._with_layout(layout, [tensor], dtype=tensor.dtype, device=tensor.device)

    @staticmethod
    def backward(ctx: Any, grad: Any) -> tuple[torch.Tensor, None]:
        if isinstance(grad, ShardedTensor):
            grad = whole(grad)
        return grad, None


def _promote(x: Any, like: ShardedTensor) -> Any:
    if isinstance(x, torch.Tensor) and not isinstance(x, ShardedTensor) and x.requires_grad:
        return _Promote.apply(x, like)
    if isinstance(x, (list, tuple)) and any(
        isinstance(e, torch.Tensor) and not isinstance(e, ShardedTensor) and e.requires_grad
        for e in x
    ):
        return type(x)(_promote(e, like) for e in x)
    return x


def _needs_promotion(args: tuple, kwargs: dict) -> ShardedTensor | None:
    """The first ShardedTensor operand when a plain operand requires grad, else None."""
    like, plain = None, False
    for x in (*args, *kwargs.values()):
        items = x if isinstance(x, (list, tuple)) else (x,)
        for e in items:
            if isinstance(e, ShardedTensor):
                like = e if like is None else like
            elif isinstance(e, torch.Tensor) and e.requires_grad:
                plain = True
    return like if plain else None


# -- sum and mean with a layout-keeping backward ----------------------------------


class _Reduce(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        st: ShardedTensor,
        dims: tuple[int, ...],
        keepdim: bool,
        dtype: torch.dtype | None,
        mean: bool,
    ) -> ShardedTensor:
        op = aten.mean.dim if mean else aten.sum.dim_IntList
        out = op(st, list(dims), keepdim, dtype=dtype)
        # what the gradient is built on: the input's layout, rank, group and mesh (not the
        # input itself, whose shards backward does not need)
        ctx.place = (st._layout, st._rank, st._group, st._mesh, st.device)
        ctx.shape, ctx.dims, ctx.keepdim = tuple(st.shape), dims, keepdim
        ctx.scale = 1.0 / max(1, _count(ctx.shape, dims)) if mean else None
        ctx.out_layout = out._layout
        return out

    @staticmethod
    def backward(ctx: Any, grad: Any) -> tuple[Any, ...]:
        layout, rank, group, mesh, device = ctx.place
        dims, keepdim = ctx.dims, ctx.keepdim
        blocks = layout.blocks_of(rank)
        shards = []
        if (
            isinstance(grad, ShardedTensor)
            and not is_replicated(ctx.out_layout)
            and (ctx.out_layout == project(layout, dims, keepdim))
        ):
            parts = local_in(grad, ctx.out_layout)
            for part, block in zip(parts, blocks):
                shards.append(_spread(part, block, dims, keepdim, ctx.scale))
        else:
            g = whole(grad) if isinstance(grad, ShardedTensor) else grad
            if not keepdim:
                for d in dims:
                    g = g.unsqueeze(d)
            for block in blocks:
                part = g[_projected_block(block, dims, True).slices()]
                shards.append(_spread(part, block, dims, True, ctx.scale))
        out = ShardedTensor(
            layout, shards, rank, dtype=grad.dtype, device=device, group=group, mesh=mesh
        )
        return out, None, None, None, None


def _count(shape: tuple[int, ...], dims: tuple[int, ...]) -> int:
    n = 1
    for d in dims:
        n *= shape[d]
    return n


def _spread(
    part: torch.Tensor, block: Block, dims: tuple[int, ...], keepdim: bool, scale: float | None
) -> torch.Tensor:
    if not keepdim:
        for d in dims:
            part = part.unsqueeze(d)
    out = part.expand(block.sizes)
    return (out * scale) if scale is not None else out.contiguous()


def _reduce_rule(mean: bool) -> Callable[[Any, tuple, dict], Any]:
    def rule(func: Any, args: tuple, kwargs: dict) -> Any:
        st = args[0] if args else kwargs.get("input")
        if not isinstance(st, ShardedTensor) or "out" in kwargs or not st.requires_grad:
            return NotImplemented
        rest = dict(kwargs)
        rest.pop("input", None)
        positional = list(args[1:])
        dim = positional.pop(0) if positional else rest.pop("dim", None)
        keepdim = positional.pop(0) if positional else rest.pop("keepdim", False)
        dtype = positional.pop(0) if positional else rest.pop("dtype", None)
        if isinstance(dim, torch.dtype):  # torch.sum(x, dtype) written positionally
            dim, dtype = None, dim
        if (
            rest
            or positional
            or isinstance(dim, str)
            or (isinstance(dim, (list, tuple)) and any(isinstance(d, str) for d in dim))
        ):
            return NotImplemented
        dims = _dims(dim, st.ndim) if st.ndim else ()
        return _Reduce.apply(st, dims, bool(keepdim), dtype, mean)

    return rule


FUNCTION_RULES: dict[Any, Callable[[Any, tuple, dict], Any]] = {
    torch.sum: _reduce_rule(False),
    torch.Tensor.sum: _reduce_rule(False),
    torch.mean: _reduce_rule(True),
    torch.Tensor.mean: _reduce_rule(True),
}


AUTOGRAD_FUNCTIONS.update(FUNCTION_RULES)


def torch_function(func: Any, types: tuple, args: tuple, kwargs: dict) -> Any:
    """`ShardedTensor.__torch_function__` past the user's handlers (see the module doc)."""
    if torch.is_grad_enabled():
        rule = FUNCTION_RULES.get(func)
        if rule is not None:
            out = rule(func, args, kwargs)
            if out is not NotImplemented:
                return out
        like = _needs_promotion(args, kwargs)
        if like is not None:
            args = tuple(_promote(a, like) for a in args)
            kwargs = {k: _promote(v, like) for k, v in kwargs.items()}
    return torch._C._disabled_torch_function_impl(func, types, args, kwargs)
