"""Tiled checksums (`format.checksums`): the tile shapes, the checksums against torch's own slicing,
boxes of whole tiles, and whole checkpoints: what a verified read costs, corruption inside
and outside what a read touches. Verified ranged reads of one chunk: io/test_box_read;
pages (format versions 1 and 2): test_checksums."""

from __future__ import annotations

import math

import crc32c
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import shardwise.checkpoint as swc
from shardwise import Block
from shardwise.checkpoint.format.checksums import (
    RUN_BYTES,
    TILE_BYTES,
    bad_tile,
    bad_tile_in_box,
    byte_view,
    checksum_payload,
    enclosing_box,
    grid_shape,
    tile_crcs,
    tile_shape,
)
from shardwise.checkpoint.format.manifest import Manifest
from shardwise.checkpoint.io.write import payload_checksums

from .tile_data import flip_byte, random_tensor


@pytest.mark.parametrize(
    "shape, dtype, tile",
    [
        ((256, 65536), torch.float32, (1, 16384)),  # 256 KiB rows: four 64 KiB tiles each
        ((64, 4096), torch.float32, (16, 4096)),  # 16 KiB rows, 16 to a 256 KiB tile
        ((100, 100), torch.float32, (100, 100)),  # 40 KB: one tile
        ((16384, 4), torch.float32, (16384, 4)),  # exactly 256 KiB: one tile
        ((65537,), torch.float32, (16384,)),  # a long row: 64 KiB tiles
        ((1 << 20,), torch.uint8, (65536,)),
        ((5, 70000), torch.uint8, (1, 65536)),  # the edge tile of each row is 4464 bytes
        ((3, 100000), torch.int16, (1, 32768)),
        ((20000,), torch.complex128, (4096,)),
        ((1000, 3, 7), torch.float64, (1000, 3, 7)),  # 168 KB: one tile
        ((10000, 3, 7), torch.float64, (1560, 3, 7)),  # 1560 = 32768 // 21 elements
        ((300, 2, 1000), torch.bfloat16, (65, 2, 1000)),  # 65 = 131072 // 2000
        ((2, 3, 40000), torch.float32, (1, 1, 16384)),  # split innermost: outer dims get 1
        ((), torch.float64, ()),  # 0-d: one tile
        ((0, 5), torch.float32, (0, 5)),  # empty: one (empty) tile
        ((1 << 20, 0), torch.float32, (1 << 20, 0)),
    ],
)
def test_tile_shape(shape, dtype, tile):
    assert tile_shape(shape, dtype.itemsize) == tile


def test_tiles_are_at_most_tile_bytes_and_rows_at_most_run_bytes():
    for shape in [(7, 300, 5000), (100000, 3), (3, 1 << 18), (1 << 20,), (9, 9, 9, 999)]:
        for itemsize in (1, 2, 4, 8, 16):
            tile = tile_shape(shape, itemsize)
            assert math.prod(tile) * itemsize <= TILE_BYTES
            assert tile[-1] * itemsize <= max(RUN_BYTES, shape[-1] * itemsize)


def _tile_views(t: torch.Tensor, tile: tuple[int, ...]) -> list[torch.Tensor]:
    """Every tile of `t`, as a view, in the grid's C order."""
    grid = grid_shape(tuple(t.shape), tile)
    out = []
    for flat in range(math.prod(grid)):
        index, rest = [], flat
        for g in reversed(grid):
            index.append(rest % g)
            rest //= g
        index.reverse()
        out.append(t[tuple(slice(i * s, (i + 1) * s) for i, s in zip(index, tile))])
    return out


def _crc_of(t: torch.Tensor) -> int:
    return crc32c.crc32c(t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())


@pytest.mark.parametrize(
    "shape, dtype",
    [
        ((256, 65536), torch.float32),
        ((5, 70000), torch.uint8),
        ((10000, 3, 7), torch.float64),
        ((300, 2, 1000), torch.bfloat16),
        ((2, 3, 40000), torch.float32),
        ((65537,), torch.float32),
        ((100, 100), torch.float32),
        ((), torch.float64),
        ((0, 5), torch.float32),
    ],
)
def test_checksums_are_crc32c_of_each_tile_in_c_order(shape, dtype):
    t = random_tensor(shape, dtype)
    tile, crcs = checksum_payload(byte_view(t), shape, dtype.itemsize)
    assert tile == tile_shape(shape, dtype.itemsize)
    assert crcs == [_crc_of(v) for v in _tile_views(t, tile)]
    assert payload_checksums(t) == (tile, crcs)
    if math.prod(tile) == math.prod(shape):  # one tile: exactly crc32c of the whole payload
        assert crcs == [crc32c.crc32c(t.numpy().tobytes())]


@pytest.mark.parametrize(
    "shape, tile",
    [
        ((5, 7), (2, 3)),  # edge tiles on both axes, not contiguous in the payload
        ((4, 6, 5), (3, 2, 5)),
        ((4, 6, 5), (1, 4, 2)),
        ((9,), (4,)),
        ((3, 4), (1, 1)),
        ((3, 4), (3, 1)),
    ],
)
def test_any_tile_shape_a_manifest_names_is_checked_the_same_way(shape, tile):
    t = random_tensor(shape, torch.int16, seed=3)
    crcs = tile_crcs(byte_view(t), shape, 2, tile)
    assert crcs == [_crc_of(v) for v in _tile_views(t, tile)]
    assert bad_tile(byte_view(t), shape, 2, tile, crcs) is None


def test_payload_checksums_refuses_a_strided_tensor():
    with pytest.raises(ValueError, match="contiguous"):
        payload_checksums(torch.zeros(4, 4).t())


def test_enclosing_box():
    assert enclosing_box((64, 65536), (1, 16384), (3, 16384), (50, 16384)) == (
        (3, 16384),
        (50, 16384),
    )
    assert enclosing_box((64, 65536), (1, 16384), (0, 1000), (64, 2000)) == ((0, 0), (64, 16384))
    assert enclosing_box((64, 65536), (1, 16384), (0, 16000), (1, 500)) == ((0, 0), (1, 32768))
    assert enclosing_box((40, 4096), (16, 4096), (10, 5), (20, 7)) == ((0, 0), (32, 4096))
    assert enclosing_box((40, 4096), (16, 4096), (10, 5), (30, 7)) == ((0, 0), (40, 4096))
    assert enclosing_box((5, 7), (2, 3), (1, 4), (1, 1)) == ((0, 3), (2, 3))
    assert enclosing_box((5, 7), (2, 3), (3, 5), (2, 2)) == ((2, 3), (3, 4))  # clamped
    assert enclosing_box((), (), (), ()) == ((), ())
    assert enclosing_box((5, 7), (2, 3), (1, 1), (0, 3)) == ((1, 1), (0, 3))  # empty: as is


@st.composite
def _chunk_box_and_tile(draw: st.DrawFn):
    ndim = draw(st.integers(1, 3))
    shape = tuple(draw(st.lists(st.integers(1, 9), min_size=ndim, max_size=ndim)))
    tile = tuple(draw(st.integers(1, s)) for s in shape)
    offsets = tuple(draw(st.integers(0, s - 1)) for s in shape)
    lengths = tuple(draw(st.integers(1, s - o)) for s, o in zip(shape, offsets))
    return shape, tile, offsets, lengths, draw(st.integers(0, 2**31 - 1))


@settings(max_examples=300, deadline=None)
@given(_chunk_box_and_tile(), st.data())
def test_a_box_verifies_and_any_flipped_byte_names_its_tile(case, data):
    shape, tile, offsets, lengths, seed = case
    t = random_tensor(shape, torch.int16, seed)
    crcs = tile_crcs(byte_view(t), shape, 2, tile)
    lo, n = enclosing_box(shape, tile, offsets, lengths)
    assert all(a <= o and o + k <= a + m for a, m, o, k in zip(lo, n, offsets, lengths))
    assert all(
        a % s == 0 and (a + m) % s == 0 or a + m == c for a, m, s, c in zip(lo, n, tile, shape)
    )
    box = t[tuple(slice(a, a + m) for a, m in zip(lo, n))].contiguous()
    assert bad_tile_in_box(byte_view(box), shape, 2, tile, crcs, lo, n) is None
    flip = data.draw(st.integers(0, box.nbytes - 1))
    raw = bytearray(byte_view(box))
    raw[flip] ^= 0x40
    bad = bad_tile_in_box(raw, shape, 2, tile, crcs, lo, n)
    element = [i for i in _unravel(flip // 2, n)]
    at = [a + i for a, i in zip(lo, element)]  # the flipped element, in the chunk
    grid = grid_shape(shape, tile)
    index = sum((i // s) * math.prod(grid[d + 1 :]) for d, (i, s) in enumerate(zip(at, tile)))
    byte = sum(i * math.prod(shape[d + 1 :]) for d, i in enumerate(at)) * 2 + flip % 2
    assert bad is not None and bad.index == index and bad.start <= byte < bad.end
    # its byte range: from the tile's first element to its last, in the payload
    tile_lo = [(i // s) * s for i, s in zip(at, tile)]
    tile_hi = [min(a + s, c) - 1 for a, s, c in zip(tile_lo, tile, shape)]
    strides = [math.prod(shape[d + 1 :]) * 2 for d in range(len(shape))]
    first = sum(i * s for i, s in zip(tile_lo, strides))
    last = sum(i * s for i, s in zip(tile_hi, strides)) + 2
    assert (bad.start, bad.end) == (first, last)


def _unravel(flat: int, shape: tuple[int, ...]) -> list[int]:
    out = []
    for s in reversed(shape):
        out.append(flat % s)
        flat //= s
    return out[::-1]


def test_a_box_that_is_not_tile_aligned_is_refused():
    with pytest.raises(ValueError, match="not tile-aligned"):
        bad_tile_in_box(bytes(8), (5, 7), 2, (2, 3), [0] * 9, (1, 0), (2, 2))


def test_the_manifest_records_tiles(wide):
    path, full = wide
    chunks = Manifest.read(path).tensors["w"].chunks  # from the index (format version 4)
    assert [(c.sizes, c.tile, len(c.crcs)) for c in chunks] == [
        ((40, 65536), (1, 16384), 160),
        ((24, 65536), (1, 16384), 96),
    ]
    assert chunks[0].crcs[5] == _crc_of(full[1, 16384:32768])


@pytest.mark.parametrize(
    "region",
    [
        Block((0, 16384), (64, 16384)),  # a column band, across both row-wise chunks
        Block((0, 16384), (64, 32768)),
        Block((30, 0), (20, 16384)),
    ],
    ids=["band", "two-bands", "rows-of-a-band"],
)
def test_read_tensor_of_a_column_band_reads_at_most_a_tenth_more(wide, region):
    path, full = wide
    assert torch.equal(swc.read_tensor(path, "w", region), full[region.slices()])
    needed = math.prod(region.sizes) * 4
    for verify in (True, False):
        ckpt = swc.open_checkpoint(path, verify=verify)
        assert torch.equal(ckpt.read("w", region), full[region.slices()])
        assert needed <= ckpt.bytes_read <= 1.1 * needed, (verify, ckpt.bytes_read, needed)


def test_a_narrow_region_costs_whole_tiles_only_when_verifying(wide):
    path, full = wide
    region = Block((0, 1000), (64, 100))  # 400 bytes a row, in a 64 KiB tile a row
    verified = swc.open_checkpoint(path)
    assert torch.equal(verified.read("w", region), full[region.slices()])
    assert verified.bytes_read == 64 * 65536
    exact = swc.open_checkpoint(path, verify=False)
    exact.read("w", region)
    assert exact.bytes_read == 64 * 400


def test_a_flipped_byte_fails_the_reads_that_cover_it_and_verify(wide, tmp_path):
    import shutil

    path, full = wide
    bad = tmp_path / "bad"
    shutil.copytree(path, bad)
    chunk = Manifest.read(bad).tensors["w"].chunks[0]
    assert chunk.payload is not None
    data = bad / chunk.file
    flip_byte(data, chunk.payload[0] + (3 * 65536 + 50000) * 4)  # row 3, tile column 3
    band = Block((0, 16384), (64, 16384))
    assert torch.equal(swc.read_tensor(bad, "w", band), full[band.slices()])  # not read
    with pytest.raises(swc.CorruptCheckpointError) as info:
        swc.read_tensor(bad, "w", Block((0, 49152), (64, 100)))
    assert "'w'" in str(info.value) and str(data) in str(info.value)
    problems = swc.verify(bad, raise_on_error=False)
    assert len(problems) == 1 and "'w'" in problems[0] and "fail their checksum" in problems[0]
    lo = chunk.payload[0] + (3 * 65536 + 49152) * 4
    assert f"bytes {lo}..{lo + 65536} " in problems[0]


def test_verify_reports_progress_over_every_payload_byte(wide):
    path, _ = wide
    seen: list[int] = []
    assert swc.verify(path, seen.append) == []
    assert sum(seen) == 64 * 65536 * 4
