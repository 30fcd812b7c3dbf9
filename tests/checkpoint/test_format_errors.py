"""The format layer's own errors: in the tree, and still the `ValueError` their callers
catch (`Manifest.from_json`, the readers of records) to raise `CorruptCheckpointError`."""

from __future__ import annotations

import io

import pytest
import torch

import shardwise
from shardwise.checkpoint.format.field_table import FieldError, encode
from shardwise.checkpoint.format.manifest import Manifest
from shardwise.checkpoint.format.manifest_fields import STORAGE_META, VERSION
from shardwise.checkpoint.format.planner_data import encode_planner_data, pickled, unpickled
from shardwise.checkpoint.format.record_read import read_record_layout
from shardwise.checkpoint.format.zip_format import RecordError, local_header
from shardwise.storage.local import LocalFile


def _file(data: bytes, tmp_path) -> LocalFile:
    path = tmp_path / "record"
    path.write_bytes(data)
    return LocalFile(str(path))


@pytest.mark.parametrize("cls", [FieldError, RecordError])
def test_internal_errors_are_shardwise_value_errors(cls):
    assert issubclass(cls, shardwise.ShardwiseError) and issubclass(cls, ValueError)


def test_a_field_no_table_has_is_a_field_error():
    with pytest.raises(FieldError, match=r"field bogus: no manifest field has this name"):
        encode(STORAGE_META, {"bogus": 1}, VERSION)


def test_planner_data_that_is_not_plain_json_is_a_field_error_and_gets_pickled():
    with pytest.raises(FieldError, match="planner data of type set is not plain JSON"):
        encode_planner_data({"a": {1, 2}})
    data, pickle_text = pickled({"a": {1, 2}})
    assert data is None and unpickled(data, pickle_text) == {"a": {1, 2}}
    assert pickled({"a": (1, [2])}) == ({"a": {"__tuple__": [1, [2]]}}, None)


def test_a_manifest_that_is_no_json_object_is_corrupt():
    with pytest.raises(shardwise.CorruptCheckpointError, match="src: .* not a JSON object"):
        Manifest.from_json(b"[1, 2]", "src")


def test_no_zip_local_header_is_a_record_error():
    with pytest.raises(RecordError, match="bad zip local header"):
        local_header(b"PK\x05\x06" + bytes(40))


def test_a_record_that_is_not_one_tensor_is_a_record_error(tmp_path):
    buffer = io.BytesIO()
    torch.save({"a": torch.zeros(2), "b": torch.ones(2)}, buffer)
    data = buffer.getvalue()
    with pytest.raises(RecordError, match="something other than a single tensor"):
        read_record_layout(_file(data, tmp_path), 0, len(data))
    with pytest.raises(RecordError, match="not a readable tensor record"):
        read_record_layout(_file(b"garbage" * 20, tmp_path), 0, 140)
