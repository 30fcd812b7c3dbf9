"""Module state-dict hooks for ShardedTensors held as plain module attributes.

The recommended way is `nn.Parameter(st)`: `state_dict()`, `load_state_dict()`
(same layout) and the optimizers then work with no hook. Legacy code instead
kept its sharded weights as plain attributes and registered
`torch.distributed._shard.sharded_tensor.state_dict_hook` and
`pre_load_state_dict_hook`, which only know torch's own ShardedTensor; these
two take their place, with the same signatures, for shardwise tensors.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from ..tensor import ShardedTensor

__all__ = ["pre_load_state_dict_hook", "state_dict_hook"]


def _sharded_attributes(
    module: torch.nn.Module, prefix: str
) -> Iterator[tuple[torch.nn.Module, str, str]]:
    """(submodule, attribute, state-dict key) of each ShardedTensor attribute that
    is neither a parameter nor a buffer (those `state_dict` handles itself)."""
    for name, sub in module.named_modules():
        for attr, value in vars(sub).items():
            if isinstance(value, ShardedTensor):
                key = prefix + name + ("." if name else "") + attr
                yield sub, attr, key


def state_dict_hook(
    module: torch.nn.Module, destination: dict[str, Any], prefix: str, local_metadata: Any
) -> None:
    """Add the module's ShardedTensor attributes to its `state_dict()`, as the
    legacy hook did (register with `module._register_state_dict_hook`)."""
    for sub, attr, key in _sharded_attributes(module, prefix):
        destination[key] = getattr(sub, attr)


def pre_load_state_dict_hook(
    module: torch.nn.Module,
    state_dict: dict[str, Any],
    prefix: str,
    local_metadata: Any,
    strict: bool,
    missing_keys: list[str],
    unexpected_keys: list[str],
    error_msgs: list[str],
) -> None:
    """Load the state dict's ShardedTensors into the module's ShardedTensor
    attributes (register with `module._register_load_state_dict_pre_hook(hook, True)`).

    The values are copied in place, so optimizers keep their references; a value
    in another layout is redistributed first (collective: every rank loads).
    As with the legacy hook, `load_state_dict` reports these keys as unexpected
    (they are not parameters): pass `strict=False`.
    """
    for sub, attr, key in _sharded_attributes(module, prefix):
        value = state_dict.get(key)
        if not isinstance(value, ShardedTensor):
            continue
        target = getattr(sub, attr)
        if value.layout_spec != target.layout_spec:
            value = value.redistribute(target.layout_spec)
        with torch.no_grad():
            target.copy_(value)
