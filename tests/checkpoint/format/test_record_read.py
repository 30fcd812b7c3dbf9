"""Reading where a tensor's bytes sit in a `torch.save` record (`format.archive`), without
loading it; what is not one plain tensor is a `ArchiveError`. More record cases: test_records."""

from __future__ import annotations

import io

import pytest
import torch

from shardwise.checkpoint.format.archive import ArchiveError, read_archive_layout
from shardwise.storage.local import LocalFile


def _file(data: bytes, tmp_path) -> LocalFile:
    path = tmp_path / "record"
    path.write_bytes(data)
    return LocalFile(str(path))


def test_a_record_that_is_not_one_tensor_is_a_record_error(tmp_path):
    buffer = io.BytesIO()
    torch.save({"a": torch.zeros(2), "b": torch.ones(2)}, buffer)
    data = buffer.getvalue()
    with pytest.raises(ArchiveError, match="something other than a single tensor"):
        read_archive_layout(_file(data, tmp_path), 0, len(data))
    with pytest.raises(ArchiveError, match="not a readable tensor record"):
        read_archive_layout(_file(b"garbage" * 20, tmp_path), 0, 140)


@pytest.mark.parametrize(
    "t",
    [
        torch.arange(12.0).reshape(3, 4),
        torch.tensor(2.5, dtype=torch.float64),
        torch.arange(6, dtype=torch.int16).to(torch.bfloat16),
        torch.tensor([1.0, -1.0]).to(torch.float8_e4m3fn),  # an UntypedStorage record (v3)
    ],
    ids=["float32", "0-d", "bfloat16", "float8"],
)
def test_the_payload_of_a_record_inside_a_file(tmp_path, t):
    buffer = io.BytesIO()
    torch.save(t, buffer)
    record = buffer.getvalue()
    path = tmp_path / "data"
    path.write_bytes(b"x" * 100 + record)  # the record does not start the file
    f = LocalFile(str(path))
    try:
        layout = read_archive_layout(f, 100, len(record))
    finally:
        f.close()
    assert (layout.dtype, layout.shape, layout.c_contiguous) == (t.dtype, tuple(t.shape), True)
    assert layout.payload_length == layout.nbytes == t.nbytes
    start = layout.payload_offset
    stored = path.read_bytes()[start : start + layout.payload_length]
    assert stored == t.reshape(-1).view(torch.uint8).numpy().tobytes()


def test_a_strided_record_says_its_payload_is_not_in_c_order(tmp_path):
    t = torch.arange(12, dtype=torch.int16).reshape(3, 4).t()  # a transposed view, saved as is
    buffer = io.BytesIO()
    torch.save(t, buffer)
    layout = read_archive_layout(_file(buffer.getvalue(), tmp_path), 0, len(buffer.getvalue()))
    assert (layout.shape, layout.dtype, layout.c_contiguous) == ((4, 3), torch.int16, False)
