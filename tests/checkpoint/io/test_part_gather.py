"""Parts of many small chunks gathered as arrays (`format.table`, `io.chunks`):
the values of every dtype and layout bit for bit, the bytes read, damage refused."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import shardwise.checkpoint as swc
from shardwise import Block, Layout, ShardedTensor
from shardwise.checkpoint.format.manifest import Manifest
from shardwise.checkpoint.io import chunks as part_gather
from shardwise.checkpoint.io import chunks as word_gather
from shardwise.checkpoint.io.chunks import GatherRead

ROWS = 40  # in 20 chunks of 2 rows: more than a section decodes as lists


def _full(dtype: torch.dtype, shape: tuple[int, ...] = (ROWS, 6)) -> torch.Tensor:
    n = torch.arange(1, 1 + torch.Size(shape).numel()).reshape(shape)
    if dtype == torch.bool:
        return n % 3 == 0
    if dtype.is_complex:
        return torch.complex(n.double(), -n.double()).to(dtype)
    if dtype in (torch.uint8, torch.float8_e4m3fn):
        return (n % 200).to(torch.float32).to(dtype)
    return n.to(dtype)


def _on_rank0(layout: Layout) -> Layout:
    """Every block of `layout` held by rank 0 (one process saves or loads them all)."""
    blocks = [b for r in range(layout.world_size) for b in layout.blocks_of(r)]
    return Layout(layout.global_shape, {0: blocks})


def _save(tmp_path, full: torch.Tensor, chunk_rows: int = 2) -> str:
    path = str(tmp_path / "ck")
    n = full.shape[0] // chunk_rows
    layout = _on_rank0(Layout.row_wise(tuple(full.shape), [chunk_rows] * n))
    shards = [full[b.offsets[0] : b.offsets[0] + b.sizes[0]] for b in layout.blocks_of(0)]
    swc.save({"w": ShardedTensor.from_layout(layout, shards)}, path)
    return path


def _targets(layout: Layout, dtype: torch.dtype) -> ShardedTensor:
    blocks = _on_rank0(layout).blocks_of(0)
    fill = torch.zeros((), dtype=dtype) if dtype == torch.bool else torch.full((), 7).to(dtype)
    shards = [fill.expand(b.sizes).clone() for b in blocks]
    return ShardedTensor.from_layout(_on_rank0(layout), shards)


def _exact(target: ShardedTensor, full: torch.Tensor) -> None:
    for b, s in zip(target.local_blocks, target.local_shards(), strict=True):
        box = tuple(slice(o, o + n) for o, n in zip(b.offsets, b.sizes))
        assert torch.equal(s.view(torch.uint8), full[box].contiguous().view(torch.uint8)), b


@pytest.fixture
def gathered(monkeypatch) -> list[GatherRead]:
    """Every `GatherRead` the loads hand the executor."""
    seen: list[GatherRead] = []
    windows = part_gather.windows

    def spy(reads, *args):
        seen.extend(reads)
        return windows(reads, *args)

    monkeypatch.setattr("shardwise.checkpoint.io.read.windows", spy)
    return seen


DTYPES = [
    torch.float32,
    torch.bfloat16,
    torch.float64,
    torch.complex128,
    torch.complex64,
    torch.int16,
    torch.uint8,
    torch.bool,
    torch.float8_e4m3fn,
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_uneven_column_bands_of_row_chunks_load_bit_for_bit(tmp_path, gathered, dtype):
    full = _full(dtype)
    path = _save(tmp_path, full)
    target = _targets(Layout.column_wise((ROWS, 6), [2, 1, 3]), dtype)
    swc.load({"w": target}, path)
    _exact(target, full)
    assert [g.shape for g in gathered] == [(ROWS, 2), (ROWS, 1), (ROWS, 3)]
    assert [len(g.boxes.crc) for g in gathered] == [20, 20, 20]


def test_pieces_of_three_dimensions_cut_in_two(tmp_path, gathered):
    full = _full(torch.float32, (ROWS, 3, 5))
    path = _save(tmp_path, full)
    grid = Layout.grid((ROWS, 3, 5), (3, 2, 2))
    target = _targets(grid, torch.float32)
    swc.load({"w": target}, path)
    _exact(target, full)
    assert len(gathered) == 12
    assert sum(len(g.boxes.crc) for g in gathered) == 20 * 2 * 2  # each band of rows once


def test_chunks_of_a_grid_cut_in_two_dimensions_cover_each_piece(tmp_path, gathered):
    """A piece whose parts are cut along rows and columns: checked by `check_coverage`."""
    full = _full(torch.float32, (20, 8))
    path = str(tmp_path / "ck")
    layout = _on_rank0(Layout.grid((20, 8), (5, 4)))
    shards = [
        full[b.offsets[0] : b.offsets[0] + b.sizes[0], b.offsets[1] : b.offsets[1] + b.sizes[1]]
        for b in layout.blocks_of(0)
    ]
    swc.save({"w": ShardedTensor.from_layout(layout, [s.contiguous() for s in shards])}, path)
    target = _targets(Layout.row_wise((20, 8), [7, 13]), torch.float32)
    swc.load({"w": target}, path)
    _exact(target, full)
    assert [len(g.boxes.crc) for g in gathered] == [8, 16]


@pytest.mark.parametrize("verify", [True, False])
@pytest.mark.parametrize(
    ("window", "batch", "small"), [(1, 7, 4096), (64, 1, 4096), (1 << 20, 1 << 18, 0)]
)
def test_windows_batches_and_box_copies_give_the_same_values(
    tmp_path, monkeypatch, gathered, window, batch, small, verify
):
    monkeypatch.setattr(part_gather, "WINDOW", window)
    monkeypatch.setattr(word_gather, "BATCH", batch)
    monkeypatch.setattr(word_gather, "SMALL", small)
    full = _full(torch.bfloat16, (ROWS, 3, 5))
    path = _save(tmp_path, full)
    target = _targets(Layout.grid((ROWS, 3, 5), (2, 1, 2)), torch.bfloat16)
    swc.load({"w": target}, path, verify=verify)
    _exact(target, full)
    assert len(gathered) == 4


@pytest.mark.parametrize("verify", [True, False])
def test_verifying_each_chunk_is_read_whole_else_its_parts_first_to_last(
    tmp_path, gathered, verify
):
    """Columns 1-4 of every 2 x 6 float32 chunk: verifying, whole chunks (one checksum
    tile each); not verifying, from the first part's byte 4 to the last's byte 44, as
    one ranged read (the gaps between them, frames and all, are under a page)."""
    full = _full(torch.float32)
    path = _save(tmp_path, full)
    chunks = Manifest.read(path).tensors["w"].chunks
    assert len({c.file for c in chunks}) == 1 and all(c.payload for c in chunks)
    first = min(c.payload[0] for c in chunks)  # type: ignore[index]
    last = max(c.payload[0] + c.payload[1] for c in chunks)  # type: ignore[index]
    band = Layout((ROWS, 6), {0: [Block((0, 1), (ROWS, 4))]}, allow_holes=True)
    target = ShardedTensor.from_layout(band, [torch.full((ROWS, 4), 7.0)])
    reader = swc.load({"w": target}, path, verify=verify)
    _exact(target, full)
    assert reader.bytes_read == (last - first if verify else last - 4 - (first + 4))
    assert [len(g.boxes.crc) for g in gathered] == [20]


def test_parts_whose_runs_lie_a_page_apart_are_read_run_by_run(tmp_path, gathered):
    """Not verifying, a column of 8 KiB rows reads its runs, not the rows between."""
    full = _full(torch.float32, (ROWS, 2048))
    path = _save(tmp_path, full)
    band = Layout((ROWS, 2048), {0: [Block((0, 5), (ROWS, 1))]}, allow_holes=True)
    target = ShardedTensor.from_layout(band, [torch.zeros((ROWS, 1))])
    reader = swc.load({"w": target}, path, verify=False)
    _exact(target, full)
    assert gathered == [] and reader.bytes_read == ROWS * 4


def test_targets_the_gather_cannot_view_take_the_other_path(tmp_path, gathered):
    full = _full(torch.float32)
    path = _save(tmp_path, full)
    target = _targets(Layout.column_wise((ROWS, 6), [3, 3]), torch.float64)
    swc.load({"w": target}, path, cast_dtype=True)
    _exact(target, full.double())
    assert gathered == []


def test_a_damaged_chunk_is_refused_by_name_and_its_rows_never_land(tmp_path, gathered):
    full = _full(torch.float32)
    path = _save(tmp_path, full)
    chunks = Manifest.read(path).tensors["w"].chunks
    bad = chunks[7]
    assert bad.payload is not None
    data = tmp_path / "ck" / bad.file
    raw = bytearray(data.read_bytes())
    raw[bad.payload[0] + 3] ^= 1
    data.write_bytes(bytes(raw))
    target = _refused_by_name(path, bad, data)
    row = bad.offsets[0]
    assert all(
        torch.equal(s[row : row + 2], torch.full((2, 3), 7.0)) for s in target.local_shards()
    )
    assert len(gathered) == 2


def _refused_by_name(path: Path, bad: Any, data: Path) -> Any:
    """Loading 'w' by columns fails on chunk `bad` (in `data`), named with its payload's
    byte range; the targets, as the failed load left them."""
    target = _targets(Layout.column_wise((ROWS, 6), [3, 3]), torch.float32)
    with pytest.raises(swc.CorruptCheckpointError) as info:
        swc.load({"w": target}, path)
    lo, hi = bad.payload[0], bad.payload[0] + bad.payload[1]
    assert str(info.value) == f"'w': bytes {lo}..{hi} of {data} fail their checksum"
    return target


def test_a_damaged_checksum_kept_by_its_writer_is_refused_by_name(tmp_path, gathered):
    """Format 5: the rows' checksums are in the data file's block (frame, tile), fetched
    for the rows gathered; a damaged one fails its chunk as damaged bytes would."""
    full = _full(torch.float32)
    path = _save(tmp_path, full)
    bad = Manifest.read(path).tensors["w"].chunks[7]
    assert bad.payload is not None
    data = tmp_path / "ck" / bad.file
    raw = bytearray(data.read_bytes())
    block = np.frombuffer(bytes(raw[-20 * 8 :]), dtype="<u4").reshape(20, 2).tolist()
    at = len(raw) - 20 * 8 + 8 * block.index([bad.frame, bad.crcs[0]]) + 4
    raw[at] ^= 1
    data.write_bytes(bytes(raw))
    _refused_by_name(path, bad, data)
    assert len(gathered) == 2


def test_a_truncated_data_file_is_refused_before_any_target_is_touched(tmp_path, gathered):
    full = _full(torch.float32)
    path = _save(tmp_path, full)
    chunks = Manifest.read(path).tensors["w"].chunks
    last = max(chunks, key=lambda c: c.record[0])
    data = tmp_path / "ck" / last.file
    data.write_bytes(data.read_bytes()[: last.record[0] + 8])
    target = _targets(Layout.column_wise((ROWS, 6), [3, 3]), torch.float32)
    with pytest.raises(swc.CorruptCheckpointError, match="truncated"):
        swc.load({"w": target}, path)
    assert all(torch.equal(s, torch.full((ROWS, 3), 7.0)) for s in target.local_shards())


def test_two_pieces_of_one_chunk_read_it_once(tmp_path, gathered):
    """Pieces that share chunks in one window: each chunk read once for both."""
    full = _full(torch.int16)
    path = _save(tmp_path, full)
    layout = Layout((ROWS, 6), {0: [Block((0, 0), (ROWS, 4)), Block((0, 4), (ROWS, 2))]})
    shards = [torch.zeros(b.sizes, dtype=torch.int16) for b in layout.blocks_of(0)]
    target = ShardedTensor.from_layout(layout, shards)
    chunks = Manifest.read(path).tensors["w"].chunks
    first = min(c.payload[0] for c in chunks)  # type: ignore[index]
    last = max(c.payload[0] + c.payload[1] for c in chunks)  # type: ignore[index]
    reader = swc.load({"w": target}, path)
    _exact(target, full)
    assert reader.bytes_read == last - first
    assert len(gathered) == 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.complex128], ids=str)
def test_large_chunks_read_in_place_wherever_the_file_has_them(tmp_path, gathered, dtype):
    """Payloads of 1-4 KiB between frames of about 1 KiB: a span is read as one range,
    each payload where it lies (not aligned to its element size)."""
    full = _full(dtype, (ROWS, 128))
    path = _save(tmp_path, full)
    starts = {c.payload[0] % 16 for c in Manifest.read(path).tensors["w"].chunks}  # type: ignore[index]
    assert starts != {0}  # some payloads lie off the alignment of any word
    target = _targets(Layout.column_wise((ROWS, 128), [50, 1, 77]), dtype)
    swc.load({"w": target}, path)
    _exact(target, full)
    assert len(gathered) == 3
