"""A crafted index read by the gather path (`row_boxes`, `part_gather`) is refused exactly as
the old path (`TensorChunks.covering`, one read a part) refuses it: the same
`CorruptCheckpointError`, every target as it was. 'w' (40 x 8) is stored in 20 row chunks
(a section decoded as an array) and loaded by column bands, so each piece overlaps all of
them; the old path's message is observed on the same checkpoint (`words_of` returning None)."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any

import crc32c
import numpy as np
import pytest
import torch

import shardwise.checkpoint as swc
from shardwise import Block, Layout, ShardedTensor
from shardwise.checkpoint.engine import loading
from shardwise.checkpoint.format.chunk_table import row_width
from shardwise.checkpoint.format.manifest import Manifest, seal
from shardwise.checkpoint.io import part_gather
from shardwise.errors import CorruptCheckpointError
from shardwise.storage import open_folder

FULL = torch.arange(320.0).reshape(40, 8)
ROWS = Layout((40, 8), {0: [Block((2 * i, 0), (2, 8)) for i in range(20)]})
BANDS = Layout((40, 8), {0: [Block((0, 0), (40, 3)), Block((0, 3), (40, 5))]})
# one piece is chunk 0 (read whole by the old path), two gathered bands under it
MIXED = Layout(
    (40, 8), {0: [Block((0, 0), (2, 8)), Block((2, 0), (38, 3)), Block((2, 3), (38, 5))]}
)
GRID = Layout((40, 8), {0: [Block((4 * i, 4 * j), (4, 4)) for i in range(10) for j in range(2)]})
STRIPS = Layout((40, 8), {0: [Block((0, 0), (15, 8)), Block((15, 0), (25, 8))]})
# columns of a row: offsets 0-1, sizes 2-3, tile 4-5, rank 6, k 7, token 8, record 9-10,
# payload 11-12, frame 13, checksum count 14, transform 15
RANK, K, TOKEN, REC, PAY, FRAME, COUNT, TRANSFORM = 6, 7, 8, 9, 11, 13, 14, 15


class Ckpt:
    """'w' saved in `saved`'s chunks, all on rank 0, and an object 'n'; its section as rows."""

    def __init__(self, location: str, saved: Layout = ROWS, dtype: torch.dtype = torch.float32):
        self.location, self.folder = location, open_folder(location)
        self.full = FULL.to(dtype) if dtype != torch.bool else FULL.long() % 3 == 0
        shards = [self.full[_box(b)].contiguous() for b in saved.blocks_of(0)]
        swc.save({"w": ShardedTensor.from_layout(saved, shards), "n": 12345}, location)
        head = Manifest.read_head(self.folder)
        assert head.index is not None and head.tensors["w"].section is not None
        self.index, (_, offset, length, self.count, _) = head.index.file, head.tensors["w"].section
        data = self.folder.read(self.index)[offset : offset + length]
        cut = self.count * row_width(2) * 8
        self.rows = np.frombuffer(data[:cut], "<i8").reshape(self.count, -1).copy()
        self.crcs = np.frombuffer(data[cut:], "<u4").copy()
        self.data = self.name(0)
        self.n = head.objects["n"]

    def name(self, row: int) -> str:
        rank, k, token = self.rows[row, RANK : TOKEN + 1].tolist()
        return f"__{rank}_{k}.sw{token:012x}.distcp"

    def edit(self, change: Callable[[dict[str, Any]], None]) -> None:
        doc = json.loads(self.folder.read("shardwise.json"))
        change(doc)
        doc["crc32c"] = 0
        text = seal(json.dumps(doc, separators=(",", ":")))
        self.folder.write_durably("shardwise.json", text.encode())

    def write(self, rows: np.ndarray, crcs: np.ndarray) -> None:
        """'w''s section replaced by `rows` and `crcs`, appended to the index, sealed."""
        data = rows.astype("<i8").tobytes() + crcs.astype("<u4").tobytes()
        old = self.folder.read(self.index)
        self.folder.write_durably(self.index, old + data)
        where = [0, len(old), len(data), len(rows), crc32c.crc32c(data)]
        self.edit(lambda doc: doc["tensors"]["w"].__setitem__("section", where))

    def rows_with(self, row: int, column: int, *values: int) -> np.ndarray:
        rows = self.rows.copy()
        rows[row, column : column + len(values)] = values
        return rows

    def set(self, row: int, column: int, *values: int) -> None:
        self.write(self.rows_with(row, column, *values), self.crcs)

    def payload(self, row: int, file: str, at: int, n: int) -> None:
        """Row `row` given bytes `at`.. `n` of `file` as its record and payload, its checksum right."""
        rows, crcs = self.rows.copy(), self.crcs.copy()
        rank, k, token = file[2:].split(".")[0].split("_") + [file.split(".sw")[1][:12]]
        rows[row, RANK : PAY + 2] = (int(rank), int(k), int(token, 16), at, n, at, n)
        crcs[row] = crc32c.crc32c(self.folder.read(file)[at : at + n])
        self.write(rows, crcs)


def _box(b: Block) -> tuple[slice, ...]:
    return tuple(slice(o, o + n) for o, n in zip(b.offsets, b.sizes))


@pytest.fixture(params=["local", "memory"])
def ck(request, tmp_path) -> Ckpt:
    if request.param == "local":
        return Ckpt(str(tmp_path / "ck"))
    import fsspec

    root = f"memory://gather-{os.getpid()}-{id(tmp_path)}"
    request.addfinalizer(lambda: fsspec.filesystem("memory").rm(root, recursive=True))
    return Ckpt(f"{root}/ck")


@pytest.fixture
def gathered(monkeypatch) -> list[Any]:
    """Every `GatherRead` the loads hand the executor."""
    seen: list[Any] = []

    def spy(reads, *args):
        seen.extend(reads)
        return part_gather.windows(reads, *args)

    monkeypatch.setattr("shardwise.checkpoint.io.read_executor.windows", spy)
    return seen


def _targets(layout: Layout, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    fill = torch.full((), -1.0).to(dtype)
    shards = [fill.expand(b.sizes).clone() for b in layout.blocks_of(0)]
    return {"w": ShardedTensor.from_layout(layout, shards), "n": -1}


def _as_was(targets: dict[str, Any], layout: Layout) -> bool:
    fresh = _targets(layout, targets["w"].dtype)
    pairs = zip(targets["w"].local_shards(), fresh["w"].local_shards(), strict=True)
    return targets["n"] == -1 and all(torch.equal(a, b) for a, b in pairs)


def _load(ck: Ckpt, monkeypatch, layout: Layout, gather: bool) -> tuple[str, dict[str, Any]]:
    """What a load into fresh targets raises (the gather path off unless `gather`)."""
    targets = _targets(layout)
    with monkeypatch.context() as m:
        if not gather:
            m.setattr(loading, "words_of", lambda _t: None)
        with pytest.raises(CorruptCheckpointError) as info:
            swc.load(targets, ck.location)
    return str(info.value), targets


def _refused(ck: Ckpt, monkeypatch, message: str | None = None, layout: Layout = BANDS) -> str:
    """Both paths raise the same message (`message` when given), every target as it was."""
    old, before = _load(ck, monkeypatch, layout, gather=False)
    new, after = _load(ck, monkeypatch, layout, gather=True)
    assert new == old
    assert message is None or old == message
    assert _as_was(before, layout) and _as_was(after, layout)
    return new


def _loads(ck: Ckpt, layout: Layout, gathered: list[Any], parts: int | None = None) -> None:
    targets = _targets(layout, ck.full.dtype)
    swc.load(targets, ck.location)
    for b, s in zip(layout.blocks_of(0), targets["w"].local_shards(), strict=True):
        assert torch.equal(s.view(torch.uint8), ck.full[_box(b)].contiguous().view(torch.uint8))
    assert targets["n"] == 12345
    assert parts is None or sum(len(g.boxes.crc) for g in gathered) == parts


def test_bands_load_through_the_gather(ck, gathered):
    _loads(ck, BANDS, gathered, parts=40)
    assert [g.shape for g in gathered] == [(40, 3), (40, 5)]


def test_sound_edge_cases_load_bit_exact(ck, gathered):
    inside = Layout((40, 8), {0: [Block((1, 1), (1, 3)), Block((5, 2), (3, 5))]}, allow_holes=True)
    _loads(ck, inside, gathered, parts=3)  # a piece inside one chunk; one across two
    _loads(ck, MIXED, gathered, parts=3 + 38)  # chunk 0 read whole, the rest gathered
    far = np.vstack([ck.rows, ck.rows[19:] + [[100, *[0] * 15]]])  # overlaps no piece
    ck.write(far, np.append(ck.crcs, ck.crcs[19]))
    _loads(ck, BANDS, gathered)


@pytest.mark.parametrize("dtype", [torch.bool, torch.complex128, torch.complex64], ids=str)
def test_other_dtypes_load_bit_exact(tmp_path, gathered, dtype):
    _loads(Ckpt(str(tmp_path / "ck"), dtype=dtype), BANDS, gathered, parts=40)


def _drop(ck: Ckpt, row: int) -> None:
    ck.write(np.delete(ck.rows, row, axis=0), np.delete(ck.crcs, row))


CRAFTED: dict[str, tuple[Callable[[Ckpt], None], str]] = {
    "near out of bounds": (lambda c: c.set(19, 0, 39), "inconsistent sizes or byte ranges"),
    "size near 2**62": (lambda c: c.set(19, 2, (1 << 62) - 40), "inconsistent sizes"),
    "columns past the shape": (lambda c: c.set(5, 3, 9, 2, 9), "inconsistent sizes"),
    "offset near 2**62": (lambda c: c.set(19, 0, (1 << 62) - 3), "leave elements 38.. of"),
    "partial overlap": (lambda c: c.set(1, 0, 1), "overlap in part at 1 along dimension 0"),
    "a chunk twice": (
        lambda c: c.write(np.vstack([c.rows, c.rows[1:2]]), np.append(c.crcs, c.crcs[1])),
        "has two chunks at offsets (2, 0)",
    ),
    "a hole along rows": (lambda c: _drop(c, 1), "leave elements 2..4 of dimension 0"),
    "a hole along columns": (lambda c: c.set(1, 3, 4, 2, 4), "inconsistent sizes"),
    "half a row, consistent": (
        lambda c: c.set(1, 3, 4, 2, 4, *c.rows[1, RANK:PAY].tolist(), c.rows[1, PAY], 32),
        "'w (at (0, 3))' (shape (40, 5)) leave element (2, 1) in no chunk",
    ),
    "payload length": (lambda c: c.set(3, PAY + 1, 60), "inconsistent sizes or byte ranges"),
    "payload past its record": (
        lambda c: c.set(3, PAY, int(c.rows[3, REC:PAY].sum()) - 10),
        "inconsistent sizes or byte ranges",
    ),
    "record past the file": (
        lambda c: c.set(19, REC + 1, c.folder.sizes()[c.data]),
        "lie past the end of",
    ),
    "same record as another gathered row": (
        lambda c: c.payload(1, c.data, int(c.rows[0, PAY]), 64),
        "claim overlapping bytes",
    ),
    "negative rank": (lambda c: c.set(4, RANK, -1), "chunk row 4 holds an impossible value"),
    "negative k": (lambda c: c.set(4, K, -1), "chunk row 4 holds an impossible value"),
    "negative record": (lambda c: c.set(4, REC, -1), "chunk row 4 holds an impossible value"),
    "below -1": (lambda c: c.set(4, REC, -2), "a chunk row holds an impossible value"),
    "token": (lambda c: c.set(4, TOKEN, 1 << 48), "chunk row 4 holds an impossible value"),
    "frame": (lambda c: c.set(4, FRAME, 1 << 32), "chunk row 4 holds an impossible value"),
    "transform": (lambda c: c.set(4, TRANSFORM, 0), "chunk row 4 holds an impossible value"),
    "two checksums": (
        lambda c: c.write(c.rows_with(4, COUNT, 2), np.insert(c.crcs, 4, 0)),
        "inconsistent sizes or byte ranges",
    ),
    "no checksum": (
        lambda c: c.write(c.rows_with(4, COUNT, 0), np.delete(c.crcs, 4)),
        "inconsistent sizes or byte ranges",
    ),
    "tile not the sizes": (lambda c: c.set(4, 4, 1, 8), "inconsistent sizes or byte ranges"),
}


@pytest.mark.parametrize("name", list(CRAFTED))
def test_a_crafted_row_is_refused_as_the_old_path_refuses_it(ck, monkeypatch, name):
    craft, fragment = CRAFTED[name]
    craft(ck)
    assert fragment in _refused(ck, monkeypatch)


def test_a_gathered_row_claiming_a_row_read_whole_is_refused(ck, monkeypatch):
    ck.payload(5, ck.data, int(ck.rows[0, PAY]), 64)
    where = ck.folder.where(ck.data)
    at = int(ck.rows[0, PAY])
    _refused(
        ck,
        monkeypatch,
        f"'w' and 'w' claim overlapping bytes of {where} (at {at}): damaged or crafted records",
        MIXED,
    )


def test_a_gathered_row_claiming_an_object_is_refused(ck, monkeypatch):
    ck.payload(5, ck.n.file, ck.n.offset, 64)
    assert "claim overlapping bytes" in _refused(ck, monkeypatch)


def _damage(ck: Ckpt, tmp_path, how: str) -> None:
    path = ck.folder.where(ck.data)
    data = ck.folder.read(ck.data)
    if how == "flipped":
        at = int(ck.rows[7, PAY]) + 3
        ck.folder.write_durably(ck.data, data[:at] + bytes([data[at] ^ 1]) + data[at + 1 :])
    elif how == "truncated":
        ck.folder.write_durably(ck.data, data[: int(ck.rows[19, REC]) + 8])
    elif how == "missing":
        ck.folder.remove(ck.data)
    elif ck.location.startswith(str(tmp_path)):  # a link to a copy outside, never read
        os.replace(path, tmp_path / "outside.distcp")
        os.symlink(tmp_path / "outside.distcp", path)
    else:
        pytest.skip("no links in memory")


@pytest.mark.parametrize("how", ["flipped", "truncated", "missing", "linked"])
def test_a_damaged_data_file_is_refused_as_the_old_path_refuses_it(ck, tmp_path, monkeypatch, how):
    _damage(ck, tmp_path, how)
    message = _refused(ck, monkeypatch)
    where = ck.folder.where(ck.data)
    if how == "flipped":
        lo = int(ck.rows[7, PAY])
        assert message == f"'w': bytes {lo}..{lo + 64} of {where} fail their checksum"
    else:
        assert where in message and ("missing" if how != "truncated" else "truncated") in message


@pytest.fixture
def grid(tmp_path) -> Ckpt:
    """'w' in 4 x 4 chunks (row 3 is the one at (4, 4)), loaded by strips of rows: each
    piece cut along both dimensions, its parts checked by `check_coverage`."""
    return Ckpt(str(tmp_path / "ck"), saved=GRID)


def test_a_grid_loads_by_strips(grid, gathered):
    _loads(grid, STRIPS, gathered, parts=8 + 14)


@pytest.mark.parametrize(
    "craft, fragment",
    [
        (lambda c: c.set(3, 1, 3), "overlap in part"),
        (lambda c: _drop(c, 3), "leave element (4, 4) in no chunk"),
        (lambda c: c.write(np.vstack([c.rows, c.rows[3:4]]), np.append(c.crcs, c.crcs[3])), "two"),
        (lambda c: c.set(3, 1, 5), "inconsistent sizes or byte ranges"),
    ],
    ids=["overlap", "hole", "twice", "out of bounds"],
)
def test_a_crafted_grid_is_refused_as_the_old_path_refuses_it(grid, monkeypatch, craft, fragment):
    craft(grid)
    assert fragment in _refused(grid, monkeypatch, layout=STRIPS)


@pytest.mark.xfail(
    strict=True,
    reason="row_boxes._plain: prod(sizes) * itemsize overflows int64 (shape's bytes >= 2**63), "
    "a row passes as plain; word_gather indexes out of scratch: IndexError, not the old refusal",
)
def test_a_chunk_whose_byte_count_overflows_is_refused(tmp_path, monkeypatch):
    """'w' declared (40, X) complex128, chunk 0 (40, X): 40 * X * 16 = 256 (mod 2**64), its
    real payload; the target holds column 0 only (a layout with holes)."""
    ck = Ckpt(str(tmp_path / "ck"), dtype=torch.complex128)
    x = 2 * pow(5, -1, 1 << 57) % (1 << 57)
    assert 40 * x * 16 % (1 << 64) == 256 == ck.rows[0, PAY + 1] and 40 * x < 1 << 63
    rows = ck.rows_with(0, 2, 40, x, 40, x)
    rows[1:, 1] = 8  # the other chunks away from column 0
    ck.write(rows, ck.crcs)
    ck.edit(lambda doc: doc["tensors"]["w"].__setitem__("shape", [40, x]))
    layout = Layout((40, x), {0: [Block((0, 0), (40, 1))]}, allow_holes=True)
    for gather in (False, True):
        target = ShardedTensor.from_layout(layout, [torch.zeros((40, 1), dtype=torch.complex128)])
        with monkeypatch.context() as m:
            if not gather:
                m.setattr(loading, "words_of", lambda _t: None)
            with pytest.raises(CorruptCheckpointError, match="inconsistent sizes or byte ranges"):
                swc.load({"w": target}, ck.location)
        assert not target.local_shards()[0].any()


@pytest.mark.xfail(
    strict=True,
    reason="read_locate.open_files: a gather's file shorter than the listing said is named "
    "by bytes 0..<end of its last payload>, the old path by the last record's range",
)
def test_a_file_truncated_after_the_listing_is_named_as_the_old_path_names_it(ck, monkeypatch):
    listing = ck.folder.sizes()
    monkeypatch.setattr(type(ck.folder), "sizes", lambda _self: dict(listing))
    data = ck.folder.read(ck.data)
    ck.folder.write_durably(ck.data, data[: int(ck.rows[10, PAY]) + 8])
    messages = []
    for gather in (False, True):
        targets = {"w": _targets(BANDS)["w"]}  # not 'n': it lies after the chunks
        with monkeypatch.context() as m:
            if not gather:
                m.setattr(loading, "words_of", lambda _t: None)
            with pytest.raises(CorruptCheckpointError, match="the file is truncated") as info:
                swc.load(targets, ck.location)
        messages.append(str(info.value))
        assert _as_was({**targets, "n": -1}, BANDS)
    assert messages[1] == messages[0]
