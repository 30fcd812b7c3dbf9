"""Crafted sections of the golden checkpoint (`golden_manifest`): model.w's rows in version 4
and 5 as the writers lay them out, and the golden checkpoint with them replaced; shared by
the tests of `format.index` and `format.index`."""

from __future__ import annotations

import json
from pathlib import Path

import crc32c
import numpy as np

from .golden_manifest import (
    INDEX_FILE,
    checksummed,
    compact,
    golden_folder,
    golden_index,
    golden_text,
)

W = {4: 264, 5: 272}  # bytes of model.w's section: 2 rows of 16 (17) int64, 2 uint32 (none)
V4 = [  # model.w's rows in version 4: offsets sizes tile rank k token record payload frame
    [0, 0, 4, 4, 4, 4, 0, 0, 0, 0, 1305, 448, 64, 0, 1, -1],  # crc_count transform
    [4, 0, 2, 4, 2, 4, 0, 0, 0, 1305, 1305, 1753, 32, 0, 1, -1],
]
CRCS = [722256751, 3265927622]
# version 5, as swc.save writes them: then crc_at, the checksums in the data file after
# its last record (the object's, ending at 6353), frame first: none in the section
ROWS = {4: V4, 5: [V4[0] + [6353], V4[1] + [6361]]}
INLINE_CRCS = {4: CRCS, 5: []}


def crafted(
    tmp_path: Path, rows: list[list[int]], crcs: list[int], count: int = -1, version: int = 5
) -> Path:
    """The golden checkpoint of `version` with model.w's section made of `rows` and `crcs`
    (the head pointing at it, its crc32c right; `count` rows when given)."""
    section = np.asarray(rows, dtype="<i8").tobytes() + np.asarray(crcs, dtype="<u4").tobytes()
    doc = json.loads(golden_text(version))
    for t in doc["tensors"].values():
        if t["section"][1]:
            t["section"][1] += len(section) - W[version]
    count = len(rows) if count < 0 else count
    doc["tensors"]["model.w"]["section"] = [0, 0, len(section), count, crc32c.crc32c(section)]
    folder = golden_folder(tmp_path, compact(checksummed(doc)))
    (folder / INDEX_FILE).write_bytes(section + golden_index(version)[W[version] :])
    return folder


def row(version: int, i: int, column: int, value: int) -> list[list[int]]:
    rows = [list(r) for r in ROWS[version]]
    rows[i][column] = value
    return rows


def inline(rows: list[list[int]]) -> list[list[int]]:
    """Version 5 `rows` with row 0's checksums in the section (`crc_at` -1)."""
    return [[*rows[0][:16], -1], rows[1]]


def section_rows(folder: Path, key: str) -> tuple[list[list[int]], list[int]]:
    """The rows (version 5) and checksums of `key`'s section in the checkpoint in `folder`."""
    doc = json.loads((folder / "shardwise.json").read_text())
    block, offset, length, count, _ = doc["tensors"][key]["section"]
    at = doc["index"]["blocks"][block] + offset
    data = (folder / doc["index"]["file"]).read_bytes()[at : at + length]
    width = 3 * len(doc["tensors"][key]["shape"]) + 11
    rows = np.frombuffer(data, dtype="<i8", count=count * width).reshape(count, width)
    return rows.tolist(), np.frombuffer(data[rows.nbytes :], dtype="<u4").tolist()


def resection(folder: Path, key: str, rows: list[list[int]], crcs: list[int]) -> None:
    """The checkpoint in `folder` with `key`'s section made of `rows` and `crcs`: appended to
    its index, the manifest pointing at it, its crc32c right, resealed."""
    doc = json.loads((folder / "shardwise.json").read_text())
    index = folder / doc["index"]["file"]
    section = np.asarray(rows, dtype="<i8").tobytes() + np.asarray(crcs, dtype="<u4").tobytes()
    block = doc["tensors"][key]["section"][0]
    at = index.stat().st_size - doc["index"]["blocks"][block]
    doc["tensors"][key]["section"] = [block, at, len(section), len(rows), crc32c.crc32c(section)]
    with index.open("ab") as f:
        f.write(section)
    (folder / "shardwise.json").write_text(compact(checksummed(doc)))
