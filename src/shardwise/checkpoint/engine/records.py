"""A checkpoint's records, found once and read safely: `shardwise.json`, or DCP's
`.metadata` where it is current (see `read_records`)."""

from __future__ import annotations

from torch.distributed.checkpoint.metadata import Metadata

from ...errors import CheckpointNotFoundError, IncompleteCheckpointError
from ...storage import Folder
from ..format.manifest import MARKER, Manifest
from ..format.record_check import follow_replaced, read_stock
from ..io.commit import RecordNames, leftover_data, per_rank_records

__all__ = ["read_records"]


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
    `IncompleteCheckpointError` where a save never committed."""
    names = RecordNames(rank)
    listing = folder.sizes() if listing is None else listing
    present = set(listing)  # plain files only
    if names.manifest not in present:  # every name: a record that is a link is refused by it
        present = set(folder.names())
    if names.manifest in present:
        manifest = Manifest.read_head(folder, names.manifest)
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
        return None, read_stock(folder, names.metadata, holes=rank is not None)
    if rank is None and per_rank_records(folder):
        raise CheckpointNotFoundError(
            f"{folder} holds per-rank checkpoint records only "
            "(saved with use_collectives=False): read them with read_metadata(rank=...)"
        )
    if rank is None and leftover_data(folder):
        raise IncompleteCheckpointError(
            f"a save to {folder} started but never committed ({leftover_data(folder)[0]} is left)"
        )
    raise CheckpointNotFoundError(f"no checkpoint at {folder}")
