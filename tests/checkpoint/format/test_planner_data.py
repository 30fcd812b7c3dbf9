"""DCP's `format.entries` in the manifest (`format.entries`): plain JSON where it is, else a
pickle read with the safe unpickler; the manifest's own copy, never `.metadata`'s."""

from __future__ import annotations

import base64
import json
import os
import pickle
import warnings
from collections import OrderedDict

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultSavePlanner

import shardwise.checkpoint as swc
from shardwise.checkpoint.format.entries import (
    FieldError,
    encode_planner_data,
    pickled,
    unpickled,
    untag,
)
from shardwise.checkpoint.format.manifest import Manifest

warnings.filterwarnings("ignore", message="torch.distributed is disabled")


def test_planner_data_that_is_not_plain_json_is_a_field_error_and_gets_pickled():
    with pytest.raises(FieldError, match="planner data of type set is not plain JSON"):
        encode_planner_data({"a": {1, 2}})
    data, pickle_text = pickled({"a": {1, 2}})
    assert data is None and unpickled(data, pickle_text) == {"a": {1, 2}}
    assert pickled({"a": (1, [2])}) == ({"a": (1, [2])}, None)  # kept decoded


def test_planner_data_that_is_not_json_does_not_depend_on_metadata(tmp_path):
    class Planner(DefaultSavePlanner):
        def create_global_plan(self, plans):
            plans, metadata = super().create_global_plan(plans)
            metadata.planner_data = {1: ("a", 2), "od": OrderedDict(x=1)}  # int key, OrderedDict
            return plans, metadata

    folder = tmp_path / "ckpt"
    dcp.save({"x": torch.ones(2)}, storage_writer=swc.Writer(folder), planner=Planner())
    data = swc.Reader(folder).read_metadata().planner_data
    assert data == {1: ("a", 2), "od": OrderedDict(x=1)} and type(data["od"]) is OrderedDict
    (folder / ".metadata").write_bytes(b"replaced by a newer save that died before its manifest")
    data = Manifest.read(folder).decoded_planner_data()  # the manifest holds its own copy
    assert data == {1: ("a", 2), "od": OrderedDict(x=1)} and type(data["od"]) is OrderedDict
    # a reader follows `.metadata` (what stock sees) once it differs: unreadable here
    with pytest.raises(swc.CorruptCheckpointError, match="does not match the manifest"):
        swc.Reader(folder).read_metadata()


def test_tuples_come_back_as_tuples_at_any_depth():
    value = {"model.w": ("model", ("w", 1)), "list": [("a",), [1.5, None, True]]}
    encoded = encode_planner_data(value)
    assert encoded == {
        "model.w": {"__tuple__": ["model", {"__tuple__": ["w", 1]}]},
        "list": [{"__tuple__": ["a"]}, [1.5, None, True]],
    }
    assert json.loads(json.dumps(encoded), object_pairs_hook=untag) == value
    assert unpickled(*pickled(value)) == value


@pytest.mark.parametrize(
    "value, kind",
    [
        (OrderedDict(a=1), "OrderedDict"),  # would come back as a dict
        ({1: 2}, "dict"),  # an int key would come back as a string
        ({"__tuple__": [1]}, "dict"),  # would come back as a tuple
        (b"x", "bytes"),
    ],
    ids=["OrderedDict", "int-key", "tuple-tag", "bytes"],
)
def test_what_json_would_change_is_pickled_instead(value, kind):
    with pytest.raises(FieldError) as info:
        encode_planner_data(value)
    assert str(info.value) == f"field planner_data: planner data of type {kind} is not plain JSON"
    data, pickle_text = pickled(value)
    assert data is None and unpickled(None, pickle_text) == value
    assert type(unpickled(None, pickle_text)) is type(value)


class _Runs:
    def __reduce__(self):
        return (os.system, ("true",))


@pytest.mark.parametrize(
    "pickle_text, reason",
    [
        (base64.b64encode(pickle.dumps(_Runs())).decode(), "refused global posix.system"),
        (base64.b64encode(b"garbage").decode(), "unreadable checkpoint metadata"),
    ],
    ids=["hostile", "damaged"],
)
def test_an_unreadable_planner_pickle_is_corrupt(pickle_text, reason):
    with pytest.raises(swc.CorruptCheckpointError) as info:
        unpickled(None, pickle_text)
    assert str(info.value).startswith(f"shardwise.json: unreadable planner data: {reason}")


def test_a_manifest_reads_its_tags_as_tuples_and_writes_them_back(tmp_path):
    """The manifest holds planner data decoded (`untag` while parsing: no tag is built)
    and encodes it as it writes: the same text again. A tag that is no list of values
    stays an object, as a value `encode_planner_data` refuses it would never write."""
    folder = tmp_path / "ckpt"
    swc.save({"model": {"w": torch.ones(2), "layers": [torch.zeros(1)]}, "step": 3}, folder)
    text = (folder / "shardwise.json").read_bytes()
    head = Manifest.from_json(text)
    assert head.planner_data == {
        "model.w": ("model", "w"),
        "model.layers.0": ("model", "layers", 0),
        "step": ("step",),
    }
    assert head.decoded_planner_data() is head.planner_data
    assert head.to_json().encode() == text
    assert untag([("__tuple__", "ab")]) == {"__tuple__": "ab"}
    assert untag([("__tuple__", [1, ("a",)])]) == (1, ("a",))
    assert untag([("__tuple__", [1]), ("x", 2)]) == {"__tuple__": [1], "x": 2}
