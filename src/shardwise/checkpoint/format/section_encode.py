"""A tensor's chunk entries encoded as its section of the index (`chunk_table` reads it).

Rows of version 5: a chunk with a `crc_at` keeps its frame and checksums in its data
file (a collective save's writers put them there), the others hold theirs in the
section, after the rows.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ...errors import CorruptCheckpointError
from .chunk_table import row_width
from .kept_checksums import written_count
from .manifest_entries import ChunkEntry
from .record_check import DATA_FILE

__all__ = ["encode_section"]


def _file_parts(name: str) -> tuple[int, int, int]:
    found = DATA_FILE.fullmatch(name)
    if found is None:  # every writer names its files so: a writer's bug
        raise CorruptCheckpointError(f"{name!r} is not a data file name a section can hold")
    return int(found.group(1)), int(found.group(2)), int(found.group(3), 16)


def encode_section(chunks: Sequence[ChunkEntry], ndim: int, transforms: list[list[str]]) -> bytes:
    """The section of one tensor's `chunks` (entries as the manifest's model holds
    them); transforms not yet in `transforms` are added to it. A chunk whose
    checksums its writer keeps (`crc_at`) holds its tile grid's count of them there."""
    rows = np.empty((len(chunks), row_width(ndim)), dtype="<i8")
    crcs: list[int] = []
    for i, c in enumerate(chunks):
        if c.transform is None:
            transform = -1
        else:
            if c.transform not in transforms:
                transforms.append(c.transform)
            transform = transforms.index(c.transform)
        tile = c.tile if c.tile is not None else (-1,) * ndim
        payload = c.payload if c.payload is not None else (-1, -1)
        rows[i] = (
            *c.offsets,
            *c.sizes,
            *tile,
            *_file_parts(c.file),
            *c.record,
            *payload,
            c.frame if c.crc_at < 0 else 0,
            len(c.crcs) if c.crc_at < 0 else written_count(c),
            transform,
            c.crc_at,
        )
        if c.crc_at < 0:
            crcs += c.crcs
    return rows.tobytes() + np.asarray(crcs, dtype="<u4").tobytes()
