"""The collective save engine behind `swc.save` / `swc.async_save`: the only one.

Every value goes through it: a tensor type only DCP's own protocol describes
is one branch of the inventory (`inventory.dcp_pieces`), Megatron's
pre-serialized objects another (`inventory.Serialized`); nothing falls back to
`dcp.save`. Three exchanges here per save, whatever the number of tensors.
`swc.save` makes one before them (`api.edge.agree_route`: the folder, the
route, the adapted values): four per rank in all. `async_save` makes two before
it returns (the adapted values, its target check; its first call also creates
its own gloo group), then these three in the background: five. Pinned by
tests/checkpoint/api/test_collective_counts.py. The three here:

1. every rank describes what it holds (`inventory`), checks what it can
   alone (objects serialize, the folder is free) and all-gathers that;
   every rank then derives the same plan (`planning.plan_save`) — no plan
   is pickled per item, scattered or validated twice;
2. each rank writes its records into one fresh token-named file
   (`chunk_writer.DataFile`: many small tensors per `writev`, each payload
   checksummed while it is in cache), fsyncs it, and all-gathers its
   checksums; rank 0 and the last rank build the records' entries from the
   plan (`save_records.plan_records`), and the last rank writes `.metadata`
   (every offset was known from the plan) into a temporary file, in
   parallel with rank 0's writes;
3. rank 0 fills the reported checksums into the entries, encodes
   `shardwise.json` and commits (`commit.commit`: `.metadata` renamed into
   place, then the manifest and marker, once every rank's data is durable),
   then everyone learns the outcome.

Rank 0 takes the path's lease (`lease.py`) before the first exchange, so a
busy path fails on every rank before any data is written; it gives it back
after the commit and collection, or on any failure.

A problem on any rank at any step is raised on every rank (`comm.agreement`).
The result is the same DCP checkpoint `Writer` produces under `dcp.save`:
stock `dcp.load` reads it.
"""

from __future__ import annotations

import os
import uuid
from typing import Any

import crc32c
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.metadata import StorageMeta

from ...comm.agreement import Agreement
from ...errors import CheckpointExistsError, ShardMismatchError
from ...storage import Folder, open_folder
from ..io.commit import METADATA, RecordNames, commit, data_file_name, in_the_way, new_token
from ..io.lease import Lease
from .inventory import Entry, Piece, describe, serialize_objects
from .planning import Placement, place_records, plan_save
from .rank_file import Once, Staging, write_rank_file
from .save_records import SaveRecords, plan_records

__all__ = ["save_state"]


def save_state(
    state_dict: dict[str, Any],
    path: Folder | str | os.PathLike,
    agreement: Agreement,
    *,
    sync: bool = True,
    wait: bool | float = False,
    overwrite: bool = True,
    staging: Staging | None = None,
) -> None:
    """Save `state_dict` (values already adapted) to `path`. Collective: its three
    exchanges go through the caller's `agreement`, whose deferred problem (the
    caller's own checks) rides on the first.
    `wait`: how long rank 0 waits for the path's lease (`lease.Lease.acquire`);
    with `overwrite=False` it looks for a checkpoint again once it holds it.
    `staging`: how device tensors are copied out (`Staging`).
    """
    staging = staging or Staging()
    staged = Once(staging.on_staged)
    try:
        _save(state_dict, path, agreement, sync, wait, overwrite, staging, staged)
    finally:
        staged()  # the save is over: the state is free whatever happened


def _save(
    state_dict: dict[str, Any],
    path: Folder | str | os.PathLike,
    agreement: Agreement,
    sync: bool,
    wait: bool | float,
    overwrite: bool,
    staging: Staging,
    staged: Once,
) -> None:
    path = open_folder(path)
    objects: dict[str, bytes] = {}
    entries: list[Entry] = []
    pieces: dict[str, list[Piece]] = {}
    problem: BaseException | None = None
    try:  # whatever fails here fails every rank at the first exchange, never this one alone
        flat, mappings = flatten_state_dict(state_dict)
        objects, problem = serialize_objects(flat)
        if problem is None:
            entries, pieces = describe(flat, mappings, objects)
    except Exception as e:  # noqa: BLE001 - raised on every rank by the exchange below
        problem = e
    agreement.defer(problem)
    problem = agreement.pending
    token, save_id = new_token(), str(uuid.uuid4())
    lease = None
    if agreement.rank == 0 and problem is None:
        lease, problem = _take_lease(path, save_id, wait, overwrite)
        agreement.defer(problem)
    try:
        _save_leased(
            path,
            agreement,
            (sync, staging, staged),
            lease,
            pieces,
            objects,
            (entries, token, save_id),
        )
    finally:
        if lease is not None:
            lease.release()


def _take_lease(
    path: Folder, save_id: str, wait: bool | float, overwrite: bool
) -> tuple[Lease | None, BaseException | None]:
    """The path's lease for this save, or the problem that rides on the first exchange."""
    lease = Lease(path, save_id=save_id)
    try:
        lease.acquire(wait)
    except Exception as e:  # noqa: BLE001 - busy, or the folder cannot be made: every rank raises
        return None, e
    existing = None if overwrite else in_the_way(path)  # committed while this one waited?
    if existing:
        lease.release()
        return None, CheckpointExistsError(existing)
    return lease, None


def _save_leased(
    path: Folder,
    agreement: Agreement,
    how: tuple[bool, Staging, Once],
    lease: Lease | None,
    pieces: dict[str, list[Piece]],
    objects: dict[str, bytes],
    mine: tuple[list[Entry], str, str],
) -> None:
    """`save_state` from its first exchange on, rank 0 holding `lease`."""
    entries, token, save_id = mine
    sync, staging, staged = how
    everyone = agreement.exchange((entries, token, save_id))
    inventories: list[list[Entry]] = [e[0] for e in everyone]
    plan = plan_save(inventories)
    if plan.problems:
        raise ShardMismatchError(f"cannot save to {path}: " + "; ".join(plan.problems))
    rank, world = agreement.rank, agreement.world_size
    save_id = everyone[0][2]
    serialization_id = save_id.replace("-", "")[:40].ljust(40, "0")
    tokens = [e[1] for e in everyone]
    problem, checksums, metadata = None, [], None
    placed: list[Placement] = []
    try:
        if plan.writes[rank]:
            placed = place_records(plan, inventories[rank], rank, serialization_id)
            mine_ = [
                objects[key] if index < 0 else pieces[key][index].tensor
                for key, index in plan.writes[rank]
            ]
            checksums = write_rank_file(
                path,
                _file_names(rank, placed, tokens[rank]),
                (mine_, [p.file for p in placed]),
                serialization_id,
                sync,
                staging,
                staged,
            )
        else:
            staged()  # this rank writes nothing: the state is not read again
        if rank in (0, world - 1):  # the records: known from the plan but the checksums
            placements = [  # this rank's own, placed above, not again
                placed
                if r == rank and plan.writes[rank]
                else place_records(plan, inventories[r], r, serialization_id)
                for r in range(world)
            ]
            files = [_file_names(r, placements[r], tokens[r]) for r in range(world)]
            meta = StorageMeta(checkpoint_id=path.checkpoint_id, save_id=save_id)
            records, slots = plan_records(plan, placements, files, meta, _object_crcs(inventories))
        if rank == world - 1:  # .metadata: built by the last rank while rank 0 still writes
            metadata = _write_metadata(records, path, sync)
        if rank == 0:
            records.prepare()  # all of the manifest that is known, ahead of the checksums
    except Exception as e:  # noqa: BLE001 - raised on every rank by the exchange below
        problem = e
    agreement.defer(problem)
    reports = agreement.exchange((checksums, metadata))
    problem = None
    if rank == 0:
        try:
            metadata_file, metadata_crc = reports[-1][1]
            for writer, position, chunk in slots:
                SaveRecords.fill(chunk, reports[writer][0][position])
            keep = {name for r in range(world) if plan.writes[r] for name in files[r]}
            commit(
                path,
                metadata_file,
                records.manifest(metadata_crc),
                keep,
                RecordNames(),
                sync=sync,
                lease=lease,
            )
        except Exception as e:  # noqa: BLE001 - the other ranks wait for the verdict
            problem = e
    agreement.defer(problem)
    agreement.exchange()


def _file_names(rank: int, placed: list[Placement], token: str) -> list[str]:
    """The names of `rank`'s data files, as many as its placements use."""
    count = 1 + max((p.file for p in placed), default=0)
    return [data_file_name(f"__{rank}_", k, token) for k in range(count)]


def _object_crcs(inventories: list[list[Entry]]) -> dict[str, int]:
    """Each object's crc32c as its writer (the lowest rank holding it) serialized it."""
    crcs: dict[str, int] = {}
    for entries in inventories:
        for key, _path, dtype, _shape, _grad, held in entries:
            if dtype is None:
                crcs.setdefault(key, held[1])
    return crcs


def _write_metadata(records: SaveRecords, path: Folder, sync: bool) -> tuple[str, int]:
    """`.metadata` into a temporary file that the coordinator renames into place at
    the commit: its name and crc32c."""
    data = records.metadata()
    path.make()
    return path.write_temporary(METADATA, data, sync=sync), crc32c.crc32c(data)
