"""How aten ops run on a `ShardedTensor`: by rules that know the layouts.

Handlers are consulted in order:
1. the user registry (`register_op` / `unregister_op`), so a user can override anything;
   then, for an operand that is a reduction's pending result (DTensor's `Partial`),
   an op that keeps it pending (`pending`); any other op combines it first;
2. the built-in table (`builtin`: copies, factories, equality, functional collectives);
3. the rules by family: `reductions` (sums, extrema, norms, softmax, layer norm),
   `shape` (layout transforms, slicing, cat), `indexing` (by an integer tensor),
   `linalg` (products, embeddings,
   convolutions), `batched` (pooling, upsampling, attention, group norm: per block along
   the leading dims), `random` (in-place samplers, `nn.init`);
4. every op tagged `torch.Tag.pointwise`, shard by shard once the operands
   share a layout (`pointwise`);
5. anything else runs on whole tensors and comes back sharded (`fallback`): slower,
   never wrong. The op table in docs/ops.md lists the rule and the bytes moved per op.

One level up, `functions` promotes plain tensors that require grad and gives
`sum`/`mean` a backward that keeps the input's layout.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..errors import InvalidTypeError
from ..tensor.provided import provide
from .batched import BATCHED_HANDLERS
from .builtin import BUILTIN_HANDLERS
from .fallback import FALLBACK_OPS, fallback
from .functions import torch_function
from .indexing import INDEXING_HANDLERS
from .linalg import LINALG_HANDLERS
from .pending import KEEPS_PENDING, combine, keep
from .pointwise import pointwise
from .random import RANDOM_HANDLERS
from .reductions import REDUCTION_HANDLERS
from .shape import SHAPE_HANDLERS

__all__ = ["FALLBACK_OPS", "register_dispatch_handler", "register_op", "unregister_op"]

Handler = Callable[..., Any]

_USER_HANDLERS: dict[Any, Handler] = {}


def register_op(op: torch._ops.OpOverload, handler: Handler) -> None:
    """Run `handler(*args, **kwargs)` for `op` on ShardedTensors; its result is returned as is."""
    if not isinstance(op, torch._ops.OpOverload):
        raise InvalidTypeError(
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
    if func in KEEPS_PENDING:  # a pending reduction's result stays pending through it
        kept = keep(func, args, kwargs)
        if kept is not None:
            return kept
    rule = _RULES.get(func)
    if rule is not None:
        return rule(func, args, kwargs)
    if torch.Tag.pointwise in func.tags:
        return pointwise(func, args, kwargs)
    return fallback(func, args, kwargs)


_RULES: dict[Any, Handler] = {
    **REDUCTION_HANDLERS,
    **SHAPE_HANDLERS,
    **INDEXING_HANDLERS,
    **LINALG_HANDLERS,
    **BATCHED_HANDLERS,
    **RANDOM_HANDLERS,
    **BUILTIN_HANDLERS,
}

provide(
    combine_pending=combine,
    dispatch=dispatch,
    register_dispatch_handler=register_dispatch_handler,
    torch_function=torch_function,
)
