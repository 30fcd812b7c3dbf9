"""`chunk_table`: a section decodes to the chunks it was encoded from, by lists (a few
rows) and by numpy (many) alike, and both refuse the same impossible rows."""

from __future__ import annotations

import numpy as np
import pytest

from shardwise.checkpoint.format.chunk_table import ChunkTable, encode_section, row_width
from shardwise.checkpoint.format.manifest import ChunkEntry
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
        (row_width(2) - 2, 5, "its rows count"),  # checksums it does not hold
    ],
)
def test_both_decodings_refuse_the_same_rows(n, column, value, message):
    data = bytearray(encode_section(_chunks(n), 2, []))
    rows = np.frombuffer(data, dtype="<i8", count=n * row_width(2)).reshape(n, -1).copy()
    rows[1, column] = value
    data[: rows.nbytes] = rows.tobytes()
    with pytest.raises(CorruptCheckpointError, match=message):
        ChunkTable(bytes(data), 2, n, [["zstd"]], "t")
