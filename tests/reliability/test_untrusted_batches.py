"""Pieces of many tensors planned at once (`format.table.batch_boxes`: sections of ndim 1,
2, 3, dtypes and row counts stacked) load bit for bit as one at a time; one crafted section
is refused with the one-piece path's message, every target as it was. Every section either
way version 5 reads (`form`): its rows' checksums kept by their writer in the data file (as
`swc.save` writes them; a crafted row gets a slot of its own there), or in the section."""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable
from functools import partial
from typing import Any

import crc32c
import numpy as np
import pytest
import torch

import shardwise.checkpoint as swc
from shardwise import Block, Layout, ShardedTensor
from shardwise.checkpoint.engine import stored as stored_view
from shardwise.checkpoint.format import table as row_batches
from shardwise.checkpoint.format.manifest import Manifest
from shardwise.checkpoint.format.table import Boxes, file_of, one_tile_boxes, row_width
from shardwise.checkpoint.io import chunks as part_gather
from shardwise.errors import CorruptCheckpointError
from shardwise.storage import open_folder

from .crafted import inlined, kept_words, new_slot, resealed


def _cuts(shape: tuple[int, ...], step: int) -> list[Block]:  # `step` along dimension 0
    rest = tuple(shape[1:])
    return [Block((i, *[0] * len(rest)), (step, *rest)) for i in range(0, shape[0], step)]


# key: (shape, dtype, stored chunks, pieces loaded); in index order a, b, c, d, e, f
TENSORS: dict[str, tuple[tuple[int, ...], torch.dtype, list[Block], list[Block]]] = {
    "a": ((40, 8), torch.float32, _cuts((40, 8), 2), [Block((0, 0), (40, 3)), Block((0, 3), (40, 5))]),
    "b": ((60,), torch.float64, _cuts((60,), 2), [Block((0,), (25,)), Block((25,), (35,))]),
    "c": ((20, 4, 6), torch.int32, _cuts((20, 4, 6), 1), [Block((0, 0, 0), (20, 4, 2)), Block((0, 0, 2), (20, 4, 4))]),
    "d": ((34, 3), torch.bfloat16, _cuts((34, 3), 2), [Block((0, 0), (34, 1)), Block((0, 1), (34, 2))]),
    "e": ((54, 16), torch.float64, _cuts((54, 16), 3), [Block((0, 0), (54, 5)), Block((0, 5), (54, 11))]),
    "f": ((36,), torch.int16, _cuts((36,), 2), [Block((0,), (36,))]),
}  # fmt: skip
GATHERED = 11  # every piece: each overlaps two or more chunks
PARTS = 40 + 13 + 18 + 40 + 34 + 36 + 18  # (piece, chunk) pairs


def _box(b: Block) -> tuple[slice, ...]:
    return tuple(slice(o, o + n) for o, n in zip(b.offsets, b.sizes))


def _cols(key: str) -> dict[str, int]:
    """A section row's columns after offsets, sizes and tile (`format.table`)."""
    d = len(TENSORS[key][0])
    names = ["rank", "k", "token", "rec", "rec_len", "pay", "pay_len", "frame", "count"]
    names += ["transform", "crc_at"]
    at = {"at0": 0, "size": d, "last": 2 * d - 1, "tile": 2 * d, "last tile": 3 * d - 1}
    return at | {name: 3 * d + i for i, name in enumerate(names)}


class Ckpt:
    """Every tensor of `TENSORS` saved in its chunks by rank 0, and an object 'n'; its rows'
    checksums in `form`: "kept" by their writer (as saved), or "inline" in the sections."""

    def __init__(self, location: str, form: str = "kept") -> None:
        self.location, self.folder, self.form = location, open_folder(location), form
        gen = torch.Generator().manual_seed(5)
        self.full, state = {}, {"n": 12345}
        for key, (shape, dtype, stored, _) in TENSORS.items():
            nbytes = int(np.prod(shape)) * dtype.itemsize
            raw = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)
            self.full[key] = raw.view(dtype).reshape(shape)
            shards = [self.full[key][_box(b)].contiguous() for b in stored]
            state[key] = ShardedTensor.from_layout(Layout(shape, {0: stored}), shards)
        swc.save(state, location)
        head = Manifest.read_head(self.folder)
        assert head.index is not None
        self.index, self.rows, self.crcs = head.index.file, {}, {}
        data = self.folder.read(self.index)
        for key in TENSORS:
            _, offset, length, count, _ = head.tensors[key].section  # type: ignore[misc]
            width = row_width(len(TENSORS[key][0]))
            section = data[offset : offset + length]
            self.rows[key] = np.frombuffer(section, "<i8", count * width).reshape(count, -1).copy()
            self.crcs[key] = np.frombuffer(section[count * width * 8 :], "<u4").copy()
            assert len(self.crcs[key]) == 0 and (self.rows[key][:, -1] >= 0).all()  # kept
            if form == "inline":
                self.write(key, *inlined(self.folder, self.rows[key], len(TENSORS[key][0])))

    def write(self, key: str, rows: np.ndarray, crcs: np.ndarray) -> None:
        """`key`'s section now `rows` and `crcs`, appended to the index, sealed."""
        self.rows[key], self.crcs[key] = rows, crcs
        data = rows.astype("<i8").tobytes() + crcs.astype("<u4").tobytes()
        old = self.folder.read(self.index)
        self.folder.write_durably(self.index, old + data)
        self.section(key, [0, len(old), len(data), len(rows), crc32c.crc32c(data)])

    def section(self, key: str, where: list[int]) -> None:
        resealed(self.folder, lambda doc: doc["tensors"][key].__setitem__("section", where))

    def slot(self, row: np.ndarray, words: list[int] | None = None) -> None:
        """`row` given a slot of its own in its data file, holding `words` (a frame and
        checksums; its writer's own when not given)."""
        d = (len(row) - row_width(0)) // 3
        words = kept_words(self.folder, row.tolist(), d) if words is None else words
        row[-1] = new_slot(self.folder, file_of(*row[3 * d : 3 * d + 3].tolist()), words)


@pytest.fixture(params=["kept", "inline"])
def ck(request, tmp_path) -> Ckpt:
    return Ckpt(str(tmp_path / "ck"), request.param)


def _targets() -> dict[str, Any]:
    shards = lambda dtype, pieces: [torch.full(b.sizes, -3.0).to(dtype) for b in pieces]  # noqa: E731
    return {"n": -1} | {
        key: ShardedTensor.from_layout(Layout(shape, {0: p}), shards(dtype, p))
        for key, (shape, dtype, _, p) in TENSORS.items()
    }


def _bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def _load(ck: Ckpt, monkeypatch, batch: bool) -> tuple[dict[str, Any], str | None, list]:
    """Targets after `swc.load` (the batch, or one piece at a time), what it raised, and
    what `batch_boxes` answered."""
    targets, answers = _targets(), []

    def spy(items):
        answers.extend(row_batches.batch_boxes(items))
        return answers[-len(items) :] if items else []

    with monkeypatch.context() as m:
        if batch:
            m.setattr("shardwise.checkpoint.engine.load.batch_boxes", spy)
        else:
            m.setattr("shardwise.checkpoint.engine.load.batch_boxes", lambda i: [None] * len(i))
            m.setattr("shardwise.checkpoint.engine.stored.one_tile_boxes", lambda *a: None)
        try:
            swc.load(targets, ck.location)
        except CorruptCheckpointError as e:
            return targets, str(e), answers
    return targets, None, answers


def _exact(ck: Ckpt, targets: dict[str, Any], fresh: bool = False) -> bool:
    """Every target bit for bit as stored (`fresh`: as it was before the load)."""
    want = _targets() if fresh else {"n": 12345} | {k: ck.full[k] for k in TENSORS}
    return targets["n"] == want["n"] and all(
        _bytes(s) == _bytes(want[key].local_shards()[i] if fresh else want[key][_box(b)])
        for key, (_, _, _, pieces) in TENSORS.items()
        for i, (b, s) in enumerate(zip(pieces, targets[key].local_shards(), strict=True))
    )


def _sound(ck: Ckpt, monkeypatch) -> None:
    """Loaded bit for bit by both paths, every piece by the batch."""
    for batch in (True, False):
        targets, raised, answers = _load(ck, monkeypatch, batch)
        assert raised is None and _exact(ck, targets)
        assert sum(a is not None for a in answers) == (GATHERED if batch else 0)


@pytest.mark.parametrize("pairs", [1 << 17, 1, 60])
def test_every_tensor_gathered_at_once_bit_exact_ranges_checked_after(ck, monkeypatch, pairs):
    """All 11 pieces accepted by the batch (`pairs` (piece, row) pairs at once); when the
    byte ranges are checked (before any read) every row the batch found is among them."""
    at_check: list[int] = []
    real = stored_view.check_read_ranges

    def check(folder, ranges, sizes, spans=None, index=None):
        at_check.append(sum(len(p) for p in spans.parts) if spans else 0)
        return real(folder, ranges, sizes, spans, index)

    seen: list[Any] = []
    spy = lambda reads, *args: (seen.extend(reads), part_gather.windows(reads, *args))[1]  # noqa: E731
    monkeypatch.setattr("shardwise.checkpoint.io.read.windows", spy)
    monkeypatch.setattr(stored_view, "check_read_ranges", check)
    monkeypatch.setattr(row_batches, "PAIRS", pairs)
    _sound(ck, monkeypatch)
    assert len(seen) == GATHERED
    assert at_check == [PARTS, 0] and sum(len(g.boxes.crc) for g in seen) == PARTS


def _parts(boxes: Boxes) -> list[tuple]:
    fields = (boxes.file, boxes.record, boxes.payload, boxes.crc[:, None], boxes.sizes)
    more = (boxes.inner, boxes.lengths, boxes.dest)
    return sorted(map(tuple, np.hstack([*fields, *more]).tolist()))


def test_pieces_twice_in_one_batch_as_one_at_a_time(ck):
    """Every piece twice (and in reverse): the parts `one_tile_boxes` finds, the same
    rows' ranges registered over and over, checked as one each."""
    sections = stored_view.StoredView.read(ck.folder, 0).stored_chunks(list(TENSORS), [])
    chunks = {k: s.sectioned for k, s in itertools.islice(sections, len(TENSORS))}
    items = [
        (chunks[k], b.offsets, b.sizes, chunks[k].table.overlapping(b.offsets, b.sizes))
        for k, t in TENSORS.items()
        for b in t[3]
    ]
    got = row_batches.batch_boxes(items + items[::-1])
    assert sum(b is not None for b in got) == 2 * GATHERED
    for (c, lo, n, found), boxes in zip(items + items[::-1], got, strict=True):
        alone = one_tile_boxes(c, lo, n, found)
        assert alone is not None and boxes is not None and _parts(boxes) == _parts(alone)
    assert next(sections, None) is None  # ranges checked: no error


@pytest.mark.parametrize("count", [0, 2, 3])
@pytest.mark.parametrize("key", ["a", "d", "b", "c"])
def test_stray_rows_of_other_checksum_counts_shift_no_checksum(ck, monkeypatch, key, count):
    """Every later row's first checksum, of this tensor and of those stacked after it,
    still its own: a shifted one would fail its check."""
    for at in (0, 7):  # a row overlapping no piece, with `count` checksums in the section,
        rows, crcs, c = ck.rows[key], ck.crcs[key], _cols(key)  # before row `at`
        row = np.copy(rows[0])
        row[0], row[c["count"]], row[c["crc_at"]] = 999, count, -1
        inline = rows[:at, c["crc_at"]] < 0  # the rows before it whose checksums are here
        first, extra = int(rows[:at, c["count"]][inline].sum()), np.arange(count) + 99
        ck.write(key, np.insert(rows, at, row, axis=0), np.insert(crcs, first, extra))
    _sound(ck, monkeypatch)


def test_empty_rows_where_pieces_are_passed_over_alike(ck, monkeypatch):
    """Rows of size 0 along a dimension, first in their sections, inside a piece or at
    the boundary of two chunks (checksum not the empty one's): no part, no check."""
    for key, at in (("a", (6, 1)), ("c", (6, 0, 1)), ("b", (6,))):
        rows, c, d = ck.rows[key], _cols(key), len(at)
        empty = rows[3].copy()
        empty[:d], empty[2 * d - 1], empty[3 * d - 1], empty[c["pay_len"]] = at, 0, 0, 0
        empty[c["crc_at"]] = -1  # its checksum in the section, before all others
        ck.write(key, np.vstack([empty, rows]), np.insert(ck.crcs[key], 0, 12345))
    _sound(ck, monkeypatch)


Change = Callable[[np.ndarray, np.ndarray, dict[str, int], Ckpt], tuple[np.ndarray, np.ndarray]]


def _craft(key: str, change: Change) -> Callable[[Ckpt], None]:
    """`key`'s section (rows, checksums) as `change` (given its columns) returns it."""
    return lambda ck: ck.write(
        key, *change(ck.rows[key].copy(), ck.crcs[key].copy(), _cols(key), ck)
    )


def _set(r, x, c, _ck, *, row: int, column: str, value: int):
    r[row, c[column]] = value
    return r, x


def _counted(r, x, c, _ck, *, count: int):
    """Row 4 counts `count` checksums (its grid makes 1): in the section, one more or one
    less there; kept by its writer, never fetched (a count not fitting its grid)."""
    r[4, c["count"]] = count
    if r[4, c["crc_at"]] >= 0:
        return r, x
    return r, np.insert(x, 4, 0) if count == 2 else np.delete(x, 4)


def _twice(r, x, c, ck):  # row 1 again, at the end (kept: its checksums in a slot of its own)
    r = r[[*range(len(r)), 1]]
    if r[-1, c["crc_at"]] < 0:
        return r, x[[*range(len(x)), 1]]
    ck.slot(r[-1])
    return r, x


def _resized(r, x, c, _ck, *, row: int, column: str, by: int):
    """Row `row`'s size along a dimension changed `by`, its tile and byte lengths with it."""
    item = r[row, c["pay_len"]] // np.prod(r[row, c["size"] : c["tile"]])
    r[row, [c[column], c[column] + c["tile"] - c["size"]]] += by
    grow = np.prod(r[row, c["size"] : c["tile"]]) * item - r[row, c["pay_len"]]
    r[row, [c["pay_len"], c["rec_len"]]] += grow
    return r, x


def _bytes_of(r, x, c, ck, *, other: str):
    """Row 4 names bytes of `other`'s row 2 (checksum right): two rows, one range."""
    o, src = _cols(other), ck.rows[other][2]
    n, at = int(r[4, c["pay_len"]]), int(src[o["pay"]])
    r[4, c["rank"] : c["pay_len"] + 1] = (*src[o["rank"] : o["token"] + 1], at, n, at, n)
    data = ck.folder.read(file_of(*src[o["rank"] : o["token"] + 1].tolist()))
    crc = crc32c.crc32c(data[at : at + n])
    if r[4, c["crc_at"]] < 0:
        x[4] = crc
    else:  # its record is its payload: an empty frame
        ck.slot(r[4], [crc32c.crc32c(b""), crc])
    return r, x


def _section_of(key: str, other: str) -> Callable[[Ckpt], None]:
    doc = lambda ck: json.loads(ck.folder.read("shardwise.json"))  # noqa: E731
    return lambda ck: ck.section(key, doc(ck)["tensors"][other]["section"])


KINDS = [  # what, in which tensors, the change
    ("two checksums", "adbce", partial(_counted, count=2)),
    ("no checksum", "adbc", partial(_counted, count=0)),
    ("partial overlap", "adbc", partial(_set, row=1, column="at0", value=3)),
    ("first row away", "adbcf", partial(_set, row=0, column="at0", value=999)),
    ("row 1 away", "adbc", partial(_set, row=1, column="at0", value=999)),
    ("last row away", "adbcf", partial(_set, row=-1, column="at0", value=999)),
    ("a row twice", "adbc", _twice),
    ("past its shape", "adbcf", partial(_resized, row=-1, column="size", by=2)),
    ("half a row", "adc", partial(_resized, row=1, column="last", by=-1)),
    ("payload length", "adbc", partial(_set, row=4, column="pay_len", value=3)),
    ("tile not its size", "adbc", partial(_set, row=4, column="last tile", value=1)),
    ("bytes of e's row", "a", partial(_bytes_of, other="e")),
    ("bytes of a's row", "d", partial(_bytes_of, other="a")),
    ("bytes of f's row", "b", partial(_bytes_of, other="f")),
    ("bytes of b's row", "f", partial(_bytes_of, other="b")),
]
CRAFTS = {f"{k}: {what}": _craft(k, change) for what, keys, change in KINDS for k in keys}
CRAFTS |= {f"{k}: {o}'s section": _section_of(k, o) for k, o in ("ae", "da", "ea", "fb")}


@pytest.mark.parametrize("name", list(CRAFTS))
def test_one_crafted_section_refused_as_one_piece_at_a_time(ck, monkeypatch, name):
    CRAFTS[name](ck)
    alone, old, _ = _load(ck, monkeypatch, batch=False)
    both, new, _ = _load(ck, monkeypatch, batch=True)
    assert old is not None and new == old
    assert _exact(ck, alone, fresh=True) and _exact(ck, both, fresh=True)
