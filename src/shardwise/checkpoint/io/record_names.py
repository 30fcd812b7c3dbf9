"""The names of a checkpoint's records and data files, and what a folder already holds.

A save writes its data under fresh token-named files (`data_file_name`) and
commits the records of one scope (`RecordNames`: the global records, or one
rank's when DCP saves without collectives); these helpers say which names are
whose, and whether a save without overwrite would replace a checkpoint.
"""

from __future__ import annotations

import os
import re
import uuid
from collections.abc import Iterable
from dataclasses import dataclass

from torch.distributed.checkpoint.filesystem import DEFAULT_SUFFIX

from ...storage import Folder, open_folder
from ..format.manifest import MANIFEST, MARKER
from ..format.record_check import DATA_FILE
from .lock_record import lock_name

__all__ = [
    "GLOBAL_RECORDS",
    "METADATA",
    "FolderLike",
    "RecordNames",
    "already_exists",
    "data_file_name",
    "holds_checkpoint",
    "in_the_way",
    "index_file_name",
    "leftover_data",
    "new_token",
    "per_rank_records",
]

METADATA = ".metadata"
FolderLike = Folder | str | os.PathLike  # a Folder, or what `open_folder` opens
_PER_RANK = re.compile(r"__(\d+)\.(?:metadata|shardwise\.json)", re.ASCII)


def new_token() -> str:
    return uuid.uuid4().hex[:12]


def data_file_name(prefix: str, index: int, token: str) -> str:
    """`__{rank}_{index}.sw{token}.distcp`: `prefix` is DCP's `__{rank}_`."""
    return f"{prefix}{index}.sw{token}{DEFAULT_SUFFIX}"


def index_file_name(written: Iterable[str], rank: int, token: str) -> str:
    """The name of a save's index file (format version 4): the next data file of
    `rank` in the save of `token`, given the data files it `written`."""
    ks = [
        int(m.group(2))
        for m in map(DATA_FILE.fullmatch, written)
        if m is not None and int(m.group(1)) == rank and m.group(3) == token
    ]
    return data_file_name(f"__{rank}_", 1 + max(ks, default=-1), token)


@dataclass(frozen=True)
class RecordNames:
    """The commit records of one checkpoint: the global ones, or one rank's
    when DCP saves without collectives (`__{rank}.metadata`)."""

    rank: int | None = None

    @property
    def metadata(self) -> str:
        return METADATA if self.rank is None else f"__{self.rank}{METADATA}"

    @property
    def manifest(self) -> str:
        return MANIFEST if self.rank is None else f"__{self.rank}.{MANIFEST}"

    @property
    def lock(self) -> str:
        """The lease's lock record of this scope (`lease.py`): never a checkpoint record."""
        return lock_name(self.rank)

    def owns(self, data_name: str) -> bool:
        """Whether a token-named data file is in this record's scope (all ranks, or its rank)."""
        m = DATA_FILE.fullmatch(data_name)
        return m is not None and (self.rank is None or int(m.group(1)) == self.rank)


GLOBAL_RECORDS = RecordNames()  # the global records: `.metadata`, `shardwise.json`


def holds_checkpoint(folder: FolderLike, names: RecordNames = GLOBAL_RECORDS) -> bool:
    """Whether `folder` already holds a checkpoint (stock or ours, committed or not)."""
    folder = open_folder(folder)
    candidates = {names.metadata, names.manifest, RecordNames(0).metadata, RecordNames(0).manifest}
    if names.rank is None:
        candidates.add(MARKER)
    return not candidates.isdisjoint(folder.names())


def per_rank_records(folder: FolderLike) -> list[RecordNames]:
    """The per-rank records (`__{rank}.metadata`, saved without collectives) in `folder`."""
    folder = open_folder(folder)
    found = {int(m.group(1)) for n in folder.names() if (m := _PER_RANK.fullmatch(n))}
    return [RecordNames(r) for r in sorted(found)]


def already_exists(folder: FolderLike) -> str:
    """The one message for an output that is already there, naming the fix."""
    folder = open_folder(folder)
    if folder.is_file():
        return f"{folder} already exists; pass overwrite=True"
    return f"Checkpoint already exists at {folder}; pass overwrite=True to replace it"


def in_the_way(
    folder: FolderLike, names: RecordNames = GLOBAL_RECORDS, *, files: bool = False
) -> str | None:
    """`already_exists(folder)` when it holds a checkpoint (or, with `files`, is a
    file), else None: what a save, reshard or convert without overwrite refuses."""
    folder = open_folder(folder)
    if (files and folder.is_file()) or holds_checkpoint(folder, names):
        return already_exists(folder)
    return None


def leftover_data(folder: FolderLike) -> list[str]:
    """Token-named data files: what an interrupted save leaves behind."""
    folder = open_folder(folder)
    return sorted(n for n in folder.names() if DATA_FILE.fullmatch(n))
