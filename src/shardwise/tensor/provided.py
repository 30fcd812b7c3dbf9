"""Code behind `ShardedTensor` methods that lives in the layers above the type.

`shardwise.comm` (collectives, the caller's rank), `shardwise.interop`
(conversions) and `shardwise.ops` (the `__torch_dispatch__` handlers) build
ShardedTensors, so they import `shardwise.tensor` and the type cannot import
them back. Each installs its functions here when it is imported, as
`jax.numpy` installs the methods of `jax.Array`; importing `shardwise` imports
all of them. The table is the whole interface between the type and the layers
above: a method looks its function up by name.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..errors import UsageError

__all__ = ["PROVIDERS", "provide", "provided"]

# What each layer provides: the name a method looks up -> the module that installs it.
PROVIDERS: dict[str, str] = {
    "current_rank": "shardwise.comm",
    "from_local_blocks": "shardwise.comm",
    "from_local_shards": "shardwise.comm",
    "full_tensor": "shardwise.comm",
    "gather": "shardwise.comm",
    "redistribute": "shardwise.comm",
    "resolve_group": "shardwise.comm",
    "to_local": "shardwise.comm",
    "device_mesh": "shardwise.interop",
    "from_local_placements": "shardwise.interop",
    "grad_plan": "shardwise.interop",
    "mesh_offsets": "shardwise.interop",
    "placements": "shardwise.interop",
    "redistribute_placements": "shardwise.interop",
    "to_dtensor": "shardwise.interop",
    "to_shard_tensor": "shardwise.interop",
    "gather_into": "shardwise.interop",
    "local_tensor": "shardwise.interop",
    "metadata": "shardwise.interop",
    "reshard": "shardwise.interop",
    "sharding_spec": "shardwise.interop",
    "to_torch_sharded_tensor": "shardwise.interop",
    "combine_pending": "shardwise.ops",
    "dispatch": "shardwise.ops",
    "register_dispatch_handler": "shardwise.ops",
    "torch_function": "shardwise.ops",
}

_INSTALLED: dict[str, Callable[..., Any]] = {}


def provide(**functions: Callable[..., Any]) -> None:
    """Install the functions behind the methods named by the keywords."""
    unknown = sorted(set(functions) - set(PROVIDERS))
    if unknown:
        raise KeyError(f"no ShardedTensor method looks up {unknown}; known: {sorted(PROVIDERS)}")
    _INSTALLED.update(functions)


def provided(name: str) -> Callable[..., Any]:
    """The function installed for `name`."""
    try:
        return _INSTALLED[name]
    except KeyError:
        raise UsageError(
            f"ShardedTensor's {name!r} is implemented in {PROVIDERS[name]}, which has not been "
            f"imported; `import shardwise` imports it"
        ) from None
