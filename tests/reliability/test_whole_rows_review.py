"""Review of the whole-chunk load path (commit ffebf91: `engine.stored`,
`format.table`, `format.index`, `format.index`), as an attacker.

Its claim: nothing is accepted as arrays that the one-piece path (`ChunkTable`,
`TensorChunks.covering`, `check_read_ranges`, `format.table.fetchable`) refuses; a
section failing any check is planned alone and raises the very error it raised before.
Each crafted checkpoint here is loaded both ways (arrays, and `take` handing every
section back: the one-piece path) and the outcomes compared, with the groups, batches
and pair bounds made tiny so that boundaries fall between neighbouring tensors.

Two tests show a defect and fail until it is fixed (`test_sections_sharing_index_bytes_*`
and `test_many_keys_naming_one_large_section_*`): sections that overlap in the index
are never refused, so a group holds one copy of the same bytes per key."""

from __future__ import annotations

import json
import random
import shutil
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import crc32c
import numpy as np
import pytest
import torch

import shardwise.checkpoint as swc
from shardwise import Layout, ShardedTensor
from shardwise.checkpoint.engine import stored as stored_view
from shardwise.checkpoint.engine import stored as whole_rows
from shardwise.checkpoint.engine.load import load_state
from shardwise.comm.agreement import Agreement
from shardwise.comm.in_process import ThreadedWorld
from shardwise.storage import open_folder

from ..checkpoint.format.crafted_sections import resection, section_rows
from .crafted import inlined, new_slot, resealed

N = 8
VALUES = {f"t{i:02d}": torch.arange(12.0).reshape(4, 3) + 100 * i for i in range(N)}
# a 2-d row (version 5): offsets sizes tile rank k token record(2) payload(2) frame count
# transform crc_at
SIZES, TILE, RANK, K, TOKEN, RECORD, PAYLOAD, FRAME, COUNT, TRANSFORM, CRC_AT = [
    2, 4, 6, 7, 8, 9, 11, 13, 14, 15, 16
]  # fmt: skip


@pytest.fixture
def small(monkeypatch: pytest.MonkeyPatch) -> set[str]:
    """Tiny groups, batches and pair bounds; the keys the array path took."""
    monkeypatch.setattr(stored_view, "GROUP_SECTIONS", 3)
    monkeypatch.setattr(whole_rows, "BATCH", 2)
    monkeypatch.setattr(whole_rows, "PAIRS", 4)
    taken: set[str] = set()
    take = whole_rows.WholeRows.take

    def counted(self: Any, group: Any) -> Any:
        rest = take(self, group)
        taken.update({s[0] for s in group} - {s[0] for s in rest})
        return rest

    monkeypatch.setattr(whole_rows.WholeRows, "take", counted)
    return taken


def _saved(tmp_path: Path, values: dict[str, Any] | None = None) -> Path:
    path = tmp_path / "ck"
    swc.save(dict(VALUES if values is None else values), path)
    return path


def _targets(values: dict[str, Any] | None = None, dtype: dict[str, torch.dtype] | None = None):
    values = VALUES if values is None else values
    return {
        k: torch.full_like(v, -1.0, dtype=(dtype or {}).get(k, v.dtype)) for k, v in values.items()
    }


def _outcome(
    path: Path,
    monkeypatch: pytest.MonkeyPatch,
    arrays: bool,
    values: dict[str, Any] | None = None,
    **kw: Any,
) -> tuple[str, Any]:
    """("ok", the loaded values) or ("refused", the message); a load refused before its
    reads writes no target (checked). `arrays` False: every section planned alone."""
    with monkeypatch.context() as m:
        if not arrays:
            m.setattr(whole_rows.WholeRows, "take", lambda self, group: group)
        dtype = kw.pop("dtype", None)
        target = _targets(values, dtype)
        try:
            swc.load(target, path, cast_dtype=dtype is not None, **kw)
        except swc.CorruptCheckpointError as e:
            # refused before any read, unless it is the bytes read that fail
            if "fail their checksum" not in str(e):
                assert all((t == -1).all() for t in target.values())
            return "refused", str(e)
    return "ok", {k: v.tolist() for k, v in target.items()}


def _alike(path: Path, monkeypatch: pytest.MonkeyPatch, **kw: Any) -> tuple[str, Any]:
    """The outcome of loading `path`, the same both ways."""
    one = _outcome(path, monkeypatch, False, **kw)
    assert _outcome(path, monkeypatch, True, **kw) == one
    return one


# a change to a section: its rows and checksums, changed in place (the checkpoint's path)
Change = Callable[[list[list[int]], list[int], Path], None]


def _craft(path: Path, key: str, change: Change) -> None:
    rows, crcs = section_rows(path, key)
    change(rows, crcs, path)
    resection(path, key, rows, crcs)


def _exact() -> tuple[str, Any]:
    return "ok", {k: v.tolist() for k, v in VALUES.items()}


# -- the defect: sections overlapping in the index, each key's copy held by its group -------

K_SHARING, SHARED = 48, 1 << 20  # keys naming one section, its bytes


def _sharing(tmp_path: Path, one_row: bool) -> tuple[Path, dict[str, torch.Tensor]]:
    """`K_SHARING` tensors whose manifest entries all name one 1 MiB section appended to
    the index: no rows and a tail of checksums (refused by any `ChunkTable`), or
    (`one_row`) t0's row claiming 262,144 tiles, their checksums in the section."""
    values = {f"k{i:03d}": torch.full((4, 3), float(i)) for i in range(K_SHARING)}
    path = _saved(tmp_path, values)
    doc = json.loads((path / "shardwise.json").read_text())
    index = path / doc["index"]["file"]
    count, section = 0, bytes(SHARED)
    if one_row:
        (row,), _ = section_rows(path, "k000")
        row[FRAME], row[COUNT], row[CRC_AT] = 0, SHARED // 4, -1
        count, section = 1, np.asarray(row, dtype="<i8").tobytes() + bytes(SHARED)
    at = index.stat().st_size - doc["index"]["blocks"][0]
    with index.open("ab") as f:
        f.write(section)
    head = [0, at, len(section), count, crc32c.crc32c(section)]

    def share(d: dict[str, Any]) -> None:
        for t in d["tensors"].values():
            t["section"] = list(head)

    resealed(open_folder(str(path)), share)
    return path, values


def _peak(path: Path, values: dict[str, Any], monkeypatch: pytest.MonkeyPatch, arrays: bool):
    """The message of the refused load of `path`, and the most it held at once (MiB)."""
    tracemalloc.start()
    try:
        kind, message = _outcome(path, monkeypatch, arrays, values)
        peak = tracemalloc.get_traced_memory()[1] / 2**20
    finally:
        tracemalloc.stop()
    assert kind == "refused"
    return message, peak


def test_sections_sharing_index_bytes_are_refused_before_copies_pile_up(
    tmp_path, monkeypatch
) -> None:
    """DEFECT (stored_view.Sections/_groups with whole_rows.take; section_reads.section_bytes):
    48 keys name one 1 MiB section that no `ChunkTable` accepts. Before ffebf91 the first
    was refused at once (about 4 MiB held, measured on `git show ffebf91^`); grouped,
    every key's copy of the same bytes is held, and joined again by `format.table.decode`,
    before any is checked: about 150 MiB here, GROUP_SECTIONS copies of up to the whole
    index in general (4,096 x a 64 MiB index: 768 GiB)."""
    path, values = _sharing(tmp_path, one_row=False)
    message, peak = _peak(path, values, monkeypatch, arrays=True)
    assert "'k000'" in message  # as alone: "its rows count 0 checksums, it holds 262144"
    assert peak < 24, f"{peak:.0f} MiB held for {K_SHARING} copies of one 1 MiB section"


def test_many_keys_naming_one_large_section_hold_it_once(tmp_path, monkeypatch) -> None:
    """DEFECT, older than ffebf91 (its one-piece path held a table per key until
    `engine.stored.GROUP` rows: about 100 MiB here), doubled by it (about 190 MiB as loaded,
    145 with `take` off): sections that overlap in the index are never refused, so what a
    load holds is bounded by neither the index nor the listing, only by keys x index."""
    path, values = _sharing(tmp_path, one_row=True)
    for arrays in (False, True):
        message, peak = _peak(path, values, monkeypatch, arrays)
        assert "'k000'" in message
        assert peak < 24, f"{peak:.0f} MiB held for {K_SHARING} copies of one 1 MiB section"


# -- attacks refused (or loaded) alike both ways: regressions ------------------------------


def test_a_sound_load_across_tiny_groups_is_taken_whole_and_exact(
    tmp_path, monkeypatch, small
) -> None:
    path = _saved(tmp_path)
    assert _alike(path, monkeypatch) == _exact()
    assert small == set(VALUES)


def _set(column: int, value: Any) -> Change:
    def change(rows: list[list[int]], _crcs: list[int], _path: Path) -> None:
        rows[0][column] = value(rows[0]) if callable(value) else value

    return change


def _past_its_file(rows: list[list[int]], _crcs: list[int], _path: Path) -> None:
    shift = (1 << 40) - rows[0][RECORD]
    rows[0][RECORD] += shift
    rows[0][PAYLOAD] += shift


def _index_inline(rows: list[list[int]], crcs: list[int], path: Path) -> None:
    """Its checksums moved into the section (no slot to fetch), its bytes in the index."""
    moved, tiles = inlined(open_folder(str(path)), np.asarray(rows[:1]), 2)
    rows[0] = moved[0].tolist()
    rows[0][K] = 1
    crcs[:] = tiles.tolist()


# each a row crafted as the array path must refuse, and the message the one-piece path gives
CRAFTS = {
    "token -1": (_set(TOKEN, -1), "missing"),
    "token 2**48": (_set(TOKEN, 1 << 48), "impossible value"),
    "rank -1": (_set(RANK, -1), "impossible value"),
    "k names the index": (_set(K, 1), "is the index"),
    "k names the index, inline": (_index_inline, "would be read from the index file"),
    "frame kept, nonzero": (_set(FRAME, 5), "impossible value"),
    "transform 0": (_set(TRANSFORM, 0), "impossible value"),
    "tile not the size": (_set(TILE, 2), "inconsistent sizes"),
    "payload before record": (_set(PAYLOAD, lambda r: r[RECORD] - 1), "inconsistent sizes"),
    "payload past record": (
        _set(PAYLOAD, lambda r: r[RECORD] + r[RECORD + 1] - 47),
        "inconsistent",
    ),
    "payload a byte short": (_set(PAYLOAD + 1, 47), "inconsistent sizes"),
    "record past its file": (_past_its_file, "past"),
    "count 0": (_set(COUNT, 0), "inconsistent sizes"),
    "slot past its file": (_set(CRC_AT, 1 << 40), "lie past its end"),
    "size past the shape": (_set(SIZES + 1, 4), "inconsistent sizes"),
    "offset 2**62": (_set(0, 1 << 62), "impossible value"),
}


LATE = {
    "token -1",
    "k names the index",
    "k names the index, inline",
    "record past its file",
    "slot past its file",
}


@pytest.mark.parametrize("key", ["t02", "t03"])  # the last of a group, the first of the next
@pytest.mark.parametrize("craft", list(CRAFTS))
def test_a_crafted_column_is_refused_alike(tmp_path, monkeypatch, small, key, craft) -> None:
    change, words = CRAFTS[craft]
    path = _saved(tmp_path)
    _craft(path, key, change)
    kind, message = _alike(path, monkeypatch)
    assert kind == "refused" and words in message
    # a row whose names or byte ranges are what is wrong passes the row checks both
    # ways: refused once every range is known (`check_read_ranges`, the slot fetch)
    assert (key in small) == (craft in LATE)


def test_a_zero_size_row_over_a_whole_chunk_is_ignored_alike(tmp_path, monkeypatch, small) -> None:
    """A row with an empty box where the piece is overlaps nothing (both ways): the piece
    is still the one chunk, read exactly."""

    def empty_twin(rows: list[list[int]], _crcs: list[int], _path: Path) -> None:
        twin = list(rows[0])
        twin[SIZES] = twin[TILE] = 0
        twin[CRC_AT] = -1  # its checksums in the section: none (`count` 1 would be one)
        twin[COUNT] = 0
        rows.append(twin)

    path = _saved(tmp_path)
    _craft(path, "t03", empty_twin)
    assert _alike(path, monkeypatch) == _exact()
    assert "t03" in small


def test_a_duplicate_row_is_refused_alike(tmp_path, monkeypatch, small) -> None:
    path = _saved(tmp_path)
    _craft(path, "t03", lambda rows, _c, _p: rows.append(list(rows[0])))
    kind, message = _alike(path, monkeypatch)
    assert kind == "refused" and "'t03'" in message
    assert "t03" not in small


def test_two_keys_naming_one_section_are_refused_alike(tmp_path, monkeypatch, small) -> None:
    path = _saved(tmp_path)
    resealed(
        open_folder(str(path)),
        lambda d: d["tensors"]["t05"].__setitem__("section", list(d["tensors"]["t04"]["section"])),
    )
    kind, message = _alike(path, monkeypatch)
    assert kind == "refused" and "overlap" in message


def test_a_row_claiming_an_objects_bytes_is_refused_alike(tmp_path, monkeypatch, small) -> None:
    values = {**VALUES, "n": list(range(40))}
    path = _saved(tmp_path, values)
    doc = json.loads((path / "shardwise.json").read_text())
    obj = doc["objects"]["n"]

    def onto_object(rows: list[list[int]], _crcs: list[int], _path: Path) -> None:
        rows[0][RECORD : RECORD + 4] = [obj["offset"], 48, obj["offset"], 48]

    _craft(path, "t03", onto_object)
    for arrays in (False, True):
        with monkeypatch.context() as m:
            if not arrays:
                m.setattr(whole_rows.WholeRows, "take", lambda self, group: group)
            target = {**_targets(), "n": None}
            with pytest.raises(swc.CorruptCheckpointError, match="overlapping"):
                swc.load(target, path)


@pytest.mark.parametrize("verify", [True, False])
def test_a_slot_shared_by_an_array_piece_and_a_one_piece_row_is_refused(
    tmp_path, monkeypatch, small, verify
) -> None:
    """t03 is cast (planned one piece at a time), t02 taken as arrays: their kept
    checksum slots are checked together, whichever path found each."""
    path = _saved(tmp_path)
    (other,), _ = section_rows(path, "t02")
    _craft(path, "t03", _set(CRC_AT, other[CRC_AT]))
    for arrays in (False, True):  # the first of the two found names it: either key
        kind, message = _outcome(
            path, monkeypatch, arrays, verify=verify, dtype={"t03": torch.float64}
        )
        assert kind == "refused" and "overlap another chunk's" in message
    assert "t02" in small and "t03" not in small


def test_a_wrong_kept_checksum_fails_alike_and_not_verifying_reads_alike(
    tmp_path, monkeypatch, small
) -> None:
    path = _saved(tmp_path)
    folder = open_folder(str(path))
    (row,), _ = section_rows(path, "t03")
    name = f"__{row[RANK]}_{row[K]}.sw{row[TOKEN]:012x}.distcp"
    _craft(path, "t03", _set(CRC_AT, new_slot(folder, name, [0, 12345])))
    kind, message = _alike(path, monkeypatch)
    assert kind == "refused" and "'t03'" in message and "checksum" in message
    assert _alike(path, monkeypatch, verify=False) == _exact()


def test_a_piece_over_two_rows_is_planned_alone_and_exact(tmp_path, monkeypatch, small) -> None:
    """'w' saved in four row chunks, loaded as two pieces of two rows each."""
    full = torch.arange(64.0).reshape(8, 8)
    rows = Layout.row_wise((8, 8), [2, 2, 2, 2])
    four = Layout((8, 8), {0: [b for r in range(4) for b in rows.blocks_of(r)]})
    halves = Layout.row_wise((8, 8), [4, 4])
    two = Layout((8, 8), {0: [b for r in range(2) for b in halves.blocks_of(r)]})
    path = tmp_path / "ck"
    swc.save(
        {"w": ShardedTensor.from_layout(four, [full[2 * i : 2 * i + 2] for i in range(4)])}, path
    )
    for arrays in (False, True):
        with monkeypatch.context() as m:
            if not arrays:
                m.setattr(whole_rows.WholeRows, "take", lambda self, group: group)
            w = ShardedTensor.from_layout(two, [torch.zeros(4, 8), torch.zeros(4, 8)])
            swc.load({"w": w}, path)
            assert torch.equal(torch.cat(list(w.local_shards())), full)
    assert "w" not in small


def test_scalars_are_planned_alone_and_a_crafted_one_refused_alike(
    tmp_path, monkeypatch, small
) -> None:
    values = {**VALUES, "s": torch.tensor(2.5)}
    path = _saved(tmp_path, values)
    assert _alike(path, monkeypatch, values=values) == (
        "ok",
        {k: v.tolist() for k, v in values.items()},
    )
    assert "s" not in small
    rows, crcs = section_rows(path, "s")
    rows[0][5] += 1  # payload length (a 0-d row: rank k token record payload ...)
    resection(path, "s", rows, crcs)
    kind, message = _alike(path, monkeypatch, values=values)
    assert kind == "refused" and "'s'" in message


def test_cast_pieces_are_planned_alone_and_exact(tmp_path, monkeypatch, small) -> None:
    path = _saved(tmp_path)
    kind, got = _alike(path, monkeypatch, dtype={"t01": torch.float64, "t04": torch.float16})
    assert kind == "ok" and got == _exact()[1]
    assert small == set(VALUES) - {"t01", "t04"}
    _craft(path, "t04", _set(SIZES, 5))
    kind, message = _alike(path, monkeypatch, dtype={"t04": torch.float64})
    assert kind == "refused" and "'t04'" in message and "inconsistent sizes" in message


def _as_version_4(path: Path) -> None:
    """The checkpoint at `path` as a version 4 writer wrote it: every row's frame and
    checksums in its section, no `crc_at` column."""
    folder = open_folder(str(path))
    for key in VALUES:
        rows, crcs = inlined(folder, np.asarray(section_rows(path, key)[0]), 2)
        resection(path, key, rows[:, :-1].tolist(), crcs.tolist())
    resealed(folder, lambda d: d.__setitem__("version", 4))


def test_a_version_4_checkpoint_is_taken_whole_and_a_bad_checksum_refused_alike(
    tmp_path, monkeypatch, small
) -> None:
    path = _saved(tmp_path)
    _as_version_4(path)
    assert _alike(path, monkeypatch) == _exact()
    assert small == set(VALUES)
    small.clear()
    doc = json.loads((path / "shardwise.json").read_text())
    data = (path / doc["index"]["file"]).read_bytes()
    block, at, length, count, _ = doc["tensors"]["t06"]["section"]
    start = doc["index"]["blocks"][block] + at
    rows = np.frombuffer(data, "<i8", count * 16, start).reshape(count, 16).tolist()
    resection(path, "t06", rows, [1])  # its one checksum wrong
    kind, message = _alike(path, monkeypatch)
    assert kind == "refused" and "'t06'" in message and "checksum" in message
    assert "t06" in small  # the row is sound: its bytes are what fails


def test_a_crafted_row_of_a_value_another_rank_reads_is_refused_on_both(tmp_path) -> None:
    """Two thread ranks load every tensor whole: each reads half and is sent the rest;
    a crafted row is refused on both, whichever rank reads it."""
    path = _saved(tmp_path)
    _craft(path, "t05", _set(SIZES, 5))

    def one(c: Any) -> None:
        target = _targets()
        agreement = Agreement(c, ("load", ("p",)))
        load_state(
            target, path, agreement, strict=True, verify=True, cast_dtype=False, broadcast=True
        )

    results = ThreadedWorld(2, 20.0).run(one)
    assert all(isinstance(r, swc.CorruptCheckpointError) for r in results)
    assert all("'t05'" in str(r) and "inconsistent sizes" in str(r) for r in results)


def test_seeded_random_crafts_are_refused_or_loaded_alike(tmp_path, monkeypatch, small) -> None:
    """Forty random crafts (a column of one or two rows set to a boundary value, a row
    copied, another key's bytes or slot claimed): the same outcome both ways, never
    another exception, never wrong values."""
    base = _saved(tmp_path)
    rng = random.Random(22)
    keys = list(VALUES)
    for trial in range(40):
        path = Path(shutil.copytree(base, tmp_path / f"c{trial}"))
        for _ in range(rng.choice([1, 2])):
            key, other = rng.choice(keys), rng.choice(keys)
            theirs = section_rows(path, other)[0][0]
            rows, crcs = section_rows(path, key)
            what = rng.randrange(4)
            if what == 0:
                col = rng.randrange(len(rows[0]))
                cur = rows[0][col]
                rows[0][col] = rng.choice([-2, -1, 0, 1, 4, 5, cur - 1, cur + 1, 1 << 48, 1 << 62])
            elif what == 1:
                rows.append(list(rows[0]))
            elif what == 2:
                rows[0][RECORD : RECORD + 4] = theirs[RECORD : RECORD + 4]
            else:
                rows[0][CRC_AT] = theirs[CRC_AT]
            resection(path, key, rows, crcs)
        # which of two crafted rows is named first may differ: the outcome may not
        kind, got = _outcome(path, monkeypatch, False)
        assert _outcome(path, monkeypatch, True)[0] == kind
        assert kind == "refused" or got == _exact()[1]
        shutil.rmtree(path)


def test_a_whole_row_claiming_a_gathered_rows_bytes_is_refused_alike(tmp_path, monkeypatch) -> None:
    """'w' (32 row chunks, a numpy table) loaded as two halves: its rows found as arrays
    one piece at a time (`format.table`, `RowSpans.add`); t02, a whole chunk (`add_many`),
    claims the bytes of w's sixth chunk: the ranges of both kinds are checked together."""
    full = torch.arange(128.0).reshape(32, 4)
    single = Layout.row_wise((32, 4), [1] * 32)
    many = Layout((32, 4), {0: [b for r in range(32) for b in single.blocks_of(r)]})
    halves = Layout.row_wise((32, 4), [16, 16])
    two = Layout((32, 4), {0: [b for r in range(2) for b in halves.blocks_of(r)]})
    values: dict[str, Any] = {f"t{i:02d}": torch.arange(12.0).reshape(4, 3) for i in range(4)}
    path = tmp_path / "ck"
    swc.save(
        {**values, "w": ShardedTensor.from_layout(many, [full[i : i + 1] for i in range(32)])}, path
    )
    w_rows, _ = section_rows(path, "w")

    def onto_w(rows: list[list[int]], _crcs: list[int], _path: Path) -> None:
        rows[0][RECORD : RECORD + 3] = w_rows[5][RECORD : RECORD + 3]  # its payload: 48 bytes

    _craft(path, "t02", onto_w)
    for arrays in (False, True):
        with monkeypatch.context() as m:
            if not arrays:
                m.setattr(whole_rows.WholeRows, "take", lambda self, group: group)
            w = ShardedTensor.from_layout(two, [torch.zeros(16, 4), torch.zeros(16, 4)])
            target = {**{k: torch.zeros(4, 3) for k in values}, "w": w}
            with pytest.raises(swc.CorruptCheckpointError, match="'w' and 't02' claim overlapping"):
                swc.load(target, path)
