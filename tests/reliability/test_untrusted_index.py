"""The index of a version 5 checkpoint is untrusted input (issue 22): a damaged or crafted
section, index file or pointer into it is refused by `swc.load` with `CorruptCheckpointError`
naming the file and the tensor, before a byte lands in a target: never misread.

Crafted sections are encoded as a writer would (`format.table.encode_section`, or edited as
rows), their checksums fixed and the manifest sealed again: only the checks refuse them. Each
row crafted both ways version 5 reads (`form`): its checksums kept by its writer in its data
file (`crc_at`, as `swc.save` writes them; a crafted copy of a row gets its own slot there),
or in the section (`crc_at` -1, as in version 4)."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import crc32c
import numpy as np
import pytest
import torch

import shardwise.checkpoint as swc
from shardwise import Layout, ShardedTensor
from shardwise.checkpoint.format.index import fetcher
from shardwise.checkpoint.format.manifest import ChunkEntry, Manifest
from shardwise.checkpoint.format.table import ChunkTable, encode_section, row_width
from shardwise.errors import CorruptCheckpointError
from shardwise.storage import open_folder

from .crafted import new_slot, resealed

FULL = torch.arange(64.0).reshape(8, 8)
WIDTH = row_width(2)  # int64 columns of a row of 'w'
FRAME, CRC_AT = WIDTH - 4, WIDTH - 1  # its frame's column, and its last: `crc_at`
DAMAGED = "damaged or crafted; refused (nothing a chunk does not hold is ever returned)"


class Ckpt:
    """A saved checkpoint: 'w' (8 x 8) in four row chunks of one file, 'v', an object."""

    def __init__(self, location: str) -> None:
        self.location, self.folder = location, open_folder(location)
        rows = Layout.row_wise((8, 8), [2, 2, 2, 2])
        layout = Layout((8, 8), {0: [b for r in range(4) for b in rows.blocks_of(r)]})
        pieces = [FULL[2 * i : 2 * i + 2] for i in range(4)]
        state = {"w": ShardedTensor.from_layout(layout, pieces), "v": torch.ones(3), "n": 1}
        swc.save(state, location)
        self.folder.write_durably("notes.txt", b"the user's notes\n")
        head = Manifest.read_head(self.folder)
        assert head.index is not None and head.index.blocks == [0]
        self.index = head.index.file
        self.w = head.tensors["w"]
        table = self.table()
        self.chunks = [replace(c, crc_at=int(at)) for c, at in zip(table.entries(), table.crc_at)]
        assert [c.offsets for c in self.chunks] == [(0, 0), (2, 0), (4, 0), (6, 0)]
        assert all(c.crc_at >= 0 and len(c.crcs) == 1 for c in self.chunks)  # with the writer
        (self.data,) = {c.file for c in self.chunks}
        self.at = f"{self.where(self.index)} 'w'"  # how errors about its rows begin

    def where(self, name: str) -> str:
        return self.folder.where(name)

    def table(self) -> ChunkTable:
        assert self.w.section is not None
        _, offset, length, count, _ = self.w.section
        data = self.folder.read(self.index)[offset : offset + length]
        fetch = fetcher(self.folder, self.folder.sizes(), self.index)
        return ChunkTable(data, 2, count, self.w.transforms, "'w'", 5, fetch)

    def use(self, form: str) -> None:
        """'w''s rows from now on in `form`: "kept" (as saved), or "inline" (`crc_at` -1)."""
        if form == "inline":
            self.chunks = [replace(c, crc_at=-1) for c in self.chunks]
            self.chunks_as(lambda c: c)

    def own(self, c: ChunkEntry) -> ChunkEntry:
        """`c` with a slot of its own for its frame and checksums, when its writer keeps
        them: a copy of a row does not share its slot (that overlap is refused first)."""
        words = [c.frame, *c.crcs]
        return c if c.crc_at < 0 else replace(c, crc_at=new_slot(self.folder, c.file, words))

    def raw(self) -> tuple[np.ndarray, bytes]:
        """'w''s section as stored: its rows (a copy, to change) and its checksums' bytes."""
        assert self.w.section is not None
        _, offset, length, count, _ = self.w.section
        data = self.folder.read(self.index)[offset : offset + length]
        head = count * WIDTH * 8
        rows = np.frombuffer(data[:head], dtype="<i8").reshape(count, WIDTH).copy()
        return rows, data[head:]

    def edit(self, change: Callable[[dict[str, Any]], None]) -> None:
        """The manifest's JSON changed by `change`, sealed again."""
        resealed(self.folder, change)

    def section(self, data: bytes, rows: int) -> None:
        """'w''s section replaced by `data` declaring `rows` rows, appended to the index,
        its pointer and checksum right."""
        old = self.folder.read(self.index)
        self.folder.write_durably(self.index, old + data)
        where = [0, len(old), len(data), rows, crc32c.crc32c(data)]
        self.edit(lambda doc: doc["tensors"]["w"].__setitem__("section", where))
        self.w = Manifest.read_head(self.folder).tensors["w"]

    def chunks_as(self, change: Callable[[list[ChunkEntry]], list[ChunkEntry]]) -> None:
        chunks = change(list(self.chunks))
        self.section(encode_section(chunks, 2, list(self.w.transforms)), len(chunks))

    def rows_as(self, row: int, column: int, value: int) -> None:
        rows, crcs = self.raw()
        rows[row, column] = value
        self.section(rows.tobytes() + crcs, len(rows))


@pytest.fixture(params=["local", "memory"])
def ckpt(request, tmp_path) -> Ckpt:
    if request.param == "local":
        return Ckpt(str(tmp_path / "ck"))
    import fsspec

    root = f"memory://index-{os.getpid()}-{id(tmp_path)}"
    request.addfinalizer(lambda: fsspec.filesystem("memory").rm(root, recursive=True))
    return Ckpt(f"{root}/ck")


@pytest.fixture(params=["kept", "inline"])
def form(request) -> str:
    """Where a crafted row's checksums are: with its writer, or in the section."""
    return request.param


def _targets() -> dict[str, Any]:
    return {"w": torch.full((8, 8), -1.0), "v": torch.full((3,), -1.0), "n": -1}


def _refused(ckpt: Ckpt, message: str) -> None:
    """`swc.load` raises exactly `message`, every target as it was."""
    targets = _targets()
    with pytest.raises(CorruptCheckpointError) as info:
        swc.load(targets, ckpt.location)
    assert str(info.value) == message
    assert str(targets) == str(_targets())


def test_a_sound_index_loads(ckpt):
    targets = _targets()
    swc.load(targets, ckpt.location)
    assert torch.equal(targets["w"], FULL) and torch.equal(targets["v"], torch.ones(3))
    assert swc.verify(ckpt.location) == []


# -- damaged: the bytes of the index or the pointers into it --------------------------------


# a row of 'w', its last row's `crc_at` (no checksums follow: its writer keeps them), 'v''s
# section (after 'w''s)
@pytest.mark.parametrize("at, key", [(0, "w"), (4 * WIDTH * 8 - 5, "w"), (600, "v")])
def test_a_flipped_byte_in_a_section_fails_its_checksum(ckpt, at, key):
    data = bytearray(ckpt.folder.read(ckpt.index))
    data[at] ^= 0x10
    ckpt.folder.write_durably(ckpt.index, bytes(data))
    where = ckpt.where(ckpt.index)
    _refused(ckpt, f"{where}: the section of '{key}' does not match its checksum (damaged)")


@pytest.mark.parametrize("keep", [0, 300, 600])  # nothing, into 'w', into 'v'
def test_a_truncated_index_is_refused(ckpt, keep):
    data = ckpt.folder.read(ckpt.index)
    ckpt.folder.write_durably(ckpt.index, data[:keep])
    _refused(
        ckpt,
        f"{ckpt.where('shardwise.json')}: sections up to byte {len(data)} of "
        f"{ckpt.where(ckpt.index)} ({keep} bytes): truncated",
    )


def test_a_section_past_the_end_of_the_index_is_refused(ckpt):
    size = len(ckpt.folder.read(ckpt.index))
    ckpt.edit(lambda doc: doc["tensors"]["w"]["section"].__setitem__(1, 10**6))
    assert ckpt.w.section is not None and ckpt.w.section[2] == 4 * WIDTH * 8  # no checksums
    _refused(
        ckpt,
        f"{ckpt.where('shardwise.json')}: sections up to byte {10**6 + 4 * WIDTH * 8} "
        f"of {ckpt.where(ckpt.index)} ({size} bytes): truncated",
    )


def test_a_block_out_of_range_is_refused(ckpt):
    ckpt.edit(lambda doc: doc["tensors"]["w"]["section"].__setitem__(0, 3))
    _refused(ckpt, f"{ckpt.where('shardwise.json')}: 'w' names block 3 of its index")


def test_an_index_that_is_the_data_file_fails_the_checksums(ckpt):
    ckpt.edit(lambda doc: doc["index"].__setitem__("file", ckpt.data))
    where = ckpt.where(ckpt.data)
    _refused(ckpt, f"{where}: the section of 'w' does not match its checksum (damaged)")


@pytest.mark.parametrize("name", ["notes.txt", "shardwise.json", ".metadata"])
def test_an_index_naming_a_file_not_ours_is_refused(ckpt, name):
    ckpt.edit(lambda doc: doc["index"].__setitem__("file", name))
    why = (
        "is not a shardwise data file (__<rank>_<k>.sw<token>.distcp)"
        if name == "notes.txt"
        else "is one of the checkpoint's own records, not a data file"
    )
    _refused(
        ckpt,
        f"{ckpt.where('shardwise.json')}: 'index' names the file {name!r} in {ckpt.folder}, "
        f"which {why}: the checkpoint is damaged or crafted; refused, nothing read",
    )


@pytest.mark.parametrize("name", ["../x", "/etc/passwd"])
def test_an_index_naming_a_path_out_of_the_folder_is_unreadable(ckpt, name):
    ckpt.edit(lambda doc: doc["index"].__setitem__("file", name))
    _refused(
        ckpt,
        f"{ckpt.where('shardwise.json')}: unreadable manifest: field index.file: expected a "
        f"file name (no `/`, no `..`), got {name!r}",
    )


def test_a_missing_or_linked_index_is_refused(ckpt, tmp_path):
    if ckpt.location.startswith(str(tmp_path)):  # local: a link to a copy outside, never read
        os.replace(ckpt.where(ckpt.index), tmp_path / "outside.distcp")
        os.symlink(tmp_path / "outside.distcp", ckpt.where(ckpt.index))
    else:
        ckpt.folder.remove(ckpt.index)
    _refused(
        ckpt,
        f"{ckpt.where('shardwise.json')}: index file {ckpt.where(ckpt.index)} is missing or "
        "not a plain file (links and folders are refused)",
    )


def test_a_flipped_checksum_kept_by_the_writer_fails_the_load(ckpt):
    """The checksums of 'w''s rows are at their `crc_at` in its data file: one flipped, the
    load reading that chunk fails its checksum (found once read, as a damaged payload is)."""
    c = ckpt.chunks[2]
    data = bytearray(ckpt.folder.read(ckpt.data))
    data[c.crc_at + 4] ^= 0x01  # its tile checksum, after its frame
    ckpt.folder.write_durably(ckpt.data, bytes(data))
    assert c.payload is not None
    at, n = c.payload
    with pytest.raises(CorruptCheckpointError) as info:
        swc.load(_targets(), ckpt.location)
    where = ckpt.where(ckpt.data)
    assert str(info.value) == f"'w': bytes {at}..{at + n} of {where} fail their checksum"


# -- crafted: sections whose checksums are right ----------------------------------------------


def test_a_chunk_out_of_bounds_is_refused(ckpt, form):
    ckpt.use(form)
    last = ckpt.chunks[3]
    ckpt.chunks_as(lambda c: [*c[:3], replace(last, offsets=(7, 0))])
    _refused(
        ckpt,
        f"{ckpt.at}: chunk at offsets (7, 0) has inconsistent sizes or byte ranges "
        f"(file {ckpt.data}, payload {last.payload})",
    )


def test_a_chunk_far_out_of_bounds_is_never_read_and_verify_finds_it(ckpt, form):
    """A load decodes only the rows overlapping what it loads; `verify` checks them all."""
    ckpt.use(form)
    far = ckpt.own(replace(ckpt.chunks[3], offsets=(100, 0)))
    ckpt.chunks_as(lambda c: [*c, far])
    targets = _targets()
    swc.load(targets, ckpt.location)
    assert torch.equal(targets["w"], FULL)
    assert swc.verify(ckpt.location, raise_on_error=False) == [
        f"{ckpt.location}: {ckpt.where('shardwise.json')}: chunk at offsets (100, 0) of 'w' "
        f"has inconsistent sizes or byte ranges (file {ckpt.data}, payload {far.payload})"
    ]


def test_partly_overlapping_chunks_are_refused(ckpt, form):
    ckpt.use(form)
    ckpt.chunks_as(lambda c: [c[0], replace(c[1], offsets=(1, 0)), *c[2:]])
    _refused(
        ckpt,
        f"{ckpt.at}: the chunks of 'w (at (0, 0))' (shape (8, 8)) overlap in part at 1 along "
        f"dimension 0: {DAMAGED}",
    )


def test_one_chunk_stored_twice_is_refused(ckpt, form):
    ckpt.use(form)
    again = ckpt.own(ckpt.chunks[1])
    ckpt.chunks_as(lambda c: [*c, again])
    _refused(
        ckpt,
        f"{ckpt.at}: 'w (at (0, 0))' has two chunks at offsets (2, 0) (sizes (2, 8) and "
        "(2, 8)): damaged or crafted",
    )


def test_a_hole_where_the_load_reads_is_refused(ckpt, form):
    ckpt.use(form)
    ckpt.chunks_as(lambda c: [c[0], *c[2:]])
    _refused(
        ckpt,
        f"{ckpt.at}: the chunks of 'w (at (0, 0))' (shape (8, 8)) leave elements 2..4 of "
        f"dimension 0 in no chunk: {DAMAGED}",
    )


def test_a_record_past_the_end_of_its_data_file_is_refused(ckpt, form):
    ckpt.use(form)
    size = len(ckpt.folder.read(ckpt.data))
    start = ckpt.chunks[3].record[0]
    ckpt.chunks_as(lambda c: [*c[:3], replace(c[3], record=(start, size))])
    _refused(
        ckpt,
        f"'w': bytes {start}..{start + size} lie past the end of {ckpt.where(ckpt.data)} "
        f"({size} bytes): truncated or damaged",
    )


# the columns of a row of 'w': offsets 0-1, sizes 2-3, tile 4-5, rank 6, k 7, token 8,
# record 9-10, payload 11-12, frame 13, checksum count 14, transform 15, crc_at 16
@pytest.mark.parametrize(
    "column, value",
    [(0, -1), (3, -2), (9, -7), (10, -1 << 40), (14, -1), (FRAME, 1 << 62), (CRC_AT, -2)],
    ids=["offset", "size", "record offset", "record length", "checksum count", "huge", "crc_at"],
)
def test_an_impossible_value_in_a_row_is_refused(ckpt, form, column, value):
    ckpt.use(form)
    ckpt.rows_as(2, column, value)
    _refused(ckpt, f"{ckpt.at}: a chunk row holds an impossible value")


@pytest.mark.parametrize(
    "column, value",
    [(15, 4), (8, 1 << 48), (FRAME, 1 << 32), (6, -1), (11, -1)],
    ids=["transform", "token", "frame", "rank", "payload of a plain chunk"],
)
def test_an_impossible_value_in_a_read_row_is_refused(ckpt, form, column, value):
    ckpt.use(form)
    ckpt.rows_as(2, column, value)
    _refused(ckpt, f"{ckpt.at}: {_row_2(ckpt, form, column)}")


def _row_2(ckpt: Ckpt, form: str, column: int) -> str:
    """What is said of row 2 holding a wrong value in `column`. A row whose writer keeps its
    frame holds none (0) in its frame column: any other refuses its section. A row naming
    rank -1 is never fetched from: its entry refuses it, as an inline row's."""
    if form == "kept" and column == FRAME:
        return "a chunk row holds an impossible value"
    return "chunk row 2 holds an impossible value"


@pytest.mark.parametrize("rows, cut", [(5, 0), (4, 1), (3, 0)], ids=["more", "odd", "fewer"])
def test_a_row_count_that_does_not_fit_its_section_is_refused(ckpt, form, rows, cut):
    ckpt.use(form)
    rows_, crcs = ckpt.raw()
    data = (rows_.tobytes() + crcs)[: -cut or None]
    ckpt.section(data, rows)
    left = (len(data) - rows * WIDTH * 8) // 4  # what the rows leave for checksums
    counted = 3 if form == "inline" else 0  # those kept by the writer are not in the section
    _refused(
        ckpt,
        f"{ckpt.at}: its rows count {counted} checksums, it holds {left}"
        if rows == 3
        else f"{ckpt.at}: a section of {len(data)} bytes cannot hold {rows} chunk rows",
    )


def test_an_object_naming_a_file_not_ours_is_refused_by_a_load(ckpt):
    """A version 5 load reads its manifest without its chunks, but never an object from
    a file that is not a data file of ours: the user's file holding the very bytes."""
    head = Manifest.read_head(ckpt.folder)
    n = head.objects["n"]
    data = ckpt.folder.read(n.file)[n.offset : n.offset + n.length]
    ckpt.folder.write_durably("user.txt", data)
    ckpt.edit(lambda doc: doc["objects"]["n"].update(file="user.txt", offset=0))
    _refused(
        ckpt,
        f"{ckpt.where('shardwise.json')}: 'n' names the file 'user.txt' in {ckpt.folder}, "
        "which is not a shardwise data file (__<rank>_<k>.sw<token>.distcp): the checkpoint "
        "is damaged or crafted; refused, nothing read",
    )


def test_two_rows_naming_the_same_record_are_refused(ckpt, form):
    """Row 1 given row 0's record, payload and checksums: 'w'[2:4] would be filled
    from 'w'[0:2]'s bytes, each checksum matching."""
    ckpt.use(form)
    first = ckpt.chunks[0]
    second = ckpt.own(
        replace(
            ckpt.chunks[1],
            file=first.file,
            record=first.record,
            payload=first.payload,
            crcs=first.crcs,
            frame=first.frame,
        )
    )
    ckpt.chunks_as(lambda c: [c[0], second, *c[2:]])
    _refused(
        ckpt,
        f"'w' and 'w' claim overlapping bytes of {ckpt.where(ckpt.data)} "
        f"(at {first.record[0]}): damaged or crafted records",
    )


def test_a_negative_frame_checksum_is_refused(ckpt, form):
    ckpt.use(form)
    ckpt.rows_as(2, FRAME, -1)
    _refused(ckpt, f"{ckpt.at}: {_row_2(ckpt, form, FRAME)}")


@pytest.mark.parametrize("where", ["past the end", "another chunk's"])
def test_a_crafted_crc_at_is_refused_before_a_read(ckpt, where):
    """Row 2's checksums said to be past the end of its data file, or in row 1's slot."""
    size = len(ckpt.folder.read(ckpt.data))
    at = size if where == "past the end" else ckpt.chunks[1].crc_at + 4
    ckpt.rows_as(2, CRC_AT, at)
    why = f"{at}..{at + 8} of data file {ckpt.where(ckpt.data)} ({size} bytes) " + (
        "lie past its end" if where == "past the end" else "overlap another chunk's"
    )
    _refused(ckpt, f"{ckpt.at}: chunk checksums at bytes {why}")
