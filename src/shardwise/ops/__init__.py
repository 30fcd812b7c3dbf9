"""How aten ops run on a `ShardedTensor`: shard by shard, never on the whole.

Three sources of handlers, consulted in order:
1. the user registry (`register_op` / `unregister_op`), so a user can override anything;
2. the built-in table (`builtin`: copies, views, factories, equality);
3. every op tagged `torch.Tag.pointwise`, applied to matching shards (`per_shard`).
Anything else raises `NotImplementedError` naming the op.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..errors import InvalidTypeError
from ..tensor.provided import provide
from .builtin import BUILTIN_HANDLERS
from .per_shard import pointwise

__all__ = ["register_dispatch_handler", "register_op", "unregister_op"]

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
    builtin = BUILTIN_HANDLERS.get(func)
    if builtin is not None:
        return builtin(func, args, kwargs)
    if torch.Tag.pointwise in func.tags:
        return pointwise(func, args, kwargs)
    raise NotImplementedError(
        f"{func} is not supported on shardwise.ShardedTensor; register a handler with "
        f"shardwise.register_op({func}, handler), or work on st.local_shards()"
    )


provide(dispatch=dispatch, register_dispatch_handler=register_dispatch_handler)
