"""The collective save engine behind `swc.save` / `swc.async_save`: the only one.

Inventory, one exchange of descriptions, the plan, then each rank writes its
data files (its archives in plan order, device tensors staged through bounded
host slabs) and rank 0 joins and commits the records.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import sys
import threading
import time
import uuid
from array import array
from collections.abc import Callable, Mapping
from contextlib import ExitStack
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.metadata import StorageMeta

from ...comm.agreement import Agreement
from ...errors import CheckpointExistsError, ShardMismatchError, ShardwiseError
from ...storage import Folder, open_folder
from ..io import (
    Copier,
    DataFile,
    DeviceCopier,
    HostCopier,
    Lease,
    Written,
    failpoint,
    in_the_way,
    record_bytes,
    slabs_for,
    staging_bytes,
    write_archives,
)
from . import plan as plan_cache
from .inventory import Entry, Held, combine_pending, describe, serialize_objects
from .plan import (
    MyWrites,
    Places,
    file_name,
    owned_part,
    place_archives,
    plan_by_owners,
    remote_objects,
    reports_for,
    routed,
)
from .records import Joining, part_name, write_part

log = logging.getLogger("shardwise")

__all__ = ["Once", "SaveReport", "Staging", "save_state", "write_rank_file"]


# -----------------------------------------------------------------------------
# One rank's data files of a save: its records in plan order, device tensors staged.
#
# Split from `engine.save` (the collective steps) so that how bytes leave the device —
# bounded pinned slabs, side streams, the staged signal — reads on its own.
# -----------------------------------------------------------------------------

_U32 = next(code for code in "IL" if array(code).itemsize == 4)


@dataclass
class Staging:
    """How a save's device tensors reach its files (`io.write`).

    `budget`: host bytes per rank for staging (None: `io.device.staging_bytes`).
    `after`: per CUDA device, an event on the caller's stream the copies follow
    (None: the caller's current stream, when the save runs on the caller's thread).
    `on_staged`: called once this rank no longer reads the state (every byte it
    writes is on the host, or the save failed), from any thread.
    `host`: stage host tensors too (tests run the device pipeline on CPU this way).
    `progress`: called with each record's bytes once it is handed to its file (on the
    thread that writes: the caller's for `save`, the background one for `async_save`),
    so a caller can show how far this rank's writes are.
    """

    budget: int | None = None
    after: dict[int, torch.cuda.Event] | None = None
    on_staged: Callable[[], None] | None = None
    host: bool = False
    progress: Callable[[int], None] | None = None


@dataclass
class SaveReport:
    """What one rank's part of a save did, for the `shardwise` logger and `SaveInfo`:
    the records it wrote, their bytes and files, whether the plan of an earlier save
    of this structure was reused, and where the time went (seconds per phase:
    `describe` the state, on rank 0 `lease` (waiting for the path's lease), `plan`
    (exchanges and places), `write` the data files, `commit` (every rank durable,
    rank 0's records in place, the verdict))."""

    tensors: int = 0
    objects: int = 0
    bytes_written: int = 0
    files: int = 0
    plan_reused: bool = False
    phases: dict[str, float] = field(default_factory=dict)

    def timed(self, phase: str, since: float) -> float:
        """Add the seconds since `since` to `phase`; now, to time the next one from."""
        now = time.perf_counter()
        self.phases[phase] = self.phases.get(phase, 0.0) + now - since
        return now


class Once:
    """A callback called at most once, from whichever thread gets there first."""

    def __init__(self, fn: Callable[[], None] | None) -> None:
        self._fn, self._lock = fn, threading.Lock()

    def __call__(self) -> None:
        with self._lock:
            fn, self._fn = self._fn, None
        if fn is not None:
            fn()


def write_rank_file(
    folder: Folder,
    names: list[str],
    records: tuple[list[Any], Places],
    serialization_id: str,
    sync: bool,
    staging: Staging,
    staged: Once,
) -> None:
    """This rank's records (tensors, objects' bytes), in plan order, each into the new
    file of `names` its place says (`engine.plan.place_archives`): device tensors through
    the staging slabs (`io.write`), host tensors straight from their memory.
    Each file then ends with the frame and tile checksums of its tensor records, where
    their places say (`crc_at`): the checksums stay with their writer (format 5)."""
    failpoint("before-write")
    folder.make()
    values, placed = records
    on_device = _any_on_device(values)  # host-only states skip the staging machinery
    slabs = slabs_for("save", staging_bytes(staging.budget))
    with slabs.lease(), ExitStack() as stack:
        files = [stack.enter_context(DataFile(folder, name)) for name in names]
        written = write_archives(
            files,
            (values, placed.rows[:, 3].tolist()),
            serialization_id,
            slabs,
            _copier(values, staging, on_device),
            stage=_always if staging.host else (_on_device if on_device else None),
            on_staged=staged,
            progress=staging.progress,
        )
        for k, file in enumerate(files):
            _write_checksums(file, k, placed, written)
            file.finish(sync)


def _write_checksums(file: DataFile, k: int, placed: Places, written: list[Written]) -> None:
    """File `k`'s checksum block: each tensor record's frame and tiles, in place order."""
    rows = placed.rows
    mine = np.flatnonzero((rows[:, 3] == k) & (rows[:, 4] >= 0)).tolist()
    if not mine:
        return
    words = array(_U32)
    start = file.pos
    for i, at in zip(mine, rows[mine, 4].tolist()):
        if at != start + 4 * len(words):  # the plan and the bytes disagree: a writer's bug
            raise ShardwiseError(f"{file.name}: checksums planned at {at}, not where they go")
        w = written[i]
        words.append(w.frame)
        words.extend(w.crcs)
    if sys.byteorder != "little":
        words.byteswap()
    file.write_archive(words.tobytes())


def _any_on_device(records: list[Any]) -> bool:
    return any(isinstance(r, torch.Tensor) and r.device.type != "cpu" for r in records)


def _copier(records: list[Any], staging: Staging, on_device: bool) -> Copier:
    cuda = on_device and any(isinstance(r, torch.Tensor) and r.is_cuda for r in records)
    return DeviceCopier(staging.after) if cuda else HostCopier()


def _on_device(t: torch.Tensor) -> bool:
    return t.device.type != "cpu"


def _always(t: torch.Tensor) -> bool:
    return True


# -----------------------------------------------------------------------------
# The collective save engine behind `swc.save` / `swc.async_save`: the only one.
#
# Every value goes through it: a tensor type only DCP's own protocol describes
# is one branch of the inventory (`inventory.dcp_pieces`), Megatron's
# pre-serialized objects another (`inventory.Serialized`); nothing falls back to
# `dcp.save`. No step makes a rank hold or process every rank's description:
# each rank's work and traffic is O(what it holds + the keys it owns), whatever
# the world size W (`engine.plan`). The exchanges:
#
# 1. `agree` (one fixed-size `all_reduce`): any rank's problem so far (its
#    state, the path's lease), this save's token and id from rank 0, and whether
#    every rank holds this structure's plan from an earlier save (`engine.plan`);
# 2. only when it does not: two `all_to_all`s plan the save, each key on its
#    owner (`engine.plan.plan_by_owners`), and each rank places its own records
#    (`engine.plan.place_archives`);
# 3. on a first save each rank routes each record's place to the key's owner
#    (one `all_to_all`), which keeps them with its plan: a repeated save routes
#    nothing, unless an object is written by a rank other than its owner (its
#    crc32c, `routes`);
# 4. each owner writes its keys' share of `.metadata` and the manifest as a part
#    file (`SaveRecords.part`), from the places alone; one fixed-size
#    `all_reduce` says every part is written (and whether any object needs
#    routing); then rank 0 joins the parts into the records on a thread of its
#    own (`engine.records`: bytes, not entries, nothing received) while every rank
#    writes its records into fresh token-named files (`engine.save.write_rank_file`),
#    each file ending with its records' checksums (format version 5: they stay
#    with their writer), and fsyncs them;
# 5. one fixed-size `all_reduce` says every rank's data is durable; rank 0
#    commits the joined records (`commit.commit`: `.metadata` renamed into
#    place, then the manifest and marker); the verdict (one fixed-size `all_reduce`).
#
# So a first save makes seven collectives here and a repeated one four, each a
# fixed-size `all_reduce`: a training loop's next save exchanges a few dozen bytes
# per rank, whatever W and N, and its coordinator's copying overlaps the writes.
# `swc.save` makes one before them (`api.agree_route`): eight and five per rank.
# `async_save` makes two before it returns (the adapted values, its target check;
# its first call also creates its own gloo group), then these. Pinned by
# tests/checkpoint/api/test_collective_counts.py.
#
# Rank 0 takes the path's lease (`lease.py`) before the first exchange, so a
# busy path fails on every rank before any data is written; it gives it back
# after the commit and collection, or on any failure.
#
# A problem on any rank at any step is raised on every rank (`comm.agreement`).
# The result is the same DCP checkpoint `Writer` produces under `dcp.save`:
# stock `dcp.load` reads it.
# -----------------------------------------------------------------------------


def save_state(
    state_dict: dict[str, Any],
    path: Folder | str | os.PathLike,
    agreement: Agreement,
    *,
    sync: bool = True,
    wait: bool | float = False,
    overwrite: bool = True,
    staging: Staging | None = None,
    report: SaveReport | None = None,
) -> None:
    """Save `state_dict` (values already adapted) to `path`. Collective: its
    exchanges go through the caller's `agreement`, whose deferred problem (the
    caller's own checks) rides on the first.
    `wait`: how long rank 0 waits for the path's lease (`lease.Lease.acquire`);
    with `overwrite=False` it looks for a checkpoint again once it holds it.
    `staging`: how device tensors are copied out (`Staging`).
    `report`: filled with what this rank did (`SaveReport`), which is also logged at DEBUG.
    """
    staging = staging or Staging()
    staged = Once(staging.on_staged)
    report = report if report is not None else SaveReport()
    try:
        _save(state_dict, path, agreement, sync, wait, overwrite, staging, staged, report)
    finally:
        staged()  # the save is over: the state is free whatever happened
    log.debug(
        "rank %d saved %d tensor and %d object records, %d bytes in %d files to %s (plan %s; %s)",
        agreement.rank,
        report.tensors,
        report.objects,
        report.bytes_written,
        report.files,
        path,
        "reused" if report.plan_reused else "made",
        ", ".join(f"{k} {v:.3f} s" for k, v in report.phases.items()),
    )


def _save(
    state_dict: dict[str, Any],
    path: Folder | str | os.PathLike,
    agreement: Agreement,
    sync: bool,
    wait: bool | float,
    overwrite: bool,
    staging: Staging,
    staged: Once,
    report: SaveReport,
) -> None:
    since = time.perf_counter()
    path = open_folder(path)
    objects: dict[str, bytes] = {}
    entries: list[Entry] = []
    held = Held({}, {})
    problem: BaseException | None = None
    combine_pending(state_dict)  # collective: before anything that can fail on one rank
    try:  # whatever fails here fails every rank at the first exchange, never this one alone
        flat, mappings = _flattened(state_dict)
        objects, problem = serialize_objects(flat)
        if problem is None:
            entries, held = describe(flat, mappings, objects)
    except Exception as e:  # noqa: BLE001 - raised on every rank by the exchange below
        problem = e
    agreement.defer(problem)
    since = report.timed("describe", since)
    # rank 0's random words: this save's token and id, sent to every rank by `agree`
    words = [secrets.randbits(62) for _ in range(3)] if agreement.rank == 0 else [0, 0, 0]
    lease = None
    if agreement.rank == 0 and agreement.pending is None:
        lease, problem = _take_lease(path, _save_id(words), wait, overwrite)
        agreement.defer(problem)
        report.timed("lease", since)
    try:
        _save_leased(
            path, agreement, (sync, staging, staged), lease, (held, objects, entries), words, report
        )
    finally:
        if lease is not None:
            lease.release()


def _flattened(state_dict: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """DCP's flattened state and paths; a state flat already (text keys, no dict or list
    values) as it is, with no paths (each is `(key,)`): 100,000 tensors then cost no
    copy of the dict and no path per key."""
    if all(type(k) is str and not isinstance(v, (Mapping, list)) for k, v in state_dict.items()):
        return state_dict, {}
    return flatten_state_dict(state_dict)


def _save_id(words: list[int]) -> str:
    return str(uuid.UUID(int=((words[1] << 62) | words[2]) & ((1 << 128) - 1)))


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
    inventory: tuple[Held, dict[str, bytes], list[Entry]],
    words: list[int],
    report: SaveReport,
) -> None:
    """`save_state` from its first exchange on, rank 0 holding `lease`."""
    since = time.perf_counter()
    held, objects, entries = inventory
    sync, staging, staged = how
    rank, world = agreement.rank, agreement.world_size
    group = agreement.comm.key
    sig, kept = b"", None
    if agreement.pending is None:
        try:
            sig = plan_cache.signature(entries, world, rank, type(path).__name__)
            kept = plan_cache.lookup(group, sig)
        except Exception as e:  # noqa: BLE001 - raised on every rank by `agree`
            agreement.defer(e)
    kept_id = 0 if kept is None else kept.plan_id
    # maxima: a rank without a kept plan; the largest kept plan id and the negated
    # smallest (equal only when every rank kept the same plan); the save id's words
    replan, most_kept, least_kept, *ids = agreement.agree(
        [int(kept is None), kept_id, -kept_id, *words]
    )
    token, save_id = f"{ids[0] & 0xFFFFFFFFFFFF:012x}", _save_id(ids)
    serialization_id = save_id.replace("-", "")[:40].ljust(40, "0")
    fresh = kept is None or replan or most_kept != -least_kept
    report.plan_reused = not fresh
    if fresh:
        mine, owned, problems = plan_by_owners(entries, agreement)
        if problems:
            raise ShardMismatchError(f"cannot save to {path}: " + "; ".join(problems))
        placed = Places()
        try:
            placed = place_archives(mine.pairs(), entries, serialization_id)
        except Exception as e:  # noqa: BLE001 - raised on every rank by the next route
            agreement.defer(e)
        kept = plan_cache.Planned(ids[0] | 1, mine, placed, owned)
    assert kept is not None
    mine, placed, places = kept.mine, kept.placed, kept.places
    crcs = {}  # each object's, known already
    for key, _path, dtype, _shape, _grad, described in entries:
        if dtype is None:  # an object's: (byte length, crc32c)
            _length, crcs[key] = described
    meta = StorageMeta(checkpoint_id=path.checkpoint_id, save_id=save_id)
    if kept.routes:  # a first save, or an object written by a rank not its owner
        reports: list[Any] = [[] for _ in range(world)]
        try:  # a failure here would leave the others in the route: it rides on it
            if agreement.pending is None:
                reports = reports_for(mine, placed, crcs)
        except Exception as e:  # noqa: BLE001 - raised on every rank by the route below
            agreement.defer(e)
        received = agreement.route(reports)
        places, crcs = routed(kept.owned, received)
        del received, reports
    problem = None
    try:
        assert places is not None
        write_part(path, token, rank, owned_part(kept.owned, places, crcs, token, meta, rank))
    except Exception as e:  # noqa: BLE001 - raised on every rank by the next agreement
        problem = e
    agreement.defer(problem)
    files = placed.files()
    # every part is written, and whether a rank owns an object another writes (then
    # every save reports): rank 0 joins the records while every rank writes its data
    remote = agreement.agree([remote_objects(kept.owned, rank) if fresh else 0])[0]
    if fresh:
        plan_cache.keep(group, sig, replace(kept, places=places, routes=remote > 0))
    joining = (
        Joining(path, world, file_name(0, files, token), token, meta, sync) if not rank else None
    )
    state = (held, objects)
    since = report.timed("plan", since)
    try:
        agreement.defer(
            _write(path, rank, (mine, placed, files), state, token, serialization_id, how, report)
        )
        since = report.timed("write", since)
        most = agreement.agree([files])[0]  # every rank's data is durable
        if joining is not None:
            agreement.defer(joining.commit(most, lease))
        agreement.verdict()
    except BaseException:
        if joining is not None:  # what this save wrote for its records, removed
            joining.discard()
        raise
    finally:
        if joining is not None:
            joining.join()  # never writing once the save is over (and the lease given back)
        report.timed("commit", since)
    # committed: each owner removes its own part (rank 0 removing W of them would cost it
    # O(W)); one left behind by a rank that died here goes at the next commit's collection
    with contextlib.suppress(OSError):
        path.remove(part_name(token, rank))


def _write(
    path: Folder,
    rank: int,
    plan: tuple[MyWrites, Places, int],
    state: tuple[Held, dict[str, bytes]],
    token: str,
    serialization_id: str,
    how: tuple[bool, Staging, Once],
    report: SaveReport,
) -> BaseException | None:
    """This rank's data files (`engine.save`); the problem, raised on every rank."""
    (mine, placed, files), (held, objects), (sync, staging, staged) = plan, state, how
    try:
        if not len(mine):
            staged()  # this rank writes nothing: the state is not read again
            return None
        values = [
            objects[key] if index < 0 else held.tensor(key, index) for key, index in mine.pairs()
        ]
        names = [file_name(rank, k, token) for k in range(files)]
        write_rank_file(path, names, (values, placed), serialization_id, sync, staging, staged)
        tensors = [v for v in values if isinstance(v, torch.Tensor)]
        report.tensors, report.objects = len(tensors), len(values) - len(tensors)
        report.bytes_written = sum(record_bytes(v) for v in values)
        report.files = files
    except Exception as e:  # noqa: BLE001 - raised on every rank by the next agreement
        return e
    return None
