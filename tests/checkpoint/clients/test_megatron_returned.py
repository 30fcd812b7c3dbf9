"""Megatron-Core state dicts as `sharded_state_dict()` returns them (`megatron_returned`), in
one process and without Megatron-Core: its values are recognised by their type's module and
name, so stand-ins of those names play them. With the real package: tests/clients."""

from __future__ import annotations

import io
from typing import Any

import pytest
import torch

from shardwise import Layout, ShardedTensor
from shardwise.checkpoint.clients.megatron_returned import (
    holds_megatron,
    load_targets,
    megatron_route,
    save_targets,
)
from shardwise.errors import InvalidArgumentError

_MAPPING = "megatron.core.dist_checkpointing.mapping"


class ShardedObject:
    """Stands for Megatron's ShardedObject (an object stored under its unique key)."""

    def __init__(self, key: str, data: Any = None) -> None:
        self.key, self.unique_key, self.data, self.replica_id = key, f"{key}/shard_0", data, 0


class LocalNonpersistentObject:
    """Stands for Megatron's value that is never stored."""


ShardedObject.__module__ = LocalNonpersistentObject.__module__ = _MAPPING


def _state() -> dict[str, Any]:
    w = ShardedTensor.from_layout(Layout.chunked((4,), 0, 1), [torch.arange(4.0)], rank=0)
    return {
        "model": {"w": w, "step": 3},
        "rng": ShardedObject("rng", 7),
        "scratch": LocalNonpersistentObject(),
        "lr": 0.5,
    }


@pytest.mark.parametrize(
    "value, holds",
    [
        ({"a": [1, {"b": torch.ones(1)}]}, False),
        ({"a": [1, {"b": ShardedObject("x")}]}, True),
        ([(ShardedObject("x"),)], True),
        (ShardedObject("x"), True),
        (LocalNonpersistentObject(), False),
    ],
    ids=["plain", "nested-object", "in-a-tuple", "itself", "nonpersistent"],
)
def test_holds_megatron_looks_everywhere(value, holds):
    assert holds_megatron(value) is holds


def test_the_route_in_one_process():
    assert megatron_route({"a": 1}, megatron=False) is False
    assert megatron_route({"a": 1}, megatron=True) is True
    assert megatron_route(_state(), megatron=False) is True
    with pytest.raises(ValueError, match="^mine$"):  # this rank's own failure comes first
        megatron_route(_state(), megatron=False, problem=ValueError("mine"))


def test_a_plain_save_keeps_other_values_under_their_path():
    state = _state()
    flat = save_targets(state, None, megatron=False)
    assert list(flat) == ["model.w", "rng/shard_0", "model.step", "lr"]  # no "scratch"
    assert flat["model.w"] is state["model"]["w"]
    assert (flat["model.step"], flat["lr"]) == (3, 0.5)
    # a ShardedObject as Megatron stores it: torch.save of this rank's values of the key
    assert torch.load(io.BytesIO(flat["rng/shard_0"].data), weights_only=True) == [7]


def test_a_plain_load_fills_objects_and_values_after_dcp():
    state = _state()
    flat, finishers = load_targets(state, None, megatron=False)
    assert flat == {"model.w": state["model"]["w"], "rng/shard_0": None, "model.step": 3, "lr": 0.5}
    flat.update({"rng/shard_0": [8], "model.step": 4, "lr": 0.25})  # what DCP loaded
    for finish in finishers:
        finish()
    assert (state["rng"].data, state["model"]["step"], state["lr"]) == (8, 4, 0.25)


def test_a_path_that_is_also_a_sharded_key_is_refused():
    w = _state()["model"]["w"]
    with pytest.raises(InvalidArgumentError) as info:
        save_targets({"model": {"w": w}, "model.w": 1}, None, megatron=False)
    assert str(info.value) == (
        "key 'model.w' is both a non-sharded value's path and a sharded (Megatron or "
        "shardwise) key; rename one"
    )
