"""The commit protocol and atomic file writes: how a save becomes visible beside other files.

A checkpoint folder can hold files that are not ours (a `model.pt`, notes, a
previous checkpoint). So a save never renames or deletes the folder; it works
file by file:

1. every rank writes its data under fresh names that carry its save's token
   (`__0_0.sw1a2b3c4d5e6f.distcp`), so nothing committed is overwritten, and
   fsyncs it;
2. the coordinator fsyncs the folder, then writes DCP's `.metadata`, then
   `shardwise.json`, then (first save only) the marker `.shardwise` that
   makes the folder recognisable as ours even if the manifest is later lost
   — each to a temporary name, fsynced, renamed into place, the folder
   fsynced. The manifest's rename is the commit point for shardwise readers;
   `.metadata`'s for stock readers. Both only ever name durable data;
3. after the commit, files of the previous checkpoint (those its manifest or
   `.metadata` named) and leftovers of interrupted saves (our token-named
   data and temporary files) are removed — unless records of another scope
   (a global checkpoint beside per-rank ones) still name them. Nothing else
   is ever deleted.

Every whole file written for a checkpoint or a conversion (records, marker,
converted outputs) goes through `Folder.write_atomically`: a reader sees all
of it or none.

The folder is a `storage.Folder`, local or under an fsspec URL; the protocol
is the same on both, with "renamed into place" meaning a whole-object PUT
(or server-side copy) on object stores, where a completed upload is durable
and there is no directory to fsync (`storage.remote`).

A crash before step 2 leaves the previous checkpoint as it was (plus
token-named leftovers that the next save collects); a crash between the two
renames leaves stock readers on the new checkpoint and shardwise readers on
the old one, both complete; a crash during step 3 leaves only garbage.
"""

from __future__ import annotations

import io
import json
import os
import re
import uuid
import warnings
from dataclasses import dataclass

from torch.distributed.checkpoint.filesystem import DEFAULT_SUFFIX

from ..storage import Folder, open_folder
from ..storage.folder import TEMPORARY
from .faults import failpoint
from .manifest import MANIFEST, MARKER
from .safe_pickle import load_metadata

__all__ = [
    "METADATA",
    "RecordNames",
    "already_exists",
    "collect",
    "commit",
    "data_file_name",
    "holds_checkpoint",
    "in_the_way",
    "leftover_data",
    "new_token",
    "per_rank_records",
    "referenced_files",
]

METADATA = ".metadata"
FolderLike = Folder | str | os.PathLike  # a Folder, or what `open_folder` opens
# matched with fullmatch: a trailing newline in a name is not ours
_DATA = re.compile(r"__(\d+)_(\d+)\.sw([0-9a-f]{12})" + re.escape(DEFAULT_SUFFIX))
_PER_RANK = re.compile(r"__(\d+)\.(?:metadata|shardwise\.json)")


def new_token() -> str:
    return uuid.uuid4().hex[:12]


def data_file_name(prefix: str, index: int, token: str) -> str:
    """`__{rank}_{index}.sw{token}.distcp`: `prefix` is DCP's `__{rank}_`."""
    return f"{prefix}{index}.sw{token}{DEFAULT_SUFFIX}"


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

    def owns(self, data_name: str) -> bool:
        """Whether a token-named data file is in this record's scope (all ranks, or its rank)."""
        m = _DATA.fullmatch(data_name)
        return m is not None and (self.rank is None or int(m.group(1)) == self.rank)


def holds_checkpoint(folder: FolderLike, names: RecordNames = RecordNames()) -> bool:
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
    folder: FolderLike, names: RecordNames = RecordNames(), *, files: bool = False
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
    return sorted(n for n in folder.names() if _DATA.fullmatch(n))


def commit(
    folder: FolderLike,
    metadata: bytes | str,
    manifest: bytes,
    referenced: set[str],
    names: RecordNames = RecordNames(),
    *,
    sync: bool = True,
) -> list[str]:
    """Make a checkpoint whose data is durable visible; collect what it replaces.

    `metadata` is `.metadata`'s bytes, or the name of a file beside it already
    holding them (`Folder.write_temporary`, written by another rank), moved into place.
    `referenced`: the data files the new records name. Returns the names removed.
    With `sync=False` nothing is fsynced (as stock's `sync_files=False`): a
    power loss may then lose the new checkpoint and the one it replaced.
    """
    folder = open_folder(folder)
    failpoint("before-commit")
    if sync:  # the data files' names, before any record names them
        folder.sync()
    previous = referenced_files(folder, names)
    if isinstance(metadata, str):  # already written, durably, under a temporary name
        folder.replace(metadata, names.metadata)
    else:
        folder.write_durably(names.metadata, metadata, sync=sync)
    if sync:
        folder.sync()
    failpoint("between-records")
    folder.write_durably(names.manifest, manifest, sync=sync)
    # The marker comes last: before the manifest exists it would make a folder
    # whose `.metadata` is complete (stock's, or this save's) read as incomplete.
    if names.rank is None and not folder.has(MARKER):
        folder.write_durably(MARKER, b"shardwise checkpoint folder\n", sync=sync)
    if sync:
        folder.sync()
    failpoint("before-collect")
    return collect(folder, referenced | _named_elsewhere(folder, names), previous, names)


def _named_elsewhere(folder: FolderLike, names: RecordNames) -> set[str]:
    """Files that records of another scope still name (a global checkpoint beside
    per-rank ones, or the other way round): never collected by this one."""
    others = [RecordNames()] if names.rank is not None else []
    others += [r for r in per_rank_records(folder) if r != names]
    found: set[str] = set()
    for other in others:
        found |= referenced_files(folder, other, both=True)
    return found


def collect(
    folder: FolderLike,
    keep: set[str],
    previous: set[str],
    names: RecordNames = RecordNames(),
) -> list[str]:
    """Remove, after a commit, the files the committed records replaced: those
    the previous records named, token-named data no record names, and our
    temporary files. Never anything else, and never a file in `keep`. A file
    that cannot be removed is left for the next save: the commit stands."""
    folder = open_folder(folder)
    removed = []
    for name in folder.names():
        if name in keep:
            continue
        temp = TEMPORARY.fullmatch(name)
        ours = (
            name in previous
            or names.owns(name)
            or (temp is not None and temp.group(1) in (names.metadata, names.manifest, MARKER))
        )
        if ours and folder.removable(name):
            try:
                folder.remove(name)
            except OSError as e:
                warnings.warn(
                    f"could not remove {folder.where(name)} after the commit ({e}); "
                    "the next save retries",
                    stacklevel=2,
                )
                continue
            removed.append(name)
            failpoint("mid-collect")
    return removed


def referenced_files(
    folder: FolderLike, names: RecordNames = RecordNames(), *, both: bool = False
) -> set[str]:
    """The data files the committed records in `folder` name: those of its
    manifest, else (or also, with `both`) of its `.metadata` (read with the safe
    unpickler). Unreadable records name nothing, so their files are never collected."""
    folder = open_folder(folder)
    found: set[str] = set()
    try:
        doc = json.loads(folder.read(names.manifest))
        found |= {c["file"] for t in doc["tensors"].values() for c in t["chunks"]}
        found |= {o["file"] for o in doc["objects"].values()}
        manifest = True
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        manifest = False
    # Without a manifest this is a stock checkpoint (or ours without its manifest,
    # whose token-named files are collected by name anyway).
    if both or not manifest:
        try:
            storage = load_metadata(io.BytesIO(folder.read(names.metadata))).storage_data or {}
            found |= {info.relative_path for info in storage.values()}
        except Exception:  # noqa: BLE001 - a record we cannot read names nothing we may delete
            pass
    return {
        n
        for n in found
        if isinstance(n, str) and n and "/" not in n and "\\" not in n and n not in (".", "..")
    }
