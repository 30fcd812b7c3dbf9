"""Locating tensor payloads inside torch.save records, and reading stock metadata safely."""

from __future__ import annotations

import io
import os
import pickle
import tempfile

import pytest
import torch
import torch.distributed.checkpoint as dcp

import shardwise as sw
import shardwise.checkpoint as swc
from shardwise.checkpoint.format.archive import _read_via_directory, read_archive_layout
from shardwise.checkpoint.format.pickles import UnsafeMetadataError, load_metadata
from shardwise.storage.local import LocalFile

TENSORS = {
    "2-d": torch.arange(10.0).reshape(2, 5),
    "transposed": torch.arange(10.0).reshape(2, 5).t(),
    "0-d": torch.tensor(3, dtype=torch.int64),
    "bf16": torch.randn(3, 4).to(torch.bfloat16),
    "bool": torch.tensor([True, False, True]),
    "view-with-offset": torch.arange(10.0)[2:5],
    "large": torch.randn(300, 300),
}


def saved_record(t: torch.Tensor, prefix: bytes):
    """(layout, payload bytes or None) that `read_archive_layout` finds in
    `torch.save(t)` written after `prefix`, checked against the zip central
    directory's answer; the payload is read only where it is C-contiguous."""
    with tempfile.TemporaryFile() as f:
        f.write(prefix)
        start = f.tell()
        torch.save(t, f)
        length = f.tell() - start
        f.flush()
        layout = read_archive_layout(LocalFile.wrap(f.fileno()), start, length)
        assert layout == _read_via_directory(LocalFile.wrap(f.fileno()), start, length)
        raw = (
            bytearray(os.pread(f.fileno(), layout.nbytes, layout.payload_offset))
            if layout.c_contiguous
            else None
        )
    return layout, raw


@pytest.mark.parametrize("name", TENSORS)
def test_record_layout_finds_the_payload(name):
    t = TENSORS[name]
    layout, raw = saved_record(t, prefix=b"prefix" * 10)
    assert layout.dtype == t.dtype and layout.shape == tuple(t.shape)
    assert layout.c_contiguous == (t.is_contiguous() and t.storage_offset() == 0)
    if layout.c_contiguous:
        assert torch.equal(torch.frombuffer(raw, dtype=torch.uint8).view(t.dtype).view(t.shape), t)


class _Boom:
    def __reduce__(self):
        return (os.system, ("echo should-not-run",))


class _Touch:
    def __reduce__(self):
        from pathlib import Path

        return (Path.touch, (Path("/tmp/shardwise-should-not-exist"),))


def test_records_that_are_not_plain_tensors_are_refused():
    with tempfile.TemporaryFile() as f:
        torch.save({"a": torch.zeros(1)}, f)
        length = f.tell()
        f.flush()
        with pytest.raises(ValueError):
            read_archive_layout(LocalFile.wrap(f.fileno()), 0, length)
    with tempfile.TemporaryFile() as f:
        torch.save(_Boom(), f)
        length = f.tell()
        f.flush()
        with pytest.raises(ValueError, match="refused global"):
            read_archive_layout(LocalFile.wrap(f.fileno()), 0, length)


def test_stock_metadata_is_admitted(tmp_path):
    dcp.save(
        {"a": torch.randn(3, 4), "b": {"n": 7}, "h": torch.zeros(2).half()}, checkpoint_id=tmp_path
    )
    with open(tmp_path / ".metadata", "rb") as f:
        md = load_metadata(f)
    assert md.state_dict_metadata["a"].size == torch.Size([3, 4])


@pytest.mark.parametrize(
    "payload",
    [pickle.dumps(_Boom()), pickle.dumps(_Touch(), protocol=4)],
    ids=["os.system", "pathlib.Path.touch"],
)
def test_hostile_metadata_is_refused(payload):
    with pytest.raises(UnsafeMetadataError, match="refused global"):
        load_metadata(io.BytesIO(payload))


def test_stock_checkpoint_with_a_strided_tensor(tmp_path):
    x = torch.arange(24.0).reshape(4, 6)
    dcp.save({"t": x.t()}, checkpoint_id=tmp_path)  # stored with its strides, not C order
    layout = sw.Layout.row_wise((6, 4), [2, 4], ranks=[0, 0])
    target = sw.ShardedTensor.zeros(layout)
    swc.load({"t": target}, tmp_path)
    assert torch.equal(target, x.t().contiguous())
