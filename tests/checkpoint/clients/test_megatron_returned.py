"""Megatron-Core state dicts as `sharded_state_dict()` returns them (`clients.megatron`), in
one process and without Megatron-Core: its values are recognised by their type's module and
name, so stand-ins of those names play them. With the real package: tests/clients."""

from __future__ import annotations

import io
from typing import Any

import pytest
import torch

from shardwise import Layout, ShardedTensor
from shardwise.checkpoint.clients.megatron import (
    MEGATRON,
    load_targets,
    megatron_route,
    save_targets,
)
from shardwise.checkpoint.engine.inventory import route_named, route_of
from shardwise.errors import CorruptCheckpointError, InvalidArgumentError, ShardMismatchError

_MAPPING = "megatron.core.dist_checkpointing.mapping"


class ShardedObject:
    """Stands for Megatron's ShardedObject (an object stored under its unique key)."""

    def __init__(self, key: str, data: Any = None, replica_id: Any = 0) -> None:
        self.key, self.unique_key, self.data = key, f"{key}/shard_0", data
        self.replica_id = replica_id


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
def test_the_megatron_route_is_found_everywhere(value, holds):
    assert (route_of(value) is route_named(MEGATRON)) is holds


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


def test_an_object_stored_as_an_empty_list_is_named_not_an_index_error():
    state = _state()
    flat, finishers = load_targets(state, None, megatron=False)
    flat.update({"rng/shard_0": []})  # a crafted checkpoint's value for the key
    with pytest.raises(CorruptCheckpointError, match="ShardedObject 'rng/shard_0'.*empty list"):
        for finish in finishers:
            finish()
    assert state["rng"].data == 7  # left as it was


def test_a_path_that_is_also_a_sharded_key_is_refused():
    w = _state()["model"]["w"]
    with pytest.raises(InvalidArgumentError) as info:
        save_targets({"model": {"w": w}, "model.w": 1}, None, megatron=False)
    assert str(info.value) == (
        "key 'model.w' is both a non-sharded value's path and a sharded (Megatron or "
        "shardwise) key; rename one"
    )


@pytest.mark.parametrize("megatron", [False, True], ids=["plain", "megatron"])
def test_an_object_no_rank_holds_as_main_replica_is_refused(megatron):
    # Megatron saves main replicas only: without one, the key would silently be left out
    state = {
        "rng": ShardedObject("rng", 7, replica_id=1),
        "opt": ShardedObject("opt", 1, replica_id=(0, 2)),
        "kept": ShardedObject("kept", 2, replica_id=(0, 0)),
    }
    with pytest.raises(ShardMismatchError) as info:
        save_targets(state, None, megatron=megatron)
    assert str(info.value) == (
        "Megatron ShardedObjects 'opt/shard_0' (held by rank 0, none as replica_id 0); "
        "'rng/shard_0' (held by rank 0, none as replica_id 0): no rank holds the main "
        "replica, and only main replicas are saved; give one rank's copy replica_id 0 "
        "(nothing was saved)"
    )


def test_only_main_replicas_of_an_object_are_saved():
    state = {"a": {"rng": ShardedObject("rng", 7, replica_id=1)}, "b": ShardedObject("rng", 8)}
    flat = save_targets(state, None, megatron=False)
    assert list(flat) == ["rng/shard_0"]
    assert torch.load(io.BytesIO(flat["rng/shard_0"].data), weights_only=True) == [8]
