"""Function-level handlers: `torch.*` / `torch.nn.functional` calls on ShardedTensors.

`register_op` (in `shardwise.ops`) acts on aten ops, after autograd and
decomposition; some computations are only expressible one level up, where
`F.softmax(x, dim=1)` or `torch.sum(x)` is still one call: a softmax along an
unsharded dimension is per shard, a sum over every element is one collective.
These handlers are PhysicsNeMo's `ShardTensor.register_function_handler` /
`register_named_function_handler`, with its calling convention,
`handler(func, types, args, kwargs)`, so PhysicsNeMo handlers port unchanged
(they receive plain tensors as they are; PhysicsNeMo promotes them to
replicated DTensors first).

`ShardedTensor.__torch_function__` asks `handler_for(func)` first (by object,
then by `str(func)` for `torch.library.custom_op`s, as PhysicsNeMo); without a
handler the call goes on exactly as before, to `__torch_dispatch__`. The
registry lives in the tensor layer because the type consults it; it imports
nothing above.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..errors import InvalidTypeError

__all__ = [
    "handler_for",
    "register_function_handler",
    "register_named_function_handler",
    "torch_function",
    "unregister_function_handler",
]

# handler(func, types, args, kwargs) -> result, as PhysicsNeMo's ShardTensor calls it.
FunctionHandler = Callable[[Any, tuple, tuple, dict], Any]

_BY_FUNCTION: dict[Any, FunctionHandler] = {}
_BY_NAME: dict[str, FunctionHandler] = {}


def register_function_handler(func: Callable[..., Any], handler: FunctionHandler) -> None:
    """Run `handler(func, types, args, kwargs)` whenever `func` is called on a ShardedTensor.

    `func` is the Python-level callable (`torch.nn.functional.gelu`,
    `torch.sum`, `torch.Tensor.sum`, ...); its result is returned as is.
    """
    if not callable(func) or isinstance(func, str):
        raise InvalidTypeError(
            f"register_function_handler needs the function itself (e.g. torch.nn.functional.gelu), "
            f"got {func!r}; use register_named_function_handler for a name"
        )
    if not callable(handler):
        raise InvalidTypeError(f"the handler for {func!r} must be callable, got {handler!r}")
    _BY_FUNCTION[func] = handler


def register_named_function_handler(func_name: str, handler: FunctionHandler) -> None:
    """As `register_function_handler`, keyed by `str(func)`: a `torch.library.custom_op`
    called as `torch.ops.mylib.op(...)` is matched by its name, `"mylib.op.default"`."""
    if not isinstance(func_name, str):
        raise InvalidTypeError(
            f"register_named_function_handler needs a name such as 'mylib.op.default', "
            f"got {func_name!r}; use register_function_handler for a function"
        )
    if not callable(handler):
        raise InvalidTypeError(f"the handler for {func_name!r} must be callable, got {handler!r}")
    _BY_NAME[func_name] = handler


def unregister_function_handler(func: Callable[..., Any] | str) -> None:
    """Remove the handler registered for `func` (a function, or a name); `KeyError` if none."""
    registry: dict[Any, FunctionHandler] = _BY_NAME if isinstance(func, str) else _BY_FUNCTION
    try:
        del registry[func]
    except KeyError:
        raise KeyError(
            f"no function handler registered for {func!r}; register_function_handler / "
            f"register_named_function_handler install one"
        ) from None


def handler_for(func: Any) -> FunctionHandler | None:
    """The handler for `func`: by the object, then by its name; None without one."""
    if not (_BY_FUNCTION or _BY_NAME):
        return None
    try:
        handler = _BY_FUNCTION.get(func)
    except TypeError:  # an unhashable callable is never registered
        handler = None
    if handler is None and _BY_NAME:
        handler = _BY_NAME.get(str(func))
        if handler is None and isinstance(func, torch._ops.OpOverloadPacket):
            handler = _BY_NAME.get(f"{func}.default")  # torch.ops.mylib.op(...) called bare
    return handler


def torch_function(func: Any, types: tuple, args: tuple = (), kwargs: dict | None = None) -> Any:
    """`ShardedTensor.__torch_function__`: a registered handler, else the default, which
    runs `func` with torch functions disabled so that it reaches `__torch_dispatch__`
    (as for DTensor: no subclass wrapping of results at this level)."""
    kwargs = kwargs or {}
    handler = handler_for(func)
    if handler is not None:
        return handler(func, types, args, kwargs)
    return torch._C._disabled_torch_function_impl(func, types, args, kwargs)
