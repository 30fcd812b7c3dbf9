"""The commit protocol: how a save becomes visible beside other files, and what it
replaces is removed.

Atomic file writes; the names of a checkpoint's records and data files and
what a folder already holds; collection after a commit (only the files the
replaced records named, and only ones we wrote); and the failpoints the crash
tests kill a process at (`SHARDWISE_FAILPOINT=name[@rank]`).
"""

from __future__ import annotations

import io
import os
import re
import signal
import time
import uuid
import warnings
from collections.abc import Iterable
from pathlib import Path

from torch.distributed.checkpoint.filesystem import DEFAULT_SUFFIX

from ...errors import CorruptCheckpointError
from ...storage import Folder, open_folder
from ...storage.folder import TEMPORARY
from ..format import (
    DATA_FILE,
    GLOBAL_RECORDS,
    MARKER,
    Manifest,
    RecordNames,
    load_metadata,
    read_sections,
)
from .lease import Lease, live_scopes

__all__ = [
    "FolderLike",
    "PAUSE_S",
    "already_exists",
    "collect",
    "commit",
    "data_file_name",
    "failpoint",
    "holds_checkpoint",
    "in_the_way",
    "index_file_name",
    "leftover_data",
    "new_token",
    "per_rank_records",
    "referenced_files",
    "replaced_files",
]


# -----------------------------------------------------------------------------
# The names of a checkpoint's records and data files, and what a folder already holds.
#
# A save writes its data under fresh token-named files (`data_file_name`) and
# commits the records of one scope (`RecordNames`: the global records, or one
# rank's when DCP saves without collectives); these helpers say which names are
# whose, and whether a save without overwrite would replace a checkpoint.
# -----------------------------------------------------------------------------

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


# -----------------------------------------------------------------------------
# Failpoints for crash tests: `SHARDWISE_FAILPOINT=name[@rank]` kills this process there.
#
# The reliability suite sets it in a subprocess to SIGKILL a save at a chosen
# step (optionally on one rank only) and then checks that nothing committed
# earlier was lost. Unset, a failpoint costs one dictionary lookup.
#
# Points, in the order a save reaches them: before-write, mid-data (after the
# first item of a data file), after-data (data fsynced), before-commit,
# between-records (`.metadata` in place, the manifest not yet), before-collect
# (committed, the replaced files not yet removed), mid-collect (after the first
# removal). See `commit.py` for what each step leaves on disk.
#
# `SHARDWISE_PAUSEPOINT=name[@rank]` with `SHARDWISE_PAUSE_DIR=dir` pauses there
# instead: the process creates `dir/reached` and waits (up to `PAUSE_S`) until
# `dir/go` exists, so a test can act (start a second save, kill this one) while
# this save is held at a known step.
# -----------------------------------------------------------------------------

PAUSE_S = 120.0


def _here(spec: str, name: str) -> bool:
    point, _, rank = spec.partition("@")
    if point != name:
        return False
    return not rank or os.environ.get("SHARDWISE_RANK", os.environ.get("RANK")) == rank


def failpoint(name: str) -> None:
    spec = os.environ.get("SHARDWISE_FAILPOINT")
    if spec and _here(spec, name):
        os.kill(os.getpid(), signal.SIGKILL)
    pause = os.environ.get("SHARDWISE_PAUSEPOINT")
    if pause and _here(pause, name):
        where = Path(os.environ["SHARDWISE_PAUSE_DIR"])
        (where / "reached").touch()
        deadline = time.monotonic() + PAUSE_S
        while not (where / "go").exists() and time.monotonic() < deadline:
            time.sleep(0.01)


# -----------------------------------------------------------------------------
# Collection after a commit: which files the committed records replaced, and their removal.
#
# Only files a replaced record of the same scope named, token-named leftovers of
# dead saves and temporary files of the scope's records are ever removed, and
# never one that a committed record of any scope still names (see `collect`).
# -----------------------------------------------------------------------------

# what stock `FileSystemWriter` names its data files: collected only when a replaced
# record names them (never as leftovers: no token says which save wrote them)
_STOCK_DATA = re.compile(r"__(\d+)_(\d+)" + re.escape(DEFAULT_SUFFIX), re.ASCII)


def _named_elsewhere(folder: FolderLike, names: RecordNames) -> set[str]:
    """Files that records of another scope still name (a global checkpoint beside
    per-rank ones, or the other way round): never collected by this one."""
    others = [GLOBAL_RECORDS] if names.rank is not None else []
    others += [r for r in per_rank_records(folder) if r != names]
    found: set[str] = set()
    for other in others:
        found |= referenced_files(folder, other, both=True)
    return found


def _data_rank(name: str) -> int | None:
    """The rank of a data file named as ours or as stock DCP names them, else None."""
    m = DATA_FILE.fullmatch(name) or _STOCK_DATA.fullmatch(name)
    return int(m.group(1)) if m is not None else None


def collect(
    folder: FolderLike,
    keep: set[str],
    previous: set[str],
    names: RecordNames = GLOBAL_RECORDS,
    *,
    lease: Lease | None = None,
) -> list[str]:
    """Remove, after a commit, what the committed records replaced. A file goes only
    if it is a plain file (never a link or folder), no committed record of any
    scope names it (`keep`, and records of other scopes), and it is one of:

    - a data file (our token-named pattern, or stock's `__{rank}_{k}.distcp`) that a
      replaced record of this scope names (`previous`, from `replaced_files`);
    - a token-named data file of this scope that no record names: a leftover of a
      dead save — unless a live lease of another save covering its rank is in the
      folder (`lease.live_scopes`: an unreadable lock record counts as live, and no
      lock record, however crafted, makes this raise; this save's own lease keeps
      same-scope saves out);
    - a temporary file of this scope's records or lock (`NAME.sw{token}.tmp`).

    Records, the marker, lock records and every other name are never touched. A
    file that cannot be removed is left for the next save: the commit stands."""
    folder = open_folder(folder)
    listed = folder.names()
    # The leases after the listing, the other scopes' records after the leases: a save
    # that began after the listing wrote nothing listed, one that ended before the
    # lease check has committed records that `_named_elsewhere` reads.
    busy = live_scopes(folder, listed, lease)
    keep = keep | _named_elsewhere(folder, names)
    temporaries = {names.metadata, names.manifest, names.lock}
    if names.rank is None:
        temporaries.add(MARKER)
    removed = []
    for name in listed:
        if name in keep:
            continue
        temp = TEMPORARY.fullmatch(name)
        leftover = names.owns(name) and not ({None, _data_rank(name)} & busy)
        ours = (
            (name in previous and _data_rank(name) is not None)
            or leftover
            or (temp is not None and temp.group(1) in temporaries)
        )
        if ours and folder.removable(name):
            try:
                folder.remove(name)
            except FileNotFoundError:  # gone already (its own writer removed it)
                continue
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


def _record_names(folder: Folder, names: RecordNames, which: str) -> list[str] | None:
    """Every file name the record `which` (manifest or metadata) of scope `names`
    holds, as stored; None when it is missing or unreadable."""
    if not folder.has(names.manifest if which == "manifest" else names.metadata):
        return None  # a first save: nothing replaced (and no error built to be dropped)
    try:
        if which == "manifest":
            head = Manifest.read_head(folder, names.manifest)
            found = [o.file for o in head.objects.values()]
            if head.index is None:  # before version 4: the chunks are in the manifest
                return found + [c.file for t in head.tensors.values() for c in t.chunks]
            found.append(head.index.file)
            where = folder.where(names.manifest)
            try:
                for _, table in read_sections(
                    folder, head.index, [*head.tensors.items()], where, version=head.version
                ):
                    found += table.files()
            except (CorruptCheckpointError, OSError):  # a damaged index: what the head names
                pass
            return found
        storage = load_metadata(io.BytesIO(folder.read(names.metadata))).storage_data or {}
        return [info.relative_path for info in storage.values()]
    except Exception:  # noqa: BLE001 - a record we cannot read names nothing we may delete
        return None


def _plain(name: object) -> bool:
    return (
        isinstance(name, str) and bool(name) and "/" not in name and "\\" not in name
    ) and name not in (".", "..")


def referenced_files(
    folder: FolderLike, names: RecordNames = GLOBAL_RECORDS, *, both: bool = False
) -> set[str]:
    """The files the committed records in `folder` name: those of its manifest,
    else (or also, with `both`) of its `.metadata` (read with the safe unpickler).
    What must be kept; never on its own a reason to delete (`replaced_files` is)."""
    folder = open_folder(folder)
    found = _record_names(folder, names, "manifest")
    # Without a manifest this is a stock checkpoint (or ours without its manifest,
    # whose token-named files are collected by name anyway).
    if both or found is None:
        found = (found or []) + (_record_names(folder, names, "metadata") or [])
    return {n for n in found if _plain(n)}


def replaced_files(folder: FolderLike, names: RecordNames = GLOBAL_RECORDS) -> set[str]:
    """The data files a commit of scope `names` may delete as replaced: those its
    manifest and its `.metadata` name, each record counted only if every name it
    holds is a data file of that scope (ours or stock-named). A record naming
    anything else (`notes.txt`, `shardwise.json`, `.metadata`, a path) is corrupt
    and decides nothing: its files stay, with a warning."""
    folder = open_folder(folder)
    out: set[str] = set()
    for which in ("manifest", "metadata"):
        found = _record_names(folder, names, which)
        if found is None:
            continue
        record = names.manifest if which == "manifest" else names.metadata
        odd = [
            n
            for n in found
            if not _plain(n)
            or _data_rank(n) is None
            or (names.rank is not None and _data_rank(n) != names.rank)
        ]
        if odd:
            warnings.warn(
                f"{folder.where(record)} names {odd[0]!r}, which is not a data file of "
                "its checkpoint: a corrupt record, so none of the files it names are "
                "removed by this save",
                stacklevel=3,
            )
            continue
        out |= set(found)
    return out


# -----------------------------------------------------------------------------
# The commit protocol and atomic file writes: how a save becomes visible beside other files.
#
# A checkpoint folder can hold files that are not ours (a `model.pt`, notes, a
# previous checkpoint). So a save never renames or deletes the folder; it works
# file by file (the names: `io.commit`; collection: `io.commit`):
#
# 1. every rank writes its data under fresh names that carry its save's token
#    (`__0_0.sw1a2b3c4d5e6f.distcp`), so nothing committed is overwritten, and
#    fsyncs it;
# 2. the coordinator fsyncs the folder, then writes DCP's `.metadata`, then
#    `shardwise.json`, then (first save only) the marker `.shardwise` that
#    makes the folder recognisable as ours even if the manifest is later lost
#    — each to a temporary name, fsynced, renamed into place, the folder
#    fsynced. The manifest's rename is the commit point for shardwise readers;
#    `.metadata`'s for stock readers. Both only ever name durable data;
# 3. after the commit, files of the previous checkpoint (those its manifest or
#    `.metadata` named) and leftovers of interrupted saves (our token-named
#    data and temporary files) are removed — unless records of another scope
#    (a global checkpoint beside per-rank ones) still name them. Nothing else
#    is ever deleted: see `collect` for the exact rule.
#
# The whole save runs under the path's lease (`lease.py`): no other save of the
# same records is in flight, so token-named files no record names are leftovers
# of dead saves, never a live save's unfinished data; and a save whose lease was
# broken as stale commits nothing (`Lease.confirm`).
#
# Every whole file written for a checkpoint or a conversion (records, marker,
# converted outputs) goes through `Folder.write_atomically`: a reader sees all
# of it or none.
#
# The folder is a `storage.Folder`, local or under an fsspec URL; the protocol
# is the same on both, with "renamed into place" meaning a whole-object PUT
# (or server-side copy) on object stores, where a completed upload is durable
# and there is no directory to fsync (`storage.remote`).
#
# A crash before step 2 leaves the previous checkpoint as it was (plus
# token-named leftovers that the next save collects); a crash between the two
# renames leaves stock readers on the new checkpoint and shardwise readers on
# the old one, both complete; a crash during step 3 leaves only garbage.
# -----------------------------------------------------------------------------

_DATA = DATA_FILE  # our data files; tests/reliability/test_untrusted.py reads it here


def commit(
    folder: FolderLike,
    metadata: bytes | str,
    manifest: bytes | str,
    referenced: set[str],
    names: RecordNames = GLOBAL_RECORDS,
    *,
    sync: bool = True,
    lease: Lease | None = None,
) -> list[str]:
    """Make a checkpoint whose data is durable visible; collect what it replaces.

    `metadata` and `manifest` are the records' bytes, or the names of files beside
    them already holding them, durably (`Folder.write_temporary`, written by
    another rank; `engine.records`), moved into place.
    `referenced`: the data files the new records name. Returns the names removed.
    With `sync=False` nothing is fsynced (as stock's `sync_files=False`): a
    power loss may then lose the new checkpoint and the one it replaced.
    `lease`: the save's lease (`lease.py`), confirmed before the records are
    renamed (a save whose lease was broken raises `CheckpointBusyError` and
    commits nothing) and again before collecting.
    """
    folder = open_folder(folder)
    failpoint("before-commit")
    if lease is not None:
        lease.confirm()
    if sync:  # the data files' names, before any record names them
        folder.sync()
    previous = replaced_files(folder, names) - referenced
    if isinstance(metadata, str):  # already written, durably, under a temporary name
        folder.replace(metadata, names.metadata)
    else:
        folder.write_durably(names.metadata, metadata, sync=sync)
    if sync:
        folder.sync()
    failpoint("between-records")
    if isinstance(manifest, str):
        folder.replace(manifest, names.manifest)
    else:
        folder.write_durably(names.manifest, manifest, sync=sync)
    # The marker comes last: before the manifest exists it would make a folder
    # whose `.metadata` is complete (stock's, or this save's) read as incomplete.
    if names.rank is None and not folder.has(MARKER):
        folder.write_durably(MARKER, b"shardwise checkpoint folder\n", sync=sync)
    if sync:
        folder.sync()
    failpoint("before-collect")
    if lease is not None and not lease.still_held():
        warnings.warn(
            f"the save lease {lease.where} was broken after this save committed; "
            "nothing is collected (another save may be in flight)",
            stacklevel=2,
        )
        return []
    return collect(folder, referenced, previous, names, lease=lease)
