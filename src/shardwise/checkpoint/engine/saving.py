"""The collective save engine behind `swc.save` / `swc.async_save`.

Three exchanges here per save, whatever the number of tensors. `swc.save` makes
three more before them, each one small `all_gather_object` that keeps the ranks
on one path: the folder opens on every rank (`api._folder`), every rank takes
the same route (`megatron_returned.megatron_route`), every rank holds the same
adapted values (`adapters._agree_on`) — six per rank in all. `async_save` makes
the folder's, the adapted values' and its target check (`api._check_target`)
before it returns (its first call also creates its own gloo group), then these
three in the background: six too. Pinned by
tests/checkpoint/test_collective_counts.py. The three here:

1. every rank describes what it holds (`inventory`), checks what it can
   alone (objects serialize, the folder is free) and all-gathers that;
   every rank then derives the same plan (`planning.plan_save`) — no plan
   is pickled per item, scattered or validated twice;
2. each rank writes its records into one fresh token-named file, many
   small tensors per `writev`, checksumming each payload while it is in
   cache, fsyncs it, and all-gathers its checksums; the last rank also
   builds `.metadata` (every offset was known from the plan) into a
   temporary file, in parallel with rank 0's writes;
3. rank 0 builds `shardwise.json` and commits (`commit.commit`: `.metadata`
   renamed into place, then the manifest and marker, once every rank's
   data is durable), then everyone learns the outcome.

Rank 0 takes the path's lease (`lease.py`) before the first exchange, so a
busy path fails on every rank before any data is written; it gives it back
after the commit and collection, or on any failure.

A problem on any rank at any step is raised on every rank (`comm.agreement`).
The result is the same DCP checkpoint `Writer` produces under `dcp.save`:
stock `dcp.load` reads it.
"""

from __future__ import annotations

import io
import os
import uuid
from typing import Any

import crc32c
import torch
from torch.distributed.checkpoint._nested_dict import flatten_state_dict

from ...comm.agreement import exchange, require_same
from ...comm.communicator import Communicator
from ...errors import CheckpointExistsError, ShardMismatchError
from ...storage import Folder, open_folder
from ..format.checksums import frame_crc
from ..format.record_write import tensor_record
from ..format.tiles import checksum_payload
from ..io.commit import METADATA, RecordNames, commit, data_file_name, in_the_way, new_token
from ..io.faults import failpoint
from ..io.lease import Lease
from .inventory import Entry, Piece, describe
from .planning import Placement, SavePlan, place_records, plan_save
from .saved_metadata import Checksums, build_metadata, manifest_skeleton, manifest_text

__all__ = ["save_state"]

_BATCH_BYTES = 64 << 20  # copies of non-CPU tensors held at once before they are written
_BATCH_BUFFERS = 1023  # iovecs per writev (IOV_MAX is 1024)


def serialize_objects(flat: dict[str, Any]) -> tuple[dict[str, bytes], BaseException | None]:
    """Each non-tensor value as the bytes DCP stores (`torch.save`), or the first failure."""
    objects: dict[str, bytes] = {}
    for key, value in flat.items():
        if isinstance(value, torch.Tensor):
            continue
        buffer = io.BytesIO()
        try:
            torch.save(value, buffer)
        except Exception as e:  # noqa: BLE001 - any pickling failure is the caller's to fix
            return objects, TypeError(f"object '{key}' cannot be pickled ({type(e).__name__}: {e})")
        objects[key] = buffer.getvalue()
    return objects, None


def save_state(
    state_dict: dict[str, Any],
    path: Folder | str | os.PathLike,
    comm: Communicator,
    local_problem: BaseException | None,
    arguments: Any,
    *,
    sync: bool = True,
    wait: bool | float = False,
    overwrite: bool = True,
) -> bool:
    """Save `state_dict` (values already adapted) to `path`. Collective over `comm`.

    `local_problem` (found by the caller's own checks) and `arguments` (which
    every rank must pass alike) ride on the first exchange. Returns False,
    having written nothing, when some rank holds a value only DCP's own
    machinery can save: the caller then saves through `dcp.save`.
    `wait`: how long rank 0 waits for the path's lease (`lease.Lease.acquire`);
    with `overwrite=False` it looks for a checkpoint again once it holds it.
    """
    path = open_folder(path)
    objects: dict[str, bytes] = {}
    entries: list[Entry] | None = []
    pieces: dict[str, list[Piece]] = {}
    problem = local_problem
    try:  # whatever fails here fails every rank at the first exchange, never this one alone
        flat, mappings = flatten_state_dict(state_dict)
        objects, problem = serialize_objects(flat)
        problem = local_problem or problem
        described = describe(flat, mappings, objects) if problem is None else ([], {})
        entries, pieces = described if described is not None else (None, {})
    except Exception as e:  # noqa: BLE001 - raised on every rank by the exchange below
        problem = local_problem or e
    token, save_id = new_token(), str(uuid.uuid4())
    lease = None
    if comm.rank == 0 and problem is None:
        lease, problem = _take_lease(path, save_id, wait, overwrite)
    try:
        return _save_leased(
            path, comm, problem, arguments, sync, lease, pieces, objects, (entries, token, save_id)
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
    comm: Communicator,
    problem: BaseException | None,
    arguments: Any,
    sync: bool,
    lease: Lease | None,
    pieces: dict[str, list[Piece]],
    objects: dict[str, bytes],
    mine: tuple[list[Entry] | None, str, str],
) -> bool:
    """`save_state` from its first exchange on, rank 0 holding `lease`."""
    entries, token, save_id = mine
    everyone = exchange(problem, (entries, token, save_id, arguments), comm)
    _same_arguments([e[3] for e in everyone])
    if any(e[0] is None for e in everyone):
        return False
    inventories: list[list[Entry]] = [e[0] for e in everyone]
    plan = plan_save(inventories)
    if plan.problems:
        raise ShardMismatchError(f"cannot save to {path}: " + "; ".join(plan.problems))
    rank, world = comm.rank, comm.world_size
    save_id = everyone[0][2]
    serialization_id = save_id.replace("-", "")[:40].ljust(40, "0")
    files = [data_file_name(f"__{r}_", 0, everyone[r][1]) for r in range(world)]
    problem, checksums, metadata = None, [], None
    try:
        if plan.writes[rank]:
            checksums = _write_file(
                path, files[rank], plan, rank, pieces, objects, serialization_id, sync
            )
        if rank == world - 1:  # .metadata: built by the last rank while rank 0 still writes
            metadata = _write_metadata(
                plan, inventories, files, path, save_id, serialization_id, sync
            )
        if rank == 0:  # all of the manifest but the checksums, while the others finish
            placements = _placements(plan, inventories, serialization_id)
            skeleton = manifest_skeleton(
                plan, placements, files, path.checkpoint_id, save_id, _object_crcs(inventories)
            )
    except Exception as e:  # noqa: BLE001 - raised on every rank by the exchange below
        problem = e
    reports = exchange(problem, (checksums, metadata), comm)
    problem = None
    if rank == 0:
        try:
            metadata_file, metadata_crc = reports[-1][1]
            manifest = manifest_text(*skeleton, [r[0] for r in reports], metadata_crc)
            keep = {files[r] for r in range(world) if plan.writes[r]}
            commit(
                path,
                metadata_file,
                manifest.encode(),
                keep,
                RecordNames(),
                sync=sync,
                lease=lease,
            )
        except Exception as e:  # noqa: BLE001 - the other ranks wait for the verdict
            problem = e
    exchange(problem, None, comm)
    return True


def _same_arguments(arguments: list[Any]) -> None:
    """Each rank's (name, value) of the arguments that must agree: refuse a difference."""
    require_same(arguments, arguments[0][0], shown=lambda a: repr(a[1]))


def _object_crcs(inventories: list[list[Entry]]) -> dict[str, int]:
    """Each object's crc32c as its writer (the lowest rank holding it) serialized it."""
    crcs: dict[str, int] = {}
    for entries in inventories:
        for key, _path, dtype, _shape, _grad, held in entries:
            if dtype is None:
                crcs.setdefault(key, held[1])
    return crcs


def _placements(
    plan: SavePlan, inventories: list[list[Entry]], serialization_id: str
) -> list[list[Placement]]:
    return [
        place_records(plan, inventories[r], r, serialization_id) for r in range(len(inventories))
    ]


def _write_metadata(
    plan: SavePlan,
    inventories: list[list[Entry]],
    files: list[str],
    path: Folder,
    save_id: str,
    serialization_id: str,
    sync: bool,
) -> tuple[str, int]:
    """`.metadata` (all of it known from the plan) into a temporary file that the
    coordinator renames into place at the commit: its name and crc32c."""
    placements = _placements(plan, inventories, serialization_id)
    data = build_metadata(plan, placements, files, path.checkpoint_id, save_id)
    path.make()
    return path.write_temporary(METADATA, data, sync=sync), crc32c.crc32c(data)


def _write_file(
    folder: Folder,
    name: str,
    plan: SavePlan,
    rank: int,
    pieces: dict[str, list[Piece]],
    objects: dict[str, bytes],
    serialization_id: str,
    sync: bool,
) -> list[Checksums]:
    """This rank's records, in plan order, into a new file: many per `writev`,
    each payload straight from its tensor's memory (non-CPU tensors copied in
    bounded batches). Returns each record's checksums."""
    failpoint("before-write")
    folder.make()
    out: list[Checksums] = []
    pending: list[Any] = []
    held = 0  # bytes of host copies waiting in `pending`
    sink = folder.create(name)
    try:
        first = True
        for key, index in plan.writes[rank]:
            if index < 0:
                data = objects[key]
                pending.append(data)
                out.append((None, [], 0))  # its crc32c went with the inventory
                continue
            source = pieces[key][index].tensor.detach()
            tensor = source.cpu().contiguous()
            if tensor.data_ptr() != source.data_ptr():
                held += tensor.nbytes
            head, payload, tail = tensor_record(tensor, serialization_id)
            tile, crcs = checksum_payload(payload, tuple(tensor.shape), tensor.element_size())
            out.append((tile, crcs, frame_crc(head, tail)))
            pending += (head, payload, tail)
            if held >= _BATCH_BYTES or len(pending) >= _BATCH_BUFFERS:
                sink.write(pending)
                pending, held = [], 0
                if first:
                    failpoint("mid-data")
                    first = False
        sink.write(pending)
        if first:
            failpoint("mid-data")
        sink.close(sync=sync)
    except BaseException:
        sink.abort()  # nothing half-written stays (a crash's leftovers: the next save's collect)
        raise
    failpoint("after-data")
    return out
