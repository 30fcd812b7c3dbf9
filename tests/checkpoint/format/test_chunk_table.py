"""`format.table`: a section decodes to the chunks it was encoded from, by lists (a few
rows) and by numpy (many) alike, in version 4 and 5, and both refuse the same impossible
rows; the checksums of rows whose writers keep them are fetched once, when asked for."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from shardwise.checkpoint.format.manifest import ChunkEntry
from shardwise.checkpoint.format.table import ChunkTable, encode_section, file_of, row_width
from shardwise.errors import CorruptCheckpointError

TOKEN = "0123456789ab"


def _chunks(n: int) -> list[ChunkEntry]:
    """`n` row blocks of 2 x 8 float32 of an (2n, 8) tensor, one tile each; every fifth
    of them transformed (one crc32c of its record, no tile, no payload)."""
    out = []
    for i in range(n):
        file = f"__{i % 3}_{i % 2}.sw{TOKEN}.distcp"
        if i % 5 == 4:
            out.append(
                ChunkEntry((2 * i, 0), (2, 8), file, (1000 * i, 900), None, [i], 7, ["zstd"])
            )
        else:
            payload = (1000 * i + 448, 64)
            out.append(
                ChunkEntry((2 * i, 0), (2, 8), file, (1000 * i, 600), payload, [i], 7, None, (2, 8))
            )
    return out


@pytest.mark.parametrize("n", [1, 16, 17, 40])  # lists up to 16 rows, numpy from 17
def test_a_section_decodes_to_its_chunks(n):
    chunks = _chunks(n)
    transforms: list[list[str]] = []
    table = ChunkTable(encode_section(chunks, 2, transforms), 2, n, transforms, "t")
    assert (table.array is None) == (n <= 16)
    assert len(table) == n and table.entries() == chunks
    assert table.overlapping((3, 2), (4, 1)) == [i for i in (1, 2, 3) if i < n]
    assert table.overlapping((0, 0), (2 * n, 8)) == list(range(n))
    names = {f"__{r}_{k}.sw{TOKEN}.distcp" for r in range(3) for k in range(2)}
    assert table.files() == {c.file for c in chunks} and table.files() <= names


@pytest.mark.parametrize("n", [3, 40])
@pytest.mark.parametrize(
    "column, value, message",
    [
        (0, -1, "a chunk row holds an impossible value"),  # a negative offset
        (5, -2, "a chunk row holds an impossible value"),  # below -1
        (7, 1 << 62, "a chunk row holds an impossible value"),  # too large to add
        (row_width(2) - 3, 5, "its rows count"),  # checksums it does not hold
        (row_width(2) - 1, -2, "a chunk row holds an impossible value"),  # crc_at below -1
    ],
)
def test_both_decodings_refuse_the_same_rows(n, column, value, message):
    data = bytearray(encode_section(_chunks(n), 2, []))
    rows = np.frombuffer(data, dtype="<i8", count=n * row_width(2)).reshape(n, -1).copy()
    rows[1, column] = value
    data[: rows.nbytes] = rows.tobytes()
    with pytest.raises(CorruptCheckpointError, match=message):
        ChunkTable(bytes(data), 2, n, [["zstd"]], "t")


def _v4(data: bytes, n: int, d: int) -> bytes:
    """A version 5 section of inline rows as version 4 wrote it: without `crc_at`."""
    rows = np.frombuffer(data, dtype="<i8", count=n * row_width(d)).reshape(n, -1)
    assert (rows[:, -1] == -1).all()
    return rows[:, :-1].tobytes() + data[rows.nbytes :]


@pytest.mark.parametrize("n", [1, 17])
def test_a_version_4_section_decodes_to_its_chunks(n):
    chunks = _chunks(n)
    transforms: list[list[str]] = []
    data = _v4(encode_section(chunks, 2, transforms), n, 2)
    assert len(data) == n * 16 * 8 + 4 * n
    table = ChunkTable(data, 2, n, transforms, "t", version=4)
    assert (table.array is None) == (n <= 16)
    assert table.entries() == chunks and list(table.crc_at) == [-1] * n
    with pytest.raises(CorruptCheckpointError, match="a section of .* cannot hold"):
        ChunkTable(data, 2, n, transforms, "t")  # read as version 5: a column short


def _kept(n: int) -> list[ChunkEntry]:
    """`_chunks(n)`, every other one's checksums with its writer, at 10000 + 8 i."""
    chunks = _chunks(n)
    for i, c in enumerate(chunks):
        if i % 2 == 0:
            c.crc_at = 10000 + 8 * i
    return chunks


@pytest.mark.parametrize("n", [3, 40])
def test_rows_whose_writers_keep_their_checksums_fetch_them_once(n):
    chunks = _kept(n)
    transforms: list[list[str]] = []
    data = encode_section(chunks, 2, transforms)
    inline = [c for c in chunks if c.crc_at < 0]
    assert len(data) == n * row_width(2) * 8 + 4 * len(inline)  # only theirs in the section
    rows = np.frombuffer(data, dtype="<i8", count=n * row_width(2)).reshape(n, -1)
    assert rows[:, -4].tolist() == [0 if c.crc_at >= 0 else 7 for c in chunks]  # frames
    asked: list[list[tuple]] = []
    by_at = {c.crc_at: (c.frame, c.crcs) for c in chunks}

    def fetch(slots):
        files = [file_of(*f) for f in slots.files.tolist()]
        asked.append(list(zip(files, slots.at.tolist(), slots.count.tolist())))
        got = [by_at[at] for at in slots.at.tolist()]
        frames = np.asarray([frame for frame, _ in got], dtype=np.int64)
        firsts = np.asarray([crcs[0] for _, crcs in got], dtype=np.uint32)
        many = {
            j: np.asarray(crcs, dtype=np.uint32) for j, (_, crcs) in enumerate(got) if len(crcs) > 1
        }
        return frames, firsts, many

    table = ChunkTable(data, 2, n, transforms, "t", fetch=fetch)
    assert list(table.crc_at) == [c.crc_at for c in chunks]
    assert table.entry(2) == dataclasses.replace(chunks[2], crc_at=-1)  # entries: no crc_at
    assert asked == [[(chunks[2].file, 10016, 1)]]
    assert table.candidates(range(n))[0].tolist() == [i for i in range(0, n, 2) if i != 2]
    table.resolve(range(n))  # the rest at once
    assert asked[1:] == [[(c.file, c.crc_at, 1) for c in chunks[::2] if c.crc_at != 10016]]
    assert table.entries() == [dataclasses.replace(c, crc_at=-1) for c in chunks]
    assert len(asked) == 2  # each row fetched once
    if n > 16:
        assert table.first_crcs(np.arange(n)).tolist() == [c.crcs[0] for c in chunks]
    table = ChunkTable(data, 2, n, transforms, "t")  # no files to fetch from: a reader's bug
    with pytest.raises(CorruptCheckpointError, match="t: checksums kept with data, not read"):
        table.entry(0)


@pytest.mark.parametrize("n", [3, 40])
def test_a_row_whose_writer_keeps_its_frame_holds_none(n):
    data = bytearray(encode_section(_kept(n), 2, []))
    rows = np.frombuffer(data, dtype="<i8", count=n * row_width(2)).reshape(n, -1).copy()
    rows[2, -4] = 1  # a frame in the row: where would its checksums be?
    data[: rows.nbytes] = rows.tobytes()
    with pytest.raises(CorruptCheckpointError, match="t: a chunk row holds an impossible value"):
        ChunkTable(bytes(data), 2, n, [["zstd"]], "t")
