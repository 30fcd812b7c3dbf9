"""The zip structures of a `torch.save` record (`format.archive`): headers read, the end of an
archive written as readers expect."""

from __future__ import annotations

import io
import struct
import zipfile

import pytest
import torch

from shardwise.checkpoint.format.archive import (
    LOCAL_HEADER,
    STORED,
    ZIP64_LIMIT,
    ArchiveError,
    end_of_archive,
    local_header,
)


def test_no_zip_local_header_is_a_record_error():
    with pytest.raises(ArchiveError, match="bad zip local header"):
        local_header(b"PK\x05\x06" + bytes(40))


def _saved(t: torch.Tensor) -> bytes:
    buffer = io.BytesIO()
    torch.save(t, buffer)
    return buffer.getvalue()


def test_the_local_header_of_a_torch_save_record():
    data = _saved(torch.arange(4.0))
    header = local_header(data)
    assert header.method == STORED
    name = data[LOCAL_HEADER.size : LOCAL_HEADER.size + header.name_length]
    assert name == b"archive/data.pkl"
    assert header.data_offset == LOCAL_HEADER.size + header.name_length + header.extra_length
    # the next entry's header follows wherever zipfile says it does
    second = zipfile.ZipFile(io.BytesIO(data)).infolist()[1]
    assert local_header(data, second.header_offset).method == STORED


@pytest.mark.parametrize("data", [b"", b"PK\x03", bytes(40)], ids=["empty", "short", "zeros"])
def test_no_local_header_where_there_is_none(data):
    with pytest.raises(ArchiveError, match="bad zip local header"):
        local_header(data)


def test_an_empty_archive_reads_with_zipfile():
    assert zipfile.ZipFile(io.BytesIO(end_of_archive(0, 0, 0))).namelist() == []


def test_the_classic_end_record_is_capped_and_the_zip64_one_holds_the_values():
    tail = end_of_archive(70_000, 5, 1 << 33)
    zip64 = struct.unpack("<4sQ2H2I4Q", tail[:56])
    locator = struct.unpack("<4sIQI", tail[56:76])
    classic = struct.unpack("<4s4H2IH", tail[76:])
    assert zip64 == (b"PK\x06\x06", 44, 45, 45, 0, 0, 70_000, 70_000, 5, 1 << 33)
    assert locator == (b"PK\x06\x07", 0, (1 << 33) + 5, 1)
    assert classic == (b"PK\x05\x06", 0, 0, 0xFFFF, 0xFFFF, 5, ZIP64_LIMIT, 0)
    assert len(tail) == 98
