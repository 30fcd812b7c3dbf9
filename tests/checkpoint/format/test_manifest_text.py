"""A manifest's text parsed compactly (`format.entries`): heads as tuples, tags as tuples,
and nothing else changed: an object shaped like a head outside "tensors" stays an
object, and a bad head among good ones is named by the tables as before."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import shardwise.checkpoint as swc
from shardwise.checkpoint.format.entries import Compact, Head
from shardwise.checkpoint.format.manifest import Manifest, seal


def _saved(tmp_path: Path) -> dict:
    folder = tmp_path / "ckpt"
    swc.save({"a": torch.ones(2, 3), "b": torch.zeros(4), "c": torch.ones(1)}, folder)
    return json.loads((folder / "shardwise.json").read_bytes())


def _sealed(doc: dict) -> bytes:
    doc["crc32c"] = 0
    return seal(json.dumps(doc, separators=(",", ":"))).encode()


def test_heads_are_parsed_as_tuples_and_given_back_as_the_objects_they_were() -> None:
    compact = Compact()
    doc = json.loads(
        '{"x": {"dtype": "float32", "shape": [2, 3], "section": [0, 1, 2, 3, 4]},'
        ' "y": {"dtype": "float32", "shape": [2, 3], "requires_grad": true,'
        ' "section": [0, 5, 2, 3, 4]}, "z": {"dtype": "float32", "shape": [[1]],'
        ' "section": [0, 0, 0, 0, 0]}}',
        object_pairs_hook=compact,
    )
    assert compact.heads == 2 and type(doc["x"]) is Head and type(doc["z"]) is dict
    assert doc["x"][1] is doc["y"][1] == (2, 3)  # equal shapes: one tuple
    assert doc["y"].as_object() == {
        "dtype": "float32",
        "shape": [2, 3],
        "requires_grad": True,
        "section": [0, 5, 2, 3, 4],
    }
    assert list(doc["x"].as_object()) == ["dtype", "shape", "section"]


def test_an_object_shaped_like_a_head_in_planner_data_stays_an_object(tmp_path: Path) -> None:
    doc = _saved(tmp_path)
    odd = {"dtype": "float32", "shape": [1], "section": [1, 2, 3, 4, 5]}
    doc["planner_data"]["a"] = odd
    text = _sealed(doc)
    head = Manifest.from_json(text)
    assert head.planner_data["a"] == odd and type(head.planner_data["a"]) is dict
    assert head.planner_data["b"] == ("b",)
    assert head.to_json().encode() == text


def test_a_bad_head_among_good_ones_is_named_as_before(tmp_path: Path) -> None:
    doc = _saved(tmp_path)
    doc["tensors"]["b"]["section"][1] = -1
    with pytest.raises(swc.CorruptCheckpointError, match=r"field tensors\['b'\]\.section"):
        Manifest.from_json(_sealed(doc))
