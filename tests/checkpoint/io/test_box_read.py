"""Verified ranged reads of one stored chunk (`io.chunks`): the bytes a read reads, the
target it fills, corruption inside and outside the tiles it touches, short reads, and a
whole payload checked in memory."""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest
import torch

import shardwise.checkpoint as swc
from shardwise.checkpoint.format.archive import ArchiveLayout
from shardwise.checkpoint.format.checksums import byte_view, enclosing_box, tile_shape
from shardwise.checkpoint.format.manifest import StoredChunk
from shardwise.checkpoint.io.chunks import check_whole, first_bad, read_box
from shardwise.checkpoint.io.write import DataFile
from shardwise.storage.local import LocalFile

from ..format.tile_data import WIDE, flip_byte, random_tensor


def _written(tmp_path: Path, t: torch.Tensor) -> tuple[Path, StoredChunk, ArchiveLayout]:
    with DataFile(tmp_path, "data.distcp") as f:
        f.write_object(b"x" * 100)  # the chunk does not start the file
        w = f.write_tensor(t)
    assert w.tile == tile_shape(tuple(t.shape), t.element_size())
    chunk = w.chunk_entry((0,) * t.ndim, tuple(t.shape))
    stored = StoredChunk.of(chunk, str(t.dtype).removeprefix("torch."))
    assert w.payload is not None
    layout = ArchiveLayout(w.payload[0], w.payload[1], t.dtype, tuple(t.shape), True)
    return tmp_path / "data.distcp", stored, layout


def _read(path, stored, layout, offsets, lengths, verify=True, dest=None):
    dest = torch.empty(lengths, dtype=layout.dtype) if dest is None else dest
    f = LocalFile(path)
    try:
        return read_box(f, str(path), "w", stored, layout, offsets, lengths, dest, verify)
    finally:
        f.close()


@pytest.mark.parametrize(
    "offsets, lengths, verified",
    [
        ((0, 16384), (64, 16384), 64 * 65536),  # a tile-aligned column band: exactly it
        ((10, 16384), (30, 32768), 30 * 131072),
        ((0, 16000), (64, 1000), 64 * 2 * 65536),  # across a tile border: two tiles a row
        ((5, 100), (1, 10), 65536),  # one tile
        ((0, 0), WIDE, 64 * 262144),  # the whole chunk, straight into the target
    ],
)
def test_a_verified_read_reads_the_tiles_that_cover_the_box(tmp_path, offsets, lengths, verified):
    t = random_tensor(WIDE, torch.float32, seed=1)
    path, stored, layout = _written(tmp_path, t)
    expected = t[tuple(slice(o, o + n) for o, n in zip(offsets, lengths))]
    dest = torch.empty(lengths)
    got, n = _read(path, stored, layout, offsets, lengths, dest=dest)
    assert torch.equal(got, expected) and n == verified
    assert (got is dest) == (
        enclosing_box(WIDE, (1, 16384), offsets, lengths) == (offsets, lengths)
    )
    got, n = _read(path, stored, layout, offsets, lengths, verify=False)
    assert torch.equal(got, expected) and n == math.prod(lengths) * 4  # exactly the runs


def test_a_read_into_a_strided_or_other_dtype_target_returns_a_tensor_to_copy(tmp_path):
    t = random_tensor((64, 1000), torch.float32, seed=2)
    path, stored, layout = _written(tmp_path, t)
    strided = torch.empty(1000, 64).t()
    got, n = _read(path, stored, layout, (0, 0), (64, 1000), dest=strided)
    assert got is not strided and torch.equal(got, t) and n == t.nbytes
    wide = torch.empty((64, 1000), dtype=torch.float64)
    got, _ = _read(path, stored, layout, (0, 0), (64, 1000), dest=wide)
    assert got is not wide and got.dtype == torch.float32 and torch.equal(got, t)


def test_corruption_inside_a_read_tile_is_caught_and_outside_is_not_read(tmp_path):
    t = random_tensor(WIDE, torch.float32, seed=4)
    path, stored, layout = _written(tmp_path, t)
    start = layout.payload_offset
    band = ((0, 16384), (64, 16384))  # tile column 1 of every row
    # row 7, column 20000: inside the band's tiles, though outside the box asked for below
    inside = start + (7 * 65536 + 20000) * 4
    flip_byte(path, inside)
    with pytest.raises(swc.CorruptCheckpointError) as info:
        _read(path, stored, layout, (0, 16384), (64, 1000))
    tile_lo = start + (7 * 65536 + 16384) * 4
    message = str(info.value)
    assert "'w'" in message and str(path) in message
    assert f"bytes {tile_lo}..{tile_lo + 65536} " in message and "fail their checksum" in message
    got, _ = _read(path, stored, layout, (0, 16384), (64, 1000), verify=False)  # opted out
    flip_byte(path, inside)  # restored
    outside = start + (7 * 65536 + 40000) * 4  # tile column 2: no read of the band touches it
    flip_byte(path, outside)
    got, n = _read(path, stored, layout, *band)
    assert torch.equal(got, t[:, 16384:32768]) and n == 64 * 65536
    with pytest.raises(swc.CorruptCheckpointError, match="fail their checksum"):
        _read(path, stored, layout, (0, 0), WIDE)  # a read that covers it


def test_a_short_read_names_the_tensor_file_and_range(tmp_path):
    t = random_tensor((8, 65536), torch.float32, seed=5)
    path, stored, layout = _written(tmp_path, t)
    os.truncate(path, layout.payload_offset + 3 * 262144 + 10)
    with pytest.raises(swc.CorruptCheckpointError) as info:
        _read(path, stored, layout, (2, 0), (4, 16384))
    message = str(info.value)
    assert "'w'" in message and str(path) in message and "truncated" in message
    assert f"bytes {layout.payload_offset + 3 * 262144}.." in message


def test_check_whole_verifies_a_payload_in_memory(tmp_path):
    t = random_tensor(WIDE, torch.float32, seed=6)
    _, stored, _ = _written(tmp_path, t)
    payload = bytearray(byte_view(t))
    check_whole(payload, stored, tmp_path / "data.distcp", "w")
    assert first_bad(payload, stored) is None
    payload[5 * 262144 + 3 * 65536 + 1] ^= 1  # row 5, tile column 3
    assert first_bad(payload, stored) == (5 * 262144 + 3 * 65536, 5 * 262144 + 4 * 65536)
    with pytest.raises(swc.CorruptCheckpointError, match=r"'w': bytes \d+\.\.\d+ of .*data.distcp"):
        check_whole(payload, stored, tmp_path / "data.distcp", "w")
    with pytest.raises(swc.CorruptCheckpointError, match="truncated"):
        check_whole(payload[:-1], stored, tmp_path / "data.distcp", "w")
