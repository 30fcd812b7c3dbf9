"""Collection after a commit: which files the committed records replaced, and their removal.

Only files a replaced record of the same scope named, token-named leftovers of
dead saves and temporary files of the scope's records are ever removed, and
never one that a committed record of any scope still names (see `collect`).
"""

from __future__ import annotations

import io
import re
import warnings

from torch.distributed.checkpoint.filesystem import DEFAULT_SUFFIX

from ...errors import CorruptCheckpointError
from ...storage import Folder, open_folder
from ...storage.folder import TEMPORARY
from ..format.manifest import MARKER, Manifest
from ..format.manifest_index import read_sections
from ..format.record_check import DATA_FILE
from ..format.safe_pickle import load_metadata
from .faults import failpoint
from .lease import Lease, live_scopes
from .record_names import GLOBAL_RECORDS, FolderLike, RecordNames, per_rank_records

__all__ = ["collect", "referenced_files", "replaced_files"]

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
