"""Checksums kept by their writers (format version 5, `format.index`): each data file of
a collective save ends with its chunks' frames and tile checksums, exactly where their rows'
`crc_at` say, and a load reads them in one read a file; a damaged word is found by a load
(a tile's, by the loads reading that tile) and by `verify`, and every crafted `crc_at` (past
the file, overlapping, in a missing file or the index, with a frame in the row, a count its
tiles do not make) is refused before anything past a file's end is read."""

from __future__ import annotations

import shutil
from pathlib import Path

import crc32c
import numpy as np
import pytest
import torch

import shardwise.checkpoint as swc
from shardwise import Block, Layout, ShardedTensor
from shardwise.checkpoint.engine.save import save_state
from shardwise.checkpoint.format.manifest import Manifest
from shardwise.checkpoint.format.table import file_of
from shardwise.comm.agreement import Agreement
from shardwise.storage.local import LocalFile
from shardwise.testing import shard_of

from ...comm.threaded_world import ThreadedWorld
from .crafted_sections import ROWS, resection, section_rows
from .golden_manifest import save_golden

W = torch.arange(48, dtype=torch.float32).reshape(8, 6)
BIG = torch.randn(1024, 256, generator=torch.Generator().manual_seed(3))  # 512 KiB a rank
TILE = 256 * 256 * 4  # bytes of a tile of BIG's chunks: (256, 256), two a chunk
LAYOUTS = {"w": Layout.row_wise((8, 6), [3, 5]), "big": Layout.row_wise((1024, 256), [512] * 2)}


def _state(rank: int) -> dict:
    state = {k: (W, BIG)[i] for i, k in enumerate(LAYOUTS)}
    out: dict = {
        k: ShardedTensor.from_layout(layout, shard_of(state[k], layout, rank), rank=rank)
        for k, layout in LAYOUTS.items()
    }
    return out | {"bias": torch.arange(5.0), "step": 7}


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """A save of two thread ranks: `w` (3 and 5 rows), `big` (a chunk of two tiles each),
    `bias` (replicated: written once), `step`; a test copies it before damaging it."""
    path = tmp_path_factory.mktemp("kept") / "ck"
    world = ThreadedWorld(2)
    args = ("save path", ("p",))
    assert world.run(lambda c: save_state(_state(c.rank), path, Agreement(c, args))) == [None] * 2
    return path


def _copy(saved: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(saved, tmp_path / "ck"))


def _rows(path: Path, key: str) -> list[tuple[str, list[int]]]:
    """`key`'s rows in the checkpoint at `path`, each with its data file's name."""
    rows, crcs = section_rows(path, key)
    assert crcs == []  # none in the section: every row's are in its data file
    d = (len(rows[0]) - 11) // 3
    return [(file_of(*r[3 * d : 3 * d + 3]), r) for r in rows]


def _expected(data: bytes, row: list[int], d: int) -> list[int]:
    """The frame and tile checksums of `row`'s record in `data`, computed here."""
    start, length, at, size = row[3 * d + 3 : 3 * d + 7]
    frame = crc32c.crc32c(data[at + size : start + length], crc32c.crc32c(data[start:at]))
    tiles = (
        [data[at : at + size]]
        if size <= TILE
        else [data[at : at + TILE], data[at + TILE : at + size]]
    )
    return [frame] + [crc32c.crc32c(t) for t in tiles]


def test_each_data_file_ends_with_its_chunks_checksums_in_record_order(saved):
    files: dict[str, list[tuple[int, int, int]]] = {}  # record start, crc_at, words
    for key, d in [("w", 2), ("big", 2), ("bias", 1)]:
        for name, row in _rows(saved, key):
            data = (saved / name).read_bytes()
            frame_col, count, transform, crc_at = row[-4:]
            assert (frame_col, transform) == (0, -1) and crc_at >= 0
            expected = _expected(data, row, d)
            assert count == len(expected) - 1 == (2 if key == "big" else 1)
            got = np.frombuffer(data, dtype="<u4", count=1 + count, offset=crc_at).tolist()
            assert got == expected, key
            files.setdefault(name, []).append((row[3 * d + 3], crc_at, 1 + count))
    assert len(files) == 2  # one data file a rank
    for name, slots in files.items():  # back to back, from the end of its last record
        slots.sort()
        size = (saved / name).stat().st_size
        assert [at for _, at, _ in slots] == sorted(at for _, at, _ in slots)
        assert all(a + 4 * n == b for (_, a, n), (_, b, _) in zip(slots, slots[1:]))
        assert slots[-1][1] + 4 * slots[-1][2] == size
    assert swc.verify(saved) == []


def _damaged(saved: Path, tmp_path: Path, key: str, word: int, i: int = 0) -> tuple[Path, Path]:
    """A copy of `saved` with bit 0 of word `word` of the slot of row `i` of `key` flipped
    (word 0: its frame), and that chunk's data file."""
    path = _copy(saved, tmp_path)
    name, row = _rows(path, key)[i]
    raw = bytearray((path / name).read_bytes())
    raw[row[-1] + 4 * word] ^= 1
    (path / name).write_bytes(bytes(raw))
    return path, path / name


def test_a_damaged_tile_checksum_is_refused_by_a_load_and_by_verify(saved, tmp_path):
    path, data = _damaged(saved, tmp_path, "w", 1)
    with pytest.raises(swc.CorruptCheckpointError) as info:
        swc.load({"w": torch.zeros(8, 6)}, path)
    assert str(info.value) == f"'w': bytes 448..520 of {data} fail their checksum"
    problem = f"'w' chunk at (0, 0): bytes 448..520 of {data} fail their checksum"
    assert swc.verify(path, raise_on_error=False) == [problem]
    with pytest.raises(swc.CorruptCheckpointError, match="fails verification, 1 problem: 'w' "):
        swc.verify(path)
    target = {"big": torch.zeros(1024, 256), "bias": torch.zeros(5)}
    swc.load(target, path)  # the other chunks of its file check out
    assert torch.equal(target["big"], BIG) and torch.equal(target["bias"], torch.arange(5.0))


def test_a_damaged_frame_is_found_by_verify(saved, tmp_path):
    """A load reads payloads, not the frames around them: `verify` checks those."""
    path, data = _damaged(saved, tmp_path, "w", 0)
    target = torch.zeros(8, 6)
    swc.load({"w": target}, path)
    assert torch.equal(target, W)
    assert swc.verify(path, raise_on_error=False) == [
        f"'w' chunk at (0, 0): the torch.save record framing in {data} (bytes 0..1305) fails "
        "its checksum"
    ]


@pytest.fixture(scope="module")
def golden(tmp_path_factory) -> Path:
    """The golden checkpoint as `swc.save` writes it: model.w's rows keep their checksums
    at 6353 and 6361 of its data file, of 6385 bytes."""
    path = tmp_path_factory.mktemp("golden") / "ck"
    save_golden(path)
    assert [r[-1] for _, r in _rows(path, "model.w")] == [r[-1] for r in ROWS[5]]
    return path


@pytest.fixture
def reads(monkeypatch) -> list[tuple[str, int, int]]:
    """Every local read: (file, offset, end), each checked to end inside its file."""
    seen: list[tuple[str, int, int]] = []
    pread, readinto = LocalFile.pread, LocalFile.readinto

    def check(f: LocalFile, offset: int, n: int) -> None:
        seen.append((Path(f.where).name, offset, offset + n))
        assert offset + n <= f.size(), (f.where, offset, n)

    def spy_pread(f: LocalFile, n: int, offset: int) -> bytes:
        check(f, offset, n)
        return pread(f, n, offset)

    def spy_readinto(f: LocalFile, buffers, offset: int) -> int:
        check(f, offset, sum(len(b) for b in buffers))
        return readinto(f, buffers, offset)

    monkeypatch.setattr(LocalFile, "pread", spy_pread)
    monkeypatch.setattr(LocalFile, "readinto", spy_readinto)
    return seen


SLOT = "{index} 'model.w': chunk checksums at bytes %s of data file {data} (6385 bytes) %s"
KEPT = "{index} 'model.w': data file {folder}/%s is %s (it keeps chunk checksums)"
SIZES = "chunk at offsets (0, 0){of} has inconsistent sizes or byte ranges (file {file}, payload "
SIZES += "(448, 64))"
FAR = 1 << 40
CRAFTED = {  # model.w's row, column, value: what `Manifest.read`, and a load, say
    "past-the-end": (1, 16, 6385, SLOT % ("6385..6393", "lie past its end")),
    "far-past-the-end": (1, 16, FAR, SLOT % (f"{FAR}..{FAR + 8}", "lie past its end")),
    "overlapping": (1, 16, 6357, SLOT % ("6357..6365", "overlap another chunk's")),
    "missing-file": (1, 6, 5, KEPT % ("__5_0.sw{token}.distcp", "missing or not a plain file")),
    "the-index": (1, 7, 1, KEPT % ("{index_name}", "the index")),
    "a-frame": (0, 13, 1, "{index} 'model.w': a chunk row holds an impossible value"),
    "a-count-of-2": (0, 14, 2, SIZES),
    "a-huge-count": (0, 14, FAR, SIZES),
}


@pytest.mark.parametrize("i, column, value, message", CRAFTED.values(), ids=CRAFTED)
def test_a_crafted_crc_at_is_refused_reading_nothing_past_a_file(
    golden, tmp_path, reads, i, column, value, message
):
    path = _copy(golden, tmp_path)
    rows, crcs = section_rows(path, "model.w")
    rows[i][column] = value
    resection(path, "model.w", rows, crcs)
    (data,) = {name for name, _ in _rows(golden, "model.w")}
    index = next(p.name for p in path.glob("__0_1.*"))
    values = dict(index=path / index, index_name=index, folder=path, data=path / data)
    values |= dict(token=data.split(".sw")[1][:12], file=data)
    for load in (True, False):
        with pytest.raises(swc.CorruptCheckpointError) as info:
            if load:
                swc.load({"model": {"w": torch.zeros(6, 4)}}, path)
            else:
                Manifest.read(path)
        of = "" if load else " of 'model.w'"
        where = f"{path / index} 'model.w': " if load else f"{path / 'shardwise.json'}: "
        expected = (where + message if message == SIZES else message).format(**values, of=of)
        assert str(info.value) == expected
    assert index in {name for name, *_ in reads}  # the reads were seen, each checked
    assert {name for name, *_ in reads} <= {"shardwise.json", ".metadata", index, data}


def test_a_crc_at_inside_a_record_reads_its_bytes_as_checksums_that_fail(golden, tmp_path):
    """In bounds, overlapping no other slot: read, and the chunk then fails its checksum."""
    path = _copy(golden, tmp_path)
    rows, crcs = section_rows(path, "model.w")
    rows[1][16] = 100  # inside row 0's record
    resection(path, "model.w", rows, crcs)
    raw = (path / _rows(path, "model.w")[0][0]).read_bytes()
    chunk = Manifest.read(path).tensors["model.w"].chunks[1]
    assert [chunk.frame, *chunk.crcs] == np.frombuffer(raw, "<u4", 2, 100).tolist()
    data = path / chunk.file
    with pytest.raises(swc.CorruptCheckpointError) as info:
        swc.load({"model": {"w": torch.zeros(6, 4)}}, path)
    assert str(info.value) == f"'model.w': bytes 1753..1785 of {data} fail their checksum"
    assert swc.verify(path, raise_on_error=False) == [
        f"'model.w' chunk at (4, 0): the torch.save record framing in {data} (bytes 1305..2610) "
        "fails its checksum"
    ]


@pytest.mark.parametrize(
    "rows, tiles", [((10, 20), [0]), ((250, 270), [0, 1]), ((800, 1000), [1])], ids=str
)
def test_a_ranged_load_of_a_multi_tile_chunk_checks_the_tiles_it_reads(
    saved, tmp_path, rows, tiles
):
    """`big`'s chunks are two tiles of 256 rows: a band reads and checks the tiles it
    overlaps, whose checksums the block holds; a damaged one fails only the loads reading
    it."""
    lo, hi = rows
    band = Layout((1024, 256), {0: [Block((lo, 0), (hi - lo, 256))]}, allow_holes=True)
    target = ShardedTensor.from_layout(band, [torch.zeros(hi - lo, 256)])
    info = swc.load({"big": target}, saved)
    assert torch.equal(target.local_shards()[0], BIG[lo:hi])
    assert info.bytes_read == TILE * len(tiles)
    for tile in (0, 1):  # of the chunk it reads (rows 0-511 or 512-1023)
        path, data = _damaged(saved, tmp_path / str(tile), "big", 1 + tile, lo // 512)
        if tile not in tiles:
            swc.load({"big": target}, path)
            continue
        at = _rows(path, "big")[lo // 512][1][11] + tile * TILE  # the tile's payload bytes
        with pytest.raises(swc.CorruptCheckpointError) as e:
            swc.load({"big": target}, path)
        assert str(e.value) == f"'big': bytes {at}..{at + TILE} of {data} fail their checksum"


def test_a_load_reads_each_data_files_checksums_in_one_read(saved, reads):
    start: dict[str, int] = {}
    for key in ("w", "big", "bias"):
        for name, row in _rows(saved, key):
            start[name] = min(start.get(name, row[-1]), row[-1])
    target = {"w": torch.zeros(8, 6), "big": torch.zeros(1024, 256), "bias": torch.zeros(5)}
    swc.load(target, saved)
    assert torch.equal(target["w"], W) and torch.equal(target["big"], BIG)
    kept = sorted((name, at, end) for name, at, end in reads if end > start.get(name, end))
    assert kept == sorted((n, at, (saved / n).stat().st_size) for n, at in start.items())
