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
from shardwise.checkpoint.clients.megatron_format import COMMON_STATE_KEY
from shardwise.checkpoint.engine.inventory import route_named, route_of
from shardwise.errors import (
    CheckpointMismatchError,
    CorruptCheckpointError,
    InvalidArgumentError,
    ShardMismatchError,
)

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


def test_a_save_stores_other_values_in_megatrons_common_state():
    state = _state()
    flat = save_targets(state, None)
    assert list(flat) == ["model.w", "rng/shard_0", COMMON_STATE_KEY]  # no "scratch"
    assert flat["model.w"] is state["model"]["w"]
    # as Megatron stores them: torch.save of this rank's values of a ShardedObject's key,
    # and of [the common state], nested as the state dict nests it
    assert torch.load(io.BytesIO(flat["rng/shard_0"].data), weights_only=True) == [7]
    common = torch.load(io.BytesIO(flat[COMMON_STATE_KEY].data), weights_only=True)
    assert common == [{"model": {"step": 3}, "lr": 0.5}]


def test_a_load_merges_the_stored_common_state_as_megatron_does():
    state = _state()
    targets = load_targets(state, None)
    flat = targets.flat
    assert list(flat) == ["model.w", "rng/shard_0", COMMON_STATE_KEY, "model.step", "lr"]
    assert flat["model.w"] is state["model"]["w"]
    assert targets.optional == {COMMON_STATE_KEY: None, "model.step": COMMON_STATE_KEY,
                                "lr": COMMON_STATE_KEY}  # fmt: skip
    # what DCP loaded: the common state holds a key the caller did not pass
    flat.update({"rng/shard_0": [8], COMMON_STATE_KEY: [{"model": {"step": 4}, "lr": 0.25,
                                                         "iteration": 9}]})  # fmt: skip
    for finish in targets.finishers:
        finish()
    assert (state["rng"].data, state["model"]["step"], state["lr"]) == (8, 4, 0.25)
    assert state["iteration"] == 9  # added, as dist_checkpointing.load returns it
    assert state["model"]["w"] is flat["model.w"]  # sharded values are never replaced


def test_a_load_without_a_common_state_fills_values_by_path():
    state = _state()
    targets = load_targets(state, None)
    targets.flat.update({"rng/shard_0": [8], "model.step": 4, "lr": 0.25})  # a plain save's
    for finish in targets.finishers:
        finish()
    assert (state["rng"].data, state["model"]["step"], state["lr"]) == (8, 4, 0.25)


def test_a_common_state_holding_a_value_where_a_sharded_one_is_is_refused():
    state = _state()
    targets = load_targets(state, None)
    targets.flat.update({"rng/shard_0": [8], COMMON_STATE_KEY: [{"model": {"w": 1}}]})
    with pytest.raises(CheckpointMismatchError) as info:
        for finish in targets.finishers:
            finish()
    assert str(info.value) == (
        "common_state/shard_0_1.model.w: the checkpoint's common state holds a value where "
        "the state dict holds a sharded ShardedTensor"
    )


def test_an_object_stored_as_an_empty_list_is_named_not_an_index_error():
    state = _state()
    targets = load_targets(state, None)
    targets.flat.update({"rng/shard_0": []})  # a crafted checkpoint's value for the key
    with pytest.raises(CorruptCheckpointError, match="ShardedObject 'rng/shard_0'.*empty list"):
        for finish in targets.finishers:
            finish()


def test_a_path_that_is_also_a_sharded_key_is_refused():
    w = _state()["model"]["w"]
    with pytest.raises(InvalidArgumentError) as info:  # two tensors stored under one key
        save_targets({"model": {"w": w}, "model.w": w}, None)
    assert str(info.value) == "two values of the state dict have the path 'model.w'"
    # a load fills common values by path: the problem is raised on every rank by the load
    problem = load_targets({"model": {"w": w}, "model.w": 1}, None).problem
    assert isinstance(problem, InvalidArgumentError)
    assert str(problem) == (
        "key 'model.w' is both a common value's path and a sharded (Megatron or shardwise) "
        "value's path; rename one"
    )


def test_an_object_no_rank_holds_as_main_replica_is_refused():
    # Megatron saves main replicas only: without one, the key would silently be left out
    state = {
        "rng": ShardedObject("rng", 7, replica_id=1),
        "opt": ShardedObject("opt", 1, replica_id=(0, 2)),
        "kept": ShardedObject("kept", 2, replica_id=(0, 0)),
    }
    with pytest.raises(ShardMismatchError) as info:
        save_targets(state, None)
    assert str(info.value) == (
        "Megatron ShardedObjects 'opt/shard_0' (held by rank 0, none as replica_id 0); "
        "'rng/shard_0' (held by rank 0, none as replica_id 0): no rank holds the main "
        "replica, and only main replicas are saved; give one rank's copy replica_id 0 "
        "(nothing was saved)"
    )


def test_only_main_replicas_of_an_object_are_saved():
    state = {"a": {"rng": ShardedObject("rng", 7, replica_id=1)}, "b": ShardedObject("rng", 8)}
    flat = save_targets(state, None)
    assert list(flat) == ["rng/shard_0", COMMON_STATE_KEY]
    assert torch.load(io.BytesIO(flat["rng/shard_0"].data), weights_only=True) == [8]
