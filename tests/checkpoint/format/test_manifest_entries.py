"""The entries of shardwise.json as Python values (`format.entries`): dtype names both
ways, and the defaults an entry built without its optional fields has."""

from __future__ import annotations

import pytest
import torch

from shardwise.checkpoint.format.entries import (
    INDEXED,
    INLINE,
    MANIFEST,
    READS,
    VERSION,
    ChunkEntry,
    IndexRef,
    ObjectEntry,
    TensorEntry,
    dtype_from_name,
    dtype_name,
)
from shardwise.errors import CorruptCheckpointError

DTYPES = [
    torch.float32,
    torch.bfloat16,
    torch.float8_e4m3fn,
    torch.complex128,
    torch.bool,
    torch.uint16,
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_dtype_names_round_trip(dtype):
    assert dtype_name(dtype) == str(dtype).removeprefix("torch.")
    assert dtype_from_name(dtype_name(dtype)) is dtype


@pytest.mark.parametrize("name", ["float33", "Tensor", "tensor", "", "__name__"])
def test_a_name_that_is_no_dtype_is_corrupt(name):
    with pytest.raises(CorruptCheckpointError) as info:
        dtype_from_name(name)
    assert str(info.value) == f"unknown dtype {name!r} in {MANIFEST}"


def test_the_version_written_is_read():
    assert VERSION == max(READS) == 5 and READS == (1, 2, 3, 4, 5)
    assert INLINE == 3  # the last version listing chunks in the manifest itself
    assert INDEXED == 4  # the first holding them in an index file


def test_entry_defaults():
    c = ChunkEntry((0,), (4,), "f", (0, 100), (64, 16), [1])
    assert (c.frame, c.transform, c.tile, c.crc_at) == (0, None, None, -1)  # crcs inline
    t = TensorEntry("float32", (4,))
    assert (t.chunks, t.requires_grad, t.section, t.transforms) == ([], False, None, [])
    assert TensorEntry("float32", (4,)).chunks is not t.chunks  # not shared between entries
    assert TensorEntry("float32", (4,)).transforms is not t.transforms
    assert IndexRef("f", [0]) == IndexRef("f", [0]) != IndexRef("f", [0, 8])
    assert ObjectEntry("f", 0, 3, 9).transform is None
