"""The commit protocol and atomic file writes: how a save becomes visible beside other files.

A checkpoint folder can hold files that are not ours (a `model.pt`, notes, a
previous checkpoint). So a save never renames or deletes the folder; it works
file by file (the names: `record_names`; collection: `collection`):

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
   is ever deleted: see `collect` for the exact rule.

The whole save runs under the path's lease (`lease.py`): no other save of the
same records is in flight, so token-named files no record names are leftovers
of dead saves, never a live save's unfinished data; and a save whose lease was
broken as stale commits nothing (`Lease.confirm`).

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

import warnings

from ...storage import open_folder
from ..format.manifest import MARKER
from ..format.record_check import DATA_FILE
from .collection import collect, referenced_files, replaced_files
from .faults import failpoint
from .lease import Lease
from .record_names import (
    GLOBAL_RECORDS,
    METADATA,
    FolderLike,
    RecordNames,
    already_exists,
    data_file_name,
    holds_checkpoint,
    in_the_way,
    leftover_data,
    new_token,
    per_rank_records,
)

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
    "replaced_files",
]

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
    another rank; `record_join`), moved into place.
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
