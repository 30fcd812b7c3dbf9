"""A checkpoint's records, found once and read safely: `shardwise.json`, or DCP's
`.metadata` where it is current (see `read_records`)."""

from __future__ import annotations

import re
from collections.abc import Iterable

from torch.distributed.checkpoint.metadata import Metadata

from ...errors import CheckpointNotFoundError, IncompleteCheckpointError
from ...storage import Folder
from ...storage.folder import TEMPORARY
from ..format.manifest import MARKER, Manifest
from ..format.record_check import follow_replaced, read_stock
from ..io.commit import RecordNames, leftover_data, per_rank_records
from ..io.lock_record import LOCK_NAME

__all__ = ["read_records", "save_leftovers"]

# The records a save writes under a temporary name first (`NAME.sw{12 hex}.tmp`): its
# parts and joined records (`shardwise.json`), `.metadata`, the marker, per-rank ones.
_RECORD = re.compile(r"(?:__\d+)?\.metadata|(?:__\d+\.)?shardwise\.json|\.shardwise", re.ASCII)


def save_leftovers(names: Iterable[str]) -> list[str]:
    """Of `names`, what a save leaves before its first data file: its lease's lock
    record, and temporary names of its records or lock."""
    found = []
    for name in sorted(names):
        temporary = TEMPORARY.fullmatch(name)
        base = name if temporary is None else temporary.group(1)
        if LOCK_NAME.fullmatch(base) or (temporary is not None and _RECORD.fullmatch(base)):
            found.append(name)
    return found


def read_records(
    folder: Folder,
    rank: int | None = None,
    *,
    whole: bool = False,
    listing: dict[str, int] | None = None,
) -> tuple[Manifest | None, Metadata | None]:
    """(the manifest, None) for a shardwise checkpoint whose manifest is current, else
    (None, DCP's metadata), read safely and checked; `rank`: that rank's own records.
    A version 4 manifest comes without its chunks (a load reads the sections it needs)
    unless `whole`. `listing`: the folder's files and sizes, listed once by the caller
    (on an object store each listing is a request, by every rank of a load).
    Raises `CheckpointNotFoundError` where there is no checkpoint (also where only
    per-rank records are: what `dcp.load` expects before it retries per rank) and
    `IncompleteCheckpointError` where a save never committed (SPEC §3): its data, or
    before any, its lease or temporary records are there (`save_leftovers`)."""
    names = RecordNames(rank)
    listing = folder.sizes() if listing is None else listing
    present = set(listing)  # plain files only
    if names.manifest not in present:  # every name: a record that is a link is refused by it
        present = set(folder.names())
    if names.manifest in present:
        manifest = Manifest.read_head(folder, names.manifest, listing)
        replaced = manifest.stale(folder, names.metadata, listing)
        if replaced is None:
            if manifest.index is None or whole:  # before version 4: every chunk, checked
                manifest.resolve(folder, names.manifest)
            return manifest, None
        # what stock readers see now: never the data it replaced
        manifest.resolve(folder, names.manifest)  # the files it names, to refuse them
        return None, follow_replaced(
            folder, names.metadata, replaced, manifest.data_files(), holes=rank is not None
        )
    if rank is None and MARKER in present:
        raise IncompleteCheckpointError(
            f"{folder} is a shardwise checkpoint without its {names.manifest}: "
            "the save did not commit"
        )
    if names.metadata in present:
        return None, read_stock(folder, names.metadata, holes=rank is not None, listing=listing)
    if rank is None and per_rank_records(folder):
        raise CheckpointNotFoundError(
            f"{folder} holds per-rank checkpoint records only "
            "(saved with use_collectives=False): read them with read_metadata(rank=...)"
        )
    if rank is None and leftover_data(folder):
        raise IncompleteCheckpointError(
            f"a save to {folder} started but never committed ({leftover_data(folder)[0]} is left)"
        )
    if rank is None and (left := save_leftovers(present)):
        raise IncompleteCheckpointError(
            f"a save to {folder} started but never committed: it holds {', '.join(left[:4])}"
            f"{f' and {len(left) - 4} more' if len(left) > 4 else ''} (the lease or unfinished "
            "records of a save still running, or killed before its first data file) and no "
            "checkpoint; wait for that save, or save again"
        )
    raise CheckpointNotFoundError(f"no checkpoint at {folder}")
