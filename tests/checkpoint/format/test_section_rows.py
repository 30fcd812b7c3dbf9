"""`format.table.decode`: a group of sections decoded at once accepts exactly the sections
`ChunkTable` accepts (a refused one is only marked: its caller decodes it alone, and the
table names what is wrong), and gives the same rows and first checksums for them."""

from __future__ import annotations

import numpy as np
import pytest

from shardwise.checkpoint.format.table import ChunkTable, decode
from shardwise.errors import CorruptCheckpointError

from .crafted_sections import CRCS, ROWS, row


def _bytes(rows: list[list[int]], crcs: list[int], extra: bytes = b"") -> bytes:
    return np.asarray(rows, dtype="<i8").tobytes() + np.asarray(crcs, dtype="<u4").tobytes() + extra


def _table(data: bytes, count: int, version: int) -> ChunkTable | None:
    try:
        return ChunkTable(data, 2, count, [], "s", version)
    except CorruptCheckpointError:
        return None


FRAME, COUNT = 13, 14
# (version, its bytes, its row count): model.w's section, sound or crafted
CASES = {
    "v5": (5, _bytes(ROWS[5], []), 2),
    "v4": (4, _bytes(ROWS[4], CRCS), 2),
    "v5 inline": (5, _bytes([[*ROWS[5][0][:16], -1], ROWS[5][1]], CRCS[:1]), 2),
    "below -1": (5, _bytes(row(5, 1, 9, -2), []), 2),
    "2**62": (5, _bytes(row(5, 0, 11, 1 << 62), []), 2),
    "count < 0": (4, _bytes(row(4, 0, COUNT, -1), CRCS), 2),
    "size < 0": (5, _bytes(row(5, 1, 2, -1), []), 2),
    "kept frame": (5, _bytes(row(5, 0, FRAME, 7), []), 2),
    "a checksum more": (4, _bytes(ROWS[4], [*CRCS, 5]), 2),
    "a checksum less": (4, _bytes(ROWS[4], CRCS[:1]), 2),
    "huge count": (4, _bytes(row(4, 0, COUNT, 1 << 61), CRCS), 2),
    "odd tail": (5, _bytes(ROWS[5], [], b"\0\0"), 2),
    "a row short": (5, _bytes(ROWS[5], [])[:-8], 2),
    "more rows named": (5, _bytes(ROWS[5], []), 3),
    "no rows": (5, b"", 0),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_group_accepts_what_a_table_accepts_with_its_rows(case: str) -> None:
    version, data, count = CASES[case]
    sound = CASES["v5" if version == 5 else "v4"]
    group = [sound[1:], (data, count), sound[1:]]
    out = decode(group, 2, version)
    tables = [_table(d, n, version) for d, n in group]
    assert out.ok.tolist() == [True, tables[1] is not None, True]
    head = count * 8 * (17 if version == 5 else 16)
    fits = len(data) >= head and (len(data) - head) % 4 == 0  # else no row is decoded
    assert out.count.tolist() == [2, count if fits else 0, 2]
    for s, table in enumerate(tables):
        if table is None:
            continue
        mine = slice(int(out.start[s]), int(out.start[s] + out.count[s]))
        assert out.columns[mine].tolist() == [list(r) for r in table.rows]
        assert out.crc_at[mine].tolist() == list(table.crc_at)
        inline = [
            table.crcs[table.starts[i]] if table.starts[i + 1] > table.starts[i] else 0
            for i in range(count if s == 1 else 2)
        ]
        assert out.first[mine].tolist() == inline


def test_the_first_checksums_of_inline_rows_follow_each_sections_own() -> None:
    v4 = CASES["v4"]
    out = decode([v4[1:], v4[1:], v4[1:]], 2, 4)
    assert out.first.tolist() == CRCS * 3 and out.sec.tolist() == [0, 0, 1, 1, 2, 2]
