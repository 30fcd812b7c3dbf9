"""PhysicsNeMo's ShardTensor adapter (`physicsnemo`): registered with `shardwise.checkpoint`,
never importing PhysicsNeMo, matching only ShardTensors. With the real package:
tests/clients."""

from __future__ import annotations

import sys
import types

import pytest
import torch

import shardwise.checkpoint  # noqa: F401 - registers the built-in adapters
from shardwise import Layout, ShardedTensor
from shardwise.checkpoint.engine import inventory as adapters
from shardwise.checkpoint.engine.inventory import ValueAdapter, register_value_adapter
from shardwise.errors import InvalidArgumentError

_MODULE = "physicsnemo.domain_parallel.shard_tensor"


def _adapter() -> ValueAdapter:
    (found,) = [a for a in adapters._REGISTERED if a.name == "physicsnemo"]
    return found


def test_registered_once_as_a_converting_adapter():
    adapter = _adapter()
    assert adapter.for_save is not None and adapter.for_load is not None
    assert adapter.pieces is None
    with pytest.raises(InvalidArgumentError, match="'physicsnemo' is already registered"):
        register_value_adapter(ValueAdapter("physicsnemo", bool, id, id))


def test_importing_shardwise_does_not_import_physicsnemo():
    if _MODULE in sys.modules:
        pytest.skip("PhysicsNeMo was imported by another test of this process")
    plain = ShardedTensor.from_layout(Layout.chunked((4,), 0, 1), [torch.ones(4)], rank=0)
    for value in (torch.ones(2), plain, None, {"a": 1}):
        assert not _adapter().takes(value)
    assert _MODULE not in sys.modules


def test_it_matches_instances_of_the_loaded_shard_tensor_class(monkeypatch):
    module = types.ModuleType(_MODULE)

    class ShardTensor(torch.Tensor):
        pass

    ShardTensor.__module__, ShardTensor.__qualname__ = _MODULE, "ShardTensor"

    module.ShardTensor = ShardTensor  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, _MODULE, module)
    assert _adapter().takes(torch.ones(2).as_subclass(ShardTensor))
    assert not _adapter().takes(torch.ones(2))
