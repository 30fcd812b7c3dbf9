"""The index of a version 4 checkpoint is untrusted input (issue 22): a damaged or crafted
section, index file or pointer into it is refused by `swc.load` with `CorruptCheckpointError`
naming the file and the tensor, before a byte lands in a target: never misread.

Crafted sections are encoded as a writer would (`chunk_table.encode_section`, or edited as
rows), their checksums fixed and the manifest sealed again: only the checks refuse them."""

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
from shardwise.checkpoint.format.chunk_table import ChunkTable, encode_section, row_width
from shardwise.checkpoint.format.manifest import ChunkEntry, Manifest
from shardwise.errors import CorruptCheckpointError
from shardwise.storage import open_folder

from .crafted import resealed

FULL = torch.arange(64.0).reshape(8, 8)
WIDTH = row_width(2)  # int64 columns of a row of 'w'
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
        self.chunks = self.table().entries()
        assert [c.offsets for c in self.chunks] == [(0, 0), (2, 0), (4, 0), (6, 0)]
        (self.data,) = {c.file for c in self.chunks}
        self.at = f"{self.where(self.index)} 'w'"  # how errors about its rows begin

    def where(self, name: str) -> str:
        return self.folder.where(name)

    def table(self) -> ChunkTable:
        assert self.w.section is not None
        _, offset, length, count, _ = self.w.section
        data = self.folder.read(self.index)[offset : offset + length]
        return ChunkTable(data, 2, count, self.w.transforms, "'w'")

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


# a row of 'w', one of its checksums (after its 4 rows), 'v''s section (after 'w''s)
@pytest.mark.parametrize("at, key", [(0, "w"), (4 * WIDTH * 8 + 3, "w"), (600, "v")])
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
    _refused(
        ckpt,
        f"{ckpt.where('shardwise.json')}: sections up to byte {10**6 + 4 * (WIDTH * 8 + 4)} "
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


# -- crafted: sections whose checksums are right ----------------------------------------------


def test_a_chunk_out_of_bounds_is_refused(ckpt):
    last = ckpt.chunks[3]
    ckpt.chunks_as(lambda c: [*c[:3], replace(last, offsets=(7, 0))])
    _refused(
        ckpt,
        f"{ckpt.at}: chunk at offsets (7, 0) has inconsistent sizes or byte ranges "
        f"(file {ckpt.data}, payload {last.payload})",
    )


def test_a_chunk_far_out_of_bounds_is_never_read_and_verify_finds_it(ckpt):
    """A load decodes only the rows overlapping what it loads; `verify` checks them all."""
    far = replace(ckpt.chunks[3], offsets=(100, 0))
    ckpt.chunks_as(lambda c: [*c, far])
    targets = _targets()
    swc.load(targets, ckpt.location)
    assert torch.equal(targets["w"], FULL)
    assert swc.verify(ckpt.location, raise_on_error=False) == [
        f"{ckpt.location}: {ckpt.where('shardwise.json')}: chunk at offsets (100, 0) of 'w' "
        f"has inconsistent sizes or byte ranges (file {ckpt.data}, payload {far.payload})"
    ]


def test_partly_overlapping_chunks_are_refused(ckpt):
    ckpt.chunks_as(lambda c: [c[0], replace(c[1], offsets=(1, 0)), *c[2:]])
    _refused(
        ckpt,
        f"{ckpt.at}: the chunks of 'w (at (0, 0))' (shape (8, 8)) overlap in part at 1 along "
        f"dimension 0: {DAMAGED}",
    )


def test_one_chunk_stored_twice_is_refused(ckpt):
    ckpt.chunks_as(lambda c: [*c, c[1]])
    _refused(
        ckpt,
        f"{ckpt.at}: 'w (at (0, 0))' has two chunks at offsets (2, 0) (sizes (2, 8) and "
        "(2, 8)): damaged or crafted",
    )


def test_a_hole_where_the_load_reads_is_refused(ckpt):
    ckpt.chunks_as(lambda c: [c[0], *c[2:]])
    _refused(
        ckpt,
        f"{ckpt.at}: the chunks of 'w (at (0, 0))' (shape (8, 8)) leave elements 2..4 of "
        f"dimension 0 in no chunk: {DAMAGED}",
    )


def test_a_record_past_the_end_of_its_data_file_is_refused(ckpt):
    size = len(ckpt.folder.read(ckpt.data))
    start = ckpt.chunks[3].record[0]
    ckpt.chunks_as(lambda c: [*c[:3], replace(c[3], record=(start, size))])
    _refused(
        ckpt,
        f"'w': bytes {start}..{start + size} lie past the end of {ckpt.where(ckpt.data)} "
        f"({size} bytes): truncated or damaged",
    )


# the columns of a row of 'w': offsets 0-1, sizes 2-3, tile 4-5, rank 6, k 7, token 8,
# record 9-10, payload 11-12, frame 13, checksum count 14, transform 15
@pytest.mark.parametrize(
    "column, value",
    [(0, -1), (3, -2), (9, -7), (10, -1 << 40), (14, -1), (13, 1 << 62)],
    ids=["offset", "size", "record offset", "record length", "checksum count", "huge"],
)
def test_an_impossible_value_in_a_row_is_refused(ckpt, column, value):
    ckpt.rows_as(2, column, value)
    _refused(ckpt, f"{ckpt.at}: a chunk row holds an impossible value")


@pytest.mark.parametrize(
    "column, value",
    [(15, 4), (8, 1 << 48), (13, 1 << 32), (6, -1), (11, -1)],
    ids=["transform", "token", "frame", "rank", "payload of a plain chunk"],
)
def test_an_impossible_value_in_a_read_row_is_refused(ckpt, column, value):
    ckpt.rows_as(2, column, value)
    _refused(ckpt, f"{ckpt.at}: chunk row 2 holds an impossible value")


@pytest.mark.parametrize("rows, cut", [(5, 0), (4, 1), (3, 0)], ids=["more", "odd", "fewer"])
def test_a_row_count_that_does_not_fit_its_section_is_refused(ckpt, rows, cut):
    rows_, crcs = ckpt.raw()
    data = (rows_.tobytes() + crcs)[: -cut or None]
    ckpt.section(data, rows)
    left = (len(data) - rows * WIDTH * 8) // 4  # what the rows leave for checksums
    _refused(
        ckpt,
        f"{ckpt.at}: its rows count 3 checksums, it holds {left}"
        if rows == 3
        else f"{ckpt.at}: a section of {len(data)} bytes cannot hold {rows} chunk rows",
    )


def test_an_object_naming_a_file_not_ours_is_refused_by_a_load(ckpt):
    """A version 4 load reads its manifest without its chunks, but never an object from
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


def test_two_rows_naming_the_same_record_are_refused(ckpt):
    """Row 1 given row 0's record, payload and checksums: 'w'[2:4] would be filled
    from 'w'[0:2]'s bytes, each checksum matching."""
    first = ckpt.chunks[0]
    ckpt.chunks_as(
        lambda c: [
            c[0],
            replace(
                c[1],
                file=first.file,
                record=first.record,
                payload=first.payload,
                crcs=first.crcs,
                frame=first.frame,
            ),
            *c[2:],
        ]
    )
    _refused(
        ckpt,
        f"'w' and 'w' claim overlapping bytes of {ckpt.where(ckpt.data)} "
        f"(at {first.record[0]}): damaged or crafted records",
    )


def test_a_negative_frame_checksum_is_refused(ckpt):
    ckpt.rows_as(2, WIDTH - 3, -1)  # the frame column
    _refused(ckpt, f"{ckpt.at}: chunk row 2 holds an impossible value")
