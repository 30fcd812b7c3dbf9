"""Where a rank's records lie: one row of five integers per record, not one object.

A rank keeps its records' places, and an owner those of its keys' records,
from one save to the next (`plan_cache`): 100,000 records as frozen dataclass
instances held 30 MiB of Python objects per rank, the same as an int64 array
of 4 MiB. The places are also what a writer reports to an owner on a first
save (`key_owners.reports_for`): an array pickles as one buffer.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["FIELDS", "Placement", "Places"]

FIELDS = 5  # offset, length, payload, file, crc_at: `Placement`'s, in order


@dataclass(frozen=True)
class Placement:
    """Where one record lies: which of its rank's data files, and where in it."""

    offset: int
    length: int
    payload: int  # absolute offset of a tensor record's payload (of an object: its offset)
    file: int = 0  # index of the rank's data file
    # where the file keeps a tensor record's frame and tile checksums (format version 5:
    # after every record of the file, in record order); -1 for an object
    crc_at: int = -1


class Places:
    """The places of a rank's records, in its write order: `rows[i]` is record i's
    (offset, length, payload, file, crc_at)."""

    __slots__ = ("rows",)

    def __init__(self, rows: np.ndarray | None = None) -> None:
        self.rows = np.zeros((0, FIELDS), np.int64) if rows is None else rows
        assert self.rows.ndim == 2 and self.rows.shape[1] == FIELDS

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> Placement:
        return Placement(*self.rows[i].tolist())

    def files(self) -> int:
        """How many data files the records use."""
        return int(self.rows[:, 3].max()) + 1 if len(self.rows) else 0
