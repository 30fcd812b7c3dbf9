"""Tiled checksums (`tiles`) and verified ranged reads (`chunk_read`): the tile shapes,
the checksums against torch's own slicing, the bytes a verified read reads, corruption
inside and outside what a read touches, and checkpoints of format versions 1 and 2."""

from __future__ import annotations

import json
import math
import os
import warnings
from pathlib import Path

import crc32c
import pytest
import torch
import torch.distributed.checkpoint as dcp
from hypothesis import given, settings
from hypothesis import strategies as st

import shardwise.checkpoint as swc
from shardwise import Block, Layout, ShardedTensor
from shardwise.checkpoint.format.checksums import byte_view, pages_of
from shardwise.checkpoint.format.manifest import Manifest, StoredChunk
from shardwise.checkpoint.format.record_read import RecordLayout
from shardwise.checkpoint.format.tiles import (
    RUN_BYTES,
    TILE_BYTES,
    bad_tile,
    bad_tile_in_box,
    checksum_payload,
    enclosing_box,
    grid_shape,
    tile_crcs,
    tile_shape,
)
from shardwise.checkpoint.io.box_read import check_whole, first_bad, read_box
from shardwise.checkpoint.io.chunk_writer import DataFile, payload_checksums
from shardwise.storage.local import LocalFile

# -- tile shapes ---------------------------------------------------------------------------


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


# -- checksums against torch's slicing ------------------------------------------------------


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


def _random(shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:  # values, not random bytes: no NaN, so torch.equal compares
        return torch.randn(shape, generator=g).to(dtype)
    raw = torch.randint(
        0, 256, (math.prod(shape) * dtype.itemsize,), dtype=torch.uint8, generator=g
    )
    return raw.view(dtype).reshape(shape)


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
    t = _random(shape, dtype)
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
    t = _random(shape, torch.int16, seed=3)
    crcs = tile_crcs(byte_view(t), shape, 2, tile)
    assert crcs == [_crc_of(v) for v in _tile_views(t, tile)]
    assert bad_tile(byte_view(t), shape, 2, tile, crcs) is None


def test_payload_checksums_refuses_a_strided_tensor():
    with pytest.raises(ValueError, match="contiguous"):
        payload_checksums(torch.zeros(4, 4).t())


# -- boxes ------------------------------------------------------------------------------------


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
    t = _random(shape, torch.int16, seed)
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


# -- read_box on a real file -----------------------------------------------------------------

WIDE = (64, 65536)  # float32, 256 KiB rows: tiles (1, 16384), 64 KiB each


def _written(tmp_path: Path, t: torch.Tensor) -> tuple[Path, StoredChunk, RecordLayout]:
    with DataFile(tmp_path, "data.distcp") as f:
        f.write_object(b"x" * 100)  # the chunk does not start the file
        w = f.write_tensor(t)
    assert w.tile == tile_shape(tuple(t.shape), t.element_size())
    chunk = w.chunk_entry((0,) * t.ndim, tuple(t.shape))
    stored = StoredChunk.of(chunk, str(t.dtype).removeprefix("torch."))
    assert w.payload is not None
    layout = RecordLayout(w.payload[0], w.payload[1], t.dtype, tuple(t.shape), True)
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
    t = _random(WIDE, torch.float32, seed=1)
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
    t = _random((64, 1000), torch.float32, seed=2)
    path, stored, layout = _written(tmp_path, t)
    strided = torch.empty(1000, 64).t()
    got, n = _read(path, stored, layout, (0, 0), (64, 1000), dest=strided)
    assert got is not strided and torch.equal(got, t) and n == t.nbytes
    wide = torch.empty((64, 1000), dtype=torch.float64)
    got, _ = _read(path, stored, layout, (0, 0), (64, 1000), dest=wide)
    assert got is not wide and got.dtype == torch.float32 and torch.equal(got, t)


def _flip(path: Path, at: int) -> None:
    with open(path, "r+b") as f:
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0xFF]))


def test_corruption_inside_a_read_tile_is_caught_and_outside_is_not_read(tmp_path):
    t = _random(WIDE, torch.float32, seed=4)
    path, stored, layout = _written(tmp_path, t)
    start = layout.payload_offset
    band = ((0, 16384), (64, 16384))  # tile column 1 of every row
    # row 7, column 20000: inside the band's tiles, though outside the box asked for below
    inside = start + (7 * 65536 + 20000) * 4
    _flip(path, inside)
    with pytest.raises(swc.CorruptCheckpointError) as info:
        _read(path, stored, layout, (0, 16384), (64, 1000))
    tile_lo = start + (7 * 65536 + 16384) * 4
    message = str(info.value)
    assert "'w'" in message and str(path) in message
    assert f"bytes {tile_lo}..{tile_lo + 65536} " in message and "fail their checksum" in message
    got, _ = _read(path, stored, layout, (0, 16384), (64, 1000), verify=False)  # opted out
    _flip(path, inside)  # restored
    outside = start + (7 * 65536 + 40000) * 4  # tile column 2: no read of the band touches it
    _flip(path, outside)
    got, n = _read(path, stored, layout, *band)
    assert torch.equal(got, t[:, 16384:32768]) and n == 64 * 65536
    with pytest.raises(swc.CorruptCheckpointError, match="fail their checksum"):
        _read(path, stored, layout, (0, 0), WIDE)  # a read that covers it


def test_a_short_read_names_the_tensor_file_and_range(tmp_path):
    t = _random((8, 65536), torch.float32, seed=5)
    path, stored, layout = _written(tmp_path, t)
    os.truncate(path, layout.payload_offset + 3 * 262144 + 10)
    with pytest.raises(swc.CorruptCheckpointError) as info:
        _read(path, stored, layout, (2, 0), (4, 16384))
    message = str(info.value)
    assert "'w'" in message and str(path) in message and "truncated" in message
    assert f"bytes {layout.payload_offset + 3 * 262144}.." in message


def test_check_whole_verifies_a_payload_in_memory(tmp_path):
    t = _random(WIDE, torch.float32, seed=6)
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


# -- whole checkpoints ------------------------------------------------------------------------


def _save(path: Path, state: dict) -> None:
    with warnings.catch_warnings():  # "assuming the intent is to save in a single process"
        warnings.simplefilter("ignore", UserWarning)
        swc.save(state, path)


@pytest.fixture(scope="module")
def wide(tmp_path_factory) -> tuple[Path, torch.Tensor]:
    path = tmp_path_factory.mktemp("tiles") / "wide"
    full = _random(WIDE, torch.float32, seed=7)
    layout = Layout(
        WIDE, {0: [Block((0, 0), (40, 65536)), Block((40, 0), (24, 65536))]}
    )  # row-wise
    _save(path, {"w": ShardedTensor.from_layout(layout, [full[:40].clone(), full[40:].clone()])})
    return path, full


def test_the_manifest_records_tiles(wide):
    path, full = wide
    chunks = json.loads((path / "shardwise.json").read_text())["tensors"]["w"]["chunks"]
    assert [(c["sizes"], c["tile"], len(c["tiles"])) for c in chunks] == [
        ([40, 65536], [1, 16384], 160),
        ([24, 65536], [1, 16384], 96),
    ]
    assert chunks[0]["tiles"][5] == _crc_of(full[1, 16384:32768])


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
    chunk = json.loads((bad / "shardwise.json").read_text())["tensors"]["w"]["chunks"][0]
    data = bad / chunk["file"]
    _flip(data, chunk["payload"][0] + (3 * 65536 + 50000) * 4)  # row 3, tile column 3
    band = Block((0, 16384), (64, 16384))
    assert torch.equal(swc.read_tensor(bad, "w", band), full[band.slices()])  # not read
    with pytest.raises(swc.CorruptCheckpointError) as info:
        swc.read_tensor(bad, "w", Block((0, 49152), (64, 100)))
    assert "'w'" in str(info.value) and str(data) in str(info.value)
    problems = swc.verify(bad, raise_on_error=False)
    assert len(problems) == 1 and "'w'" in problems[0] and "fail their checksum" in problems[0]
    lo = chunk["payload"][0] + (3 * 65536 + 49152) * 4
    assert f"bytes {lo}..{lo + 65536} " in problems[0]


def test_verify_reports_progress_over_every_payload_byte(wide):
    path, _ = wide
    seen: list[int] = []
    assert swc.verify(path, seen.append) == []
    assert sum(seen) == 64 * 65536 * 4


# -- format versions 1 and 2: pages --------------------------------------------------------


def _as_version(path: Path, version: int) -> None:
    """Rewrite a checkpoint's manifest in format `version` (pages of 1 MiB), as an older
    shardwise wrote it: the data files are the same."""
    m = Manifest.read(path)
    m.version = version
    for t in m.tensors.values():
        for c in t.chunks:
            assert c.payload is not None
            with open(path / c.file, "rb") as f:
                f.seek(c.payload[0])
                c.crcs, c.tile = pages_of(memoryview(f.read(c.payload[1]))), None
    (path / "shardwise.json").write_text(m.to_json())


@pytest.mark.parametrize("version", [1, 2])
def test_checkpoints_of_version_1_and_2_still_load_and_verify(wide, tmp_path, version):
    import shutil

    path, full = wide
    old = tmp_path / "old"
    shutil.copytree(path, old)
    _as_version(old, version)
    doc = json.loads((old / "shardwise.json").read_text())
    chunk = doc["tensors"]["w"]["chunks"][0]
    assert (doc["version"], doc["page_size"], len(chunk["pages"])) == (version, 1 << 20, 10)
    assert "tile" not in chunk and "tiles" not in chunk
    assert swc.verify(old) == []
    band = Block((0, 16384), (64, 16384))
    ckpt = swc.open_checkpoint(old)
    assert torch.equal(ckpt.read("w", band), full[band.slices()])
    assert ckpt.bytes_read == full.nbytes  # 1 MiB pages: a column band reads every page
    loaded = {"w": torch.zeros(WIDE)}
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process"
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(loaded, storage_reader=swc.Reader(old))
    assert torch.equal(loaded["w"], full)
    loaded = {"w": torch.zeros(WIDE)}
    swc.load(loaded, old)
    assert torch.equal(loaded["w"], full)
    _flip(old / chunk["file"], chunk["payload"][0] + (1 << 20) + 5)  # page 1
    problems = swc.verify(old, raise_on_error=False)
    lo = chunk["payload"][0] + (1 << 20)
    assert len(problems) == 1 and f"bytes {lo}..{lo + (1 << 20)} " in problems[0]
    with pytest.raises(swc.CorruptCheckpointError, match=rf"'w': bytes {lo}\.\.{lo + (1 << 20)} "):
        swc.read_tensor(old, "w", Block((4, 0), (1, 10)))  # row 4 lies in page 1
    assert torch.equal(swc.read_tensor(old, "w", Block((0, 0), (1, 10))), full[:1, :10])
