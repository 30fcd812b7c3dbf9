"""A crafted index read by the gather path (`format.table`, `io.chunks`) is refused as the old
path (`TensorChunks.covering`) refuses it, its message observed on the same checkpoint: the
same `CorruptCheckpointError`, every target as it was. 'w' (40 x 8) is stored in 20 row
chunks (a section decoded as an array) and loaded by column bands: each piece overlaps all.
Each crafted either way version 5 reads (`form`): the rows' checksums kept by their writer in
the data file (as `swc.save` writes them; a crafted row gets a slot of its own there), or in
the section (`crc_at` -1)."""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable
from typing import Any

import crc32c
import numpy as np
import pytest
import torch

import shardwise.checkpoint as swc
from shardwise import Block, Layout, ShardedTensor
from shardwise.checkpoint.format.checks import DATA_FILE
from shardwise.checkpoint.format.manifest import Manifest
from shardwise.checkpoint.format.table import file_of, row_width
from shardwise.checkpoint.io import chunks as part_gather
from shardwise.errors import CorruptCheckpointError
from shardwise.storage import open_folder

from .crafted import inlined, kept_words, new_slot, resealed

FULL = torch.arange(320.0).reshape(40, 8)
ROWS = Layout((40, 8), {0: [Block((2 * i, 0), (2, 8)) for i in range(20)]})
BANDS = Layout((40, 8), {0: [Block((0, 0), (40, 3)), Block((0, 3), (40, 5))]})
# one piece is chunk 0 (read whole by the old path), two gathered bands under it
MIXED = Layout(
    (40, 8), {0: [Block((0, 0), (2, 8)), Block((2, 0), (38, 3)), Block((2, 3), (38, 5))]}
)
GRID = Layout((40, 8), {0: [Block((4 * i, 4 * j), (4, 4)) for i in range(10) for j in range(2)]})
STRIPS = Layout((40, 8), {0: [Block((0, 0), (15, 8)), Block((15, 0), (25, 8))]})
# a row: offsets 0-1, sizes 2-3, tile 4-5, then these (record 9-10, payload 11-12)
RANK, K, TOKEN, REC, PAY, FRAME, COUNT, TRANSFORM, CRC_AT = 6, 7, 8, 9, 11, 13, 14, 15, 16
WIDTH = row_width(2)


class Ckpt:
    """'w' saved in `saved`'s chunks, all on rank 0, and an object 'n'; its section as rows,
    their checksums in `form`: "kept" by their writer (as saved), or "inline" in the section."""

    def __init__(
        self,
        location: str,
        saved: Layout = ROWS,
        dtype: torch.dtype = torch.float32,
        form: str = "kept",
    ):
        self.location, self.folder, self.kept = location, open_folder(location), form == "kept"
        self.full = FULL.to(dtype) if dtype != torch.bool else FULL.long() % 3 == 0
        shards = [self.full[_box(b)].contiguous() for b in saved.blocks_of(0)]
        swc.save({"w": ShardedTensor.from_layout(saved, shards), "n": 12345}, location)
        head = Manifest.read_head(self.folder)
        assert head.index is not None and head.tensors["w"].section is not None
        self.index, (_, offset, length, self.count, _) = head.index.file, head.tensors["w"].section
        data = self.folder.read(self.index)[offset : offset + length]
        self.rows = np.frombuffer(data, "<i8", self.count * WIDTH).reshape(self.count, -1).copy()
        self.crcs = np.frombuffer(data[self.rows.nbytes :], "<u4").copy()
        self.data, self.n = file_of(*self.rows[0, RANK : TOKEN + 1].tolist()), head.objects["n"]
        assert len(self.crcs) == 0 and (self.rows[:, CRC_AT] >= 0).all()  # kept by the writer
        if not self.kept:
            self.rows, self.crcs = inlined(self.folder, self.rows, 2)
            self.write(self.rows, self.crcs)

    def edit(self, change: Callable[[dict[str, Any]], None]) -> None:
        """The manifest's JSON changed by `change`, sealed again."""
        resealed(self.folder, change)

    def write(self, rows: np.ndarray, crcs: np.ndarray) -> None:
        """'w''s section replaced by `rows` and `crcs`, appended to the index, sealed."""
        data = rows.astype("<i8").tobytes() + crcs.astype("<u4").tobytes()
        old = self.folder.read(self.index)
        self.folder.write_durably(self.index, old + data)
        where = [0, len(old), len(data), len(rows), crc32c.crc32c(data)]
        self.edit(lambda doc: doc["tensors"]["w"].__setitem__("section", where))

    def set(self, row: int, column: int, *values: int, crcs: np.ndarray | None = None) -> None:
        """Row `row`'s columns from `column` set to `values` (and the checksums to `crcs`)."""
        rows = self.rows.copy()
        rows[row, column : column + len(values)] = values
        self.write(rows, self.crcs if crcs is None else crcs)

    def take(self, order: list[int]) -> None:
        """The rows (one checksum each) `order` lists, in that order (a row taken again
        given a slot of its own, when its writer keeps its checksums)."""
        rows = self.rows[order]
        for i in [i for i, n in enumerate(order) if n in order[:i] and self.kept]:
            self.own(rows[i])
        self.write(rows, self.crcs if self.kept else self.crcs[order])

    def own(self, row: np.ndarray, words: list[int] | None = None) -> None:
        """`row` (kept by its writer) given a slot of its own in its data file, holding
        `words` (a frame and checksums: its own when not given)."""
        words = kept_words(self.folder, row.tolist(), 2) if words is None else words
        row[CRC_AT] = new_slot(self.folder, file_of(*row[RANK : TOKEN + 1].tolist()), words)

    def checksum(self, rows: np.ndarray, crcs: np.ndarray, row: int, crc: int) -> None:
        """Row `row` of `rows` (one checksum each in `crcs` when inline) checksummed `crc`:
        in the section, or in a slot of its own, an empty frame (its payload its record)."""
        if self.kept:
            self.own(rows[row], [crc32c.crc32c(b""), crc])
        else:
            crcs[row] = crc

    def counted(self, row: int, count: int) -> None:
        """Row `row` counting `count` checksums (its grid makes one): one more (0) or one
        less in the section; kept by its writer, never fetched (it does not fit its grid)."""
        crcs = self.crcs
        if not self.kept:
            crcs = np.insert(crcs, row, 0) if count > 1 else np.delete(crcs, row)
        self.set(row, COUNT, count, crcs=crcs)

    def payload(self, row: int, file: str, at: int) -> None:
        """Row `row` given 64 bytes `at` of `file` as its record and payload, checksum right
        (kept: where its data file would hold it; the index never holds one)."""
        rows, crcs = self.rows.copy(), self.crcs.copy()
        rank, k, token = DATA_FILE.fullmatch(file).groups()  # type: ignore[union-attr]
        rows[row, RANK : PAY + 2] = (int(rank), int(k), int(token, 16), at, 64, at, 64)
        if file != self.index or not self.kept:
            self.checksum(rows, crcs, row, crc32c.crc32c(self.folder.read(file)[at : at + 64]))
        self.write(rows, crcs)


def _box(b: Block) -> tuple[slice, ...]:
    return tuple(slice(o, o + n) for o, n in zip(b.offsets, b.sizes))


@pytest.fixture(params=["kept", "inline"])
def form(request) -> str:
    """Where the rows' checksums are: with their writer, or in the section."""
    return request.param


@pytest.fixture(params=["local", "memory"])
def ck(request, tmp_path, form) -> Ckpt:
    local = request.param == "local"
    where = str(tmp_path / "ck") if local else f"memory://gather-{uuid.uuid4().hex}/ck"
    return Ckpt(where, form=form)


@pytest.fixture
def gathered(monkeypatch) -> list[Any]:
    """Every `GatherRead` the loads hand the executor."""
    seen: list[Any] = []
    spy = lambda reads, *args: (seen.extend(reads), part_gather.windows(reads, *args))[1]  # noqa: E731
    monkeypatch.setattr("shardwise.checkpoint.io.read.windows", spy)
    return seen


def _targets(layout: Layout, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    shards = [torch.full(b.sizes, -1.0).to(dtype) for b in layout.blocks_of(0)]
    return {"w": ShardedTensor.from_layout(layout, shards), "n": -1}


def _as_was(targets: dict[str, Any], layout: Layout) -> bool:
    fresh = _targets(layout, targets["w"].dtype)
    pairs = zip(targets["w"].local_shards(), fresh["w"].local_shards(), strict=True)
    return targets["n"] == -1 and all(torch.equal(a, b) for a, b in pairs)


def _raised(location: str, monkeypatch, targets: dict[str, Any], gather: bool) -> str | None:
    """What `swc.load` raises, None if nothing (the gather path off unless `gather`)."""
    with monkeypatch.context() as m:
        if not gather:
            m.setattr("shardwise.checkpoint.engine.stored.one_tile_boxes", lambda *_a: None)
            m.setattr("shardwise.checkpoint.engine.load.batch_boxes", lambda i: [None] * len(i))
        try:
            swc.load(targets, location)
        except CorruptCheckpointError as e:
            return str(e)
    return None


def _refused(ck: Ckpt, monkeypatch, layout: Layout = BANDS) -> str:
    """The message both paths raise (the same), every target as it was."""
    before, after = _targets(layout), _targets(layout)
    old = _raised(ck.location, monkeypatch, before, gather=False)
    assert old is not None and _raised(ck.location, monkeypatch, after, gather=True) == old
    assert _as_was(before, layout) and _as_was(after, layout)
    return old


def _loads(ck: Ckpt, layout: Layout, gathered: list[Any], parts: int | None = None) -> None:
    targets = _targets(layout, ck.full.dtype)
    swc.load(targets, ck.location)
    for b, s in zip(layout.blocks_of(0), targets["w"].local_shards(), strict=True):
        assert torch.equal(s.view(torch.uint8), ck.full[_box(b)].contiguous().view(torch.uint8))
    assert targets["n"] == 12345
    assert parts is None or sum(len(g.boxes.crc) for g in gathered) == parts
    gathered.clear()


def test_sound_layouts_load_bit_exact(ck, gathered):
    _loads(ck, BANDS, gathered, parts=40)  # through the gather: 20 parts a band
    inside = Layout((40, 8), {0: [Block((1, 1), (1, 3)), Block((5, 2), (3, 5))]}, allow_holes=True)
    _loads(ck, inside, gathered, parts=2)  # a piece inside one chunk (read alone); one across two
    _loads(ck, MIXED, gathered, parts=38)  # chunk 0 read whole, the rest gathered
    far = ck.rows[19] + [100, *[0] * (WIDTH - 1)]  # rows reversed, and one more overlapping
    crcs = ck.crcs if ck.kept else np.append(ck.crcs[::-1], ck.crcs[19])  # no piece
    if ck.kept:
        ck.own(far)
    ck.write(np.vstack([ck.rows[::-1], far]), crcs)
    _loads(ck, BANDS, gathered, parts=40)


@pytest.mark.parametrize(
    "saved, layout, dtype, parts",  # a grid by strips: pieces cut in two, `check_coverage`
    [(ROWS, BANDS, t, 40) for t in (torch.bool, torch.complex128, torch.complex64)]
    + [(GRID, STRIPS, torch.float32, 8 + 14)],
    ids=["bool", "complex128", "complex64", "grid"],
)
def test_other_dtypes_and_grids_load_bit_exact(tmp_path, gathered, saved, layout, dtype, parts):
    _loads(Ckpt(str(tmp_path / "ck"), saved, dtype), layout, gathered, parts)


@pytest.mark.parametrize("shift", [1, 2, 3, 5])
def test_payloads_off_alignment_load_as_the_old_path_loads_them(ck, monkeypatch, gathered, shift):
    """Rows 3, 4, 9 moved `shift * row` bytes into their records: the same bytes read."""
    data, loaded = ck.folder.read(ck.data), [_targets(BANDS), _targets(BANDS)]
    for r in (3, 4, 9):
        ck.rows[r, PAY] += shift * r
        ck.checksum(ck.rows, ck.crcs, r, crc32c.crc32c(data[int(ck.rows[r, PAY]) :][:64]))
    ck.write(ck.rows, ck.crcs)
    assert _raised(ck.location, monkeypatch, loaded[0], gather=False) is None
    assert _raised(ck.location, monkeypatch, loaded[1], gather=True) is None
    pairs = zip(*(t["w"].local_shards() for t in loaded), strict=True)
    assert all(torch.equal(a.view(torch.int32), b.view(torch.int32)) for a, b in pairs)
    assert len(gathered) == 2


BAD, ROW4 = "inconsistent sizes or byte ranges", "chunk row 4 holds an impossible value"
# name: (columns set as `Ckpt.set` takes them, or a function crafting 'w', what is said)
CRAFTED: dict[str, tuple[Any, str]] = {
    "near out of bounds": ((19, 0, 39), BAD),
    "size near 2**62": ((19, 2, (1 << 62) - 40), BAD),
    "columns past the shape": ((5, 3, 9, 2, 9), BAD),
    "offset near 2**62": ((19, 0, (1 << 62) - 3), "leave elements 38.. of dimension 0"),
    "partial overlap": ((1, 0, 1), "overlap in part at 1 along dimension 0"),
    "a chunk twice": (lambda c: c.take([*range(20), 1]), "has two chunks at offsets (2, 0)"),
    "a hole along rows": (lambda c: c.take([0, *range(2, 20)]), "leave elements 2..4 of"),
    "hole in columns": (lambda c: c.set(1, 3, 4, 2, 4, *c.rows[1, 6:12], 32), "(2, 1) in no chunk"),
    "payload length": ((3, PAY + 1, 60), BAD),
    "payload past its record": (lambda c: c.set(3, PAY, int(c.rows[3, REC:PAY].sum()) - 10), BAD),
    "record past its file": (lambda c: c.set(19, REC + 1, c.folder.sizes()[c.data]), "past the"),
    "two rows, one record": (lambda c: c.payload(1, c.data, int(c.rows[0, PAY])), "overlapping"),
    "negative rank": ((4, RANK, -1), ROW4),
    "negative k": ((4, K, -1), ROW4),
    "negative record": ((4, REC, -1), ROW4),
    "below -1": ((4, REC, -2), "a chunk row holds an impossible value"),
    "token": ((4, TOKEN, 1 << 48), ROW4),
    "frame": ((4, FRAME, 1 << 32), ROW4),
    "negative frame": ((4, FRAME, -1), ROW4),
    "transform": ((4, TRANSFORM, 0), ROW4),
    "two checksums": (lambda c: c.counted(4, 2), BAD),
    "no checksum": (lambda c: c.counted(4, 0), BAD),
    "tile not the sizes": ((4, 4, 1, 8), BAD),
    # 'w' in a grid of 4 x 4 chunks (row 3: the one at (4, 4)), loaded by strips of rows
    "grid: overlap": ((3, 1, 3), "overlap in part: "),
    "grid: hole": (lambda c: c.take([0, 1, 2, *range(4, 20)]), "leave element (4, 4) in no chunk"),
    "grid: twice": (lambda c: c.take([*range(20), 3]), "has two chunks at offsets (4, 4)"),
    "grid: out of bounds": ((3, 1, 5), BAD),
}


# what is said instead when the writer keeps the rows' checksums: a row holding a frame is
# refused with its section; a row naming rank or k -1 names a data file that is in no
# listing, where its checksums would be read before the row itself is decoded
SECTION, MISSING = "'w': a chunk row holds an impossible value", "is missing or not a plain file"
KEPT_SAYS = {
    "frame": SECTION,
    "negative frame": SECTION,
}


@pytest.mark.parametrize("name", list(CRAFTED))
def test_a_crafted_row_is_refused_as_the_old_path_refuses_it(ck, monkeypatch, form, name):
    craft, fragment = CRAFTED[name]
    grid = name.startswith("grid")
    ck = Ckpt(f"{ck.location}-grid", GRID, form=form) if grid else ck
    ck.set(*craft) if isinstance(craft, tuple) else craft(ck)
    if ck.kept and name in KEPT_SAYS:
        fragment = KEPT_SAYS[name].format(token=ck.data.split(".sw")[1][:12])
    assert fragment in _refused(ck, monkeypatch, STRIPS if grid else BANDS)


@pytest.mark.parametrize("whose", ["chunk 0, read whole", "object 'n'"])
def test_a_gathered_row_claiming_bytes_read_otherwise_is_refused(ck, monkeypatch, whose):
    file, at = (ck.data, int(ck.rows[0, PAY])) if whose[0] == "c" else (ck.n.file, ck.n.offset)
    ck.payload(5, file, at)
    where = ck.folder.where(file)
    tail = f"claim overlapping bytes of {where} (at {at}): damaged or crafted records"
    assert _refused(ck, monkeypatch, layout=MIXED).endswith(tail)


@pytest.mark.parametrize("how", ["flipped", "truncated", "missing", "linked"])
def test_a_damaged_data_file_is_refused_as_the_old_path_refuses_it(ck, tmp_path, monkeypatch, how):
    path, data, at = ck.folder.where(ck.data), ck.folder.read(ck.data), int(ck.rows[7, PAY])
    if how == "flipped":
        ck.folder.write_durably(
            ck.data, data[: at + 3] + bytes([data[at + 3] ^ 1]) + data[at + 4 :]
        )
    elif how == "truncated":
        ck.folder.write_durably(ck.data, data[: int(ck.rows[19, REC]) + 8])
    elif how == "missing" or not ck.location.startswith(str(tmp_path)):  # no links in memory
        ck.folder.remove(ck.data)
    else:  # a link to a copy outside, never read
        os.replace(path, tmp_path / "outside.distcp")
        os.symlink(tmp_path / "outside.distcp", path)
    message = _refused(ck, monkeypatch)
    if how == "flipped":
        assert message == f"'w': bytes {at}..{at + 64} of {path} fail their checksum"
    elif ck.kept and how == "truncated":  # the writer's checksums, at its end, cut off with it
        size, first = int(ck.rows[19, REC]) + 8, int(ck.rows[:, CRC_AT].min())
        assert message == (
            f"{ck.folder.where(ck.index)} 'w': chunk checksums at bytes {first}..{first + 8} "
            f"of data file {path} ({size} bytes) lie past its end"
        )
    elif ck.kept:
        assert message == (
            f"{ck.folder.where(ck.index)} 'w': data file {path} is missing or not a plain "
            "file (it keeps chunk checksums)"
        )
    else:
        assert path in message and ("missing" if how != "truncated" else "truncated") in message


def test_chunks_whose_byte_counts_overflow_are_refused(tmp_path, monkeypatch, form):
    """'w' (40, X) complex128, chunks 0 and 1 (18, X): 18 * X * 16 = 256 (mod 2**64)."""
    ck = Ckpt(str(tmp_path / "ck"), dtype=torch.complex128, form=form)
    x = 128102389400760776
    assert 18 * x * 16 % (1 << 64) == 256 == ck.rows[0, PAY + 1] and 40 * x < 1 << 63
    rows = ck.rows.copy()
    rows[:2, :6] = [(0, 0, 18, x, 18, x), (18, 0, 18, x, 18, x)]
    rows[2:, 1] = 8  # the other chunks away from column 0
    ck.write(rows, ck.crcs)
    ck.edit(lambda doc: doc["tensors"]["w"].__setitem__("shape", [40, x]))
    layout = Layout((40, x), {0: [Block((0, 0), (36, 1))]}, allow_holes=True)
    for gather in (False, True):
        target = ShardedTensor.from_layout(layout, [torch.zeros((36, 1), dtype=torch.complex128)])
        assert BAD in str(_raised(ck.location, monkeypatch, {"w": target}, gather))
        assert not target.local_shards()[0].any()


def test_a_file_truncated_after_the_listing_is_named_as_the_old_path_names_it(ck, monkeypatch):
    listing = ck.folder.sizes()
    monkeypatch.setattr(type(ck.folder), "sizes", lambda _self: dict(listing))
    ck.folder.write_durably(ck.data, ck.folder.read(ck.data)[: int(ck.rows[10, PAY]) + 8])
    messages = []
    for gather in (False, True):
        targets = {"w": _targets(BANDS)["w"]}  # not 'n': it lies after the chunks
        messages.append(_raised(ck.location, monkeypatch, targets, gather))
        assert _as_was({**targets, "n": -1}, BANDS)
    assert messages[1] == messages[0]
    if not ck.kept:
        assert "the file is truncated" in str(messages[0])
        return
    start, stop = int(ck.rows[:, CRC_AT].min()), int(ck.rows[:, CRC_AT].max()) + 8
    assert messages[0] == (  # the writer's checksums, at the end, are read first: cut short
        f"{ck.folder.where(ck.index)} 'w': chunk checksums at bytes {start}..{stop} of data "
        f"file {ck.folder.where(ck.data)} cut short (truncated)"
    )


def test_a_row_naming_the_index_file_is_refused(ck, monkeypatch):
    """The index is named as a data file is: its sections are never a chunk's bytes."""
    ck.payload(5, ck.index, 0)
    where = ck.folder.where(ck.index)
    message = _refused(ck, monkeypatch)
    assert message == (
        f"{where} 'w': data file {where} is the index (it keeps chunk checksums)"
        if ck.kept  # where its checksums would be read: refused before any read
        else f"'w': its stored bytes would be read from the index file {where}: damaged or "
        "crafted records"
    )
