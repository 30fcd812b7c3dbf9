"""`save` and `async_save`: collective saves of sharded state to a DCP checkpoint."""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_for
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch.distributed.checkpoint._nested_dict import flatten_state_dict

from ...comm.agreement import Agreement
from ...errors import (
    CheckpointExistsError,
    UnsupportedStorageError,
)
from ...storage import Folder
from ..clients.megatron_format import metadata_json_problem, write_metadata_json
from ..clients.megatron_returned import save_targets
from ..engine.adapters import adapted_for_save
from ..engine.inventory import serialize_objects
from ..engine.saving import save_state
from ..engine.staging import Stager
from ..format.gc_pause import gc_paused
from ..io.commit import in_the_way
from .edge import SaveInfo, _comm, _user_state, agree_route, agreement, open_target


def _target_problem(
    path: Folder, overwrite: bool, call: Agreement, megatron: bool = False
) -> BaseException | None:
    """What rank 0 finds in the way of a save: a checkpoint (unless `overwrite`; other
    files are fine), a file, or a foreign `metadata.json` (for a Megatron-readable save)."""
    if call.rank != 0:
        return None
    if path.is_file():
        return CheckpointExistsError(
            f"{path} is a file, not a checkpoint folder: save to a folder path"
        )
    existing = in_the_way(path)
    if existing and not overwrite:
        return CheckpointExistsError(existing)
    if megatron:
        local = path.local_path
        if local is None:
            return UnsupportedStorageError(
                f"megatron=True saves to a local folder (Megatron-Core's loader reads local "
                f"paths), not {path}"
            )
        return metadata_json_problem(local)
    return None


def _save_arguments(where: str, overwrite: bool, megatron: bool) -> tuple[str, Any]:
    return ("save path, overwrite and megatron", (where, overwrite, megatron))


def _check_target(
    path: Folder,
    overwrite: bool,
    call: Agreement,
    megatron: bool = False,
    local_problem: BaseException | None = None,
) -> None:
    """Collective pre-save check, one exchange of `call`: nothing in the way
    (`_target_problem`); `local_problem` (found by the caller on this rank) raised on
    every rank with the rest."""
    call.defer(local_problem or _target_problem(path, overwrite, call, megatron))
    call.exchange()


def save(
    state_dict: dict[str, Any],
    path: str | Path | Folder,
    *,
    overwrite: bool = False,
    process_group: Any = None,
    megatron: bool = False,
    storage_options: dict[str, Any] | None = None,
    wait: bool | float = False,
) -> SaveInfo:
    """Save `state_dict` to `path`. Collective.

    The checkpoint appears at `path` only once every rank's data is durable;
    an existing one is refused unless `overwrite=True`, which replaces it
    atomically. The folder may exist and hold other files: they are kept.
    Values may be `Stateful` (their `state_dict()` is saved), as with `dcp.save`.

    Megatron-Core's `sharded_state_dict()` saves as returned (replicas by
    `replica_id`, pieces of one key in several entries, ShardedObjects): its
    tensors under their Megatron key, main replicas only. `megatron=True` also
    makes it a checkpoint Megatron-Core's `dist_checkpointing.load` opens:
    every non-sharded value in Megatron's common state object (else each is
    stored under its dotted path), and Megatron's `metadata.json` (see
    `shardwise.checkpoint.clients.megatron_returned`).

    `path` may be an fsspec URL (`s3://bucket/ckpt`, `gs://...`, `memory://...`);
    `storage_options` go to its backend (e.g. s3fs's `endpoint_url`, `key`). On an
    object store the same guarantees hold, the commit record being written last
    (`shardwise.storage`).

    At most one save of a path runs at a time (a lease, `.shardwise.lock` in the
    folder): while another process saves there, this one raises
    `CheckpointBusyError` naming it, before writing anything — or, with
    `wait=True` (or `wait=` seconds), waits for it to finish. A lease whose
    holder died is broken, with a warning.

    Collective: four small `all_gather_object` per rank, whatever the number of
    tensors: the edge's one (the folder opens everywhere, one route, the same
    adapted values: `edge.agree_route`), then `saving`'s inventory, checksums
    report and commit verdict. By Megatron key, `save_targets`' own exchanges, the
    target check and (`megatron=True`) Megatron's `metadata.json` come before
    `saving`'s three.
    """
    folder, problem = open_target(path, storage_options)
    if _ASYNC.pending is not None:  # one save at a time: the next commit collects unnamed files
        wait_for([_ASYNC.pending])
    state_dict, user_problem = _user_state(state_dict)
    where = folder.identity if folder is not None else repr(path)
    call = agreement(process_group, _save_arguments(where, overwrite, megatron))
    by_key = agree_route(state_dict, megatron, call, problem or user_problem)
    assert folder is not None  # else `agree_route` raised its problem on every rank
    if by_key:
        # by Megatron key (as sharded_state_dict() returns it); megatron=True adds Megatron's files
        state_dict = save_targets(state_dict, process_group, megatron)
        _check_target(folder, overwrite, call, megatron)
        if megatron:
            _write_megatron_metadata(folder, call)
        # overwrite=True: _check_target refused a checkpoint in the way, and
        # Megatron's metadata.json is now in place
        return _save(state_dict, folder, call, wait, True)
    state_dict = adapted_for_save(state_dict, process_group, agreed=True)
    call.defer(_target_problem(folder, overwrite, call))
    return _save(state_dict, folder, call, wait, overwrite)


def _save(
    state_dict: dict[str, Any], path: Folder, call: Agreement, wait: bool | float, overwrite: bool
) -> SaveInfo:
    """The engine's save (`saving.save_state`) on the call's agreement, timed."""
    start = time.perf_counter()
    with gc_paused():
        save_state(state_dict, path, call, wait=wait, overwrite=overwrite)
    return SaveInfo(path.checkpoint_id, time.perf_counter() - start)


def _write_megatron_metadata(path: Folder, call: Agreement) -> None:
    """Megatron's `metadata.json`, written by rank 0 before the data: its content
    never changes, so a crash at any later point leaves the old checkpoint as it
    was (only marked Megatron's, which Megatron refuses cleanly if it was not) or
    no `.metadata` (refused by both); never new data that only one of them opens."""
    if call.rank == 0:
        try:
            local = path.local_path
            assert local is not None  # refused by _target_problem otherwise
            write_metadata_json(local)
        except OSError as e:
            call.defer(e)
    call.exchange()


class _AsyncSaver:
    """One background thread and one gloo group of its own, so the save's
    collectives never interleave with the training loop's on the default group."""

    def __init__(self) -> None:
        self.stager = Stager()
        self.executor = ThreadPoolExecutor(1, thread_name_prefix="shardwise-async-save")
        self.groups: dict[Any, Any] = {}
        self.pending: Future | None = None

    def group_for(self, process_group: Any) -> Any:
        if not (dist.is_available() and dist.is_initialized()):
            return None
        if process_group not in self.groups:  # collective: every rank gets here together
            ranks = None if process_group is None else dist.get_process_group_ranks(process_group)
            self.groups[process_group] = dist.new_group(ranks=ranks, backend="gloo")
        return self.groups[process_group]


_ASYNC = _AsyncSaver()


def async_save(
    state_dict: dict[str, Any],
    path: str | Path | Folder,
    *,
    overwrite: bool = False,
    process_group: Any = None,
    storage_options: dict[str, Any] | None = None,
    wait: bool | float = False,
) -> Future:
    """Stage `state_dict` and save it in the background. Collective.

    Returns once the state is copied into staging buffers (kept between calls),
    so the caller may modify it right away; `.result()` on the returned future
    waits for the commit and returns `SaveInfo` (or raises the save's error).
    A previous pending save is waited for first: its buffers are reused.
    `path`, `storage_options` and `wait` as for `save` (the lease is taken in the
    background: `.result()` raises its `CheckpointBusyError`).

    Collective: two small `all_gather_object` per rank before it returns (the
    folder and the adapted values; the staging, objects and target check; the first
    call also creates its gloo group, `dist.new_group`), then `saving`'s three in
    the background.
    """
    folder, problem = open_target(path, storage_options)
    if _ASYNC.pending is not None:  # its error is its future's: never every later save's
        wait_for([_ASYNC.pending])
    state_dict, user_problem = _user_state(state_dict)
    where = folder.identity if folder is not None else repr(path)
    call = agreement(process_group, _save_arguments(where, overwrite, False))
    agree_route(state_dict, False, call, problem or user_problem, by_megatron_key=False)
    assert folder is not None  # else `agree_route` raised its problem on every rank
    state_dict = adapted_for_save(state_dict, process_group, agreed=True)
    path = folder
    staged: Any = None
    try:  # a value that cannot be staged on one rank fails every rank, not only that one
        staged = _ASYNC.stager.stage(state_dict)
        _ASYNC.stager.synchronize()
    except Exception as e:  # noqa: BLE001 - raised on every rank by _check_target
        problem = e
    if problem is None:  # objects as the engine stores them: one unpicklable fails here
        problem = serialize_objects(flatten_state_dict(staged)[0])[1]
    _check_target(path, overwrite, call, local_problem=problem)
    group = _ASYNC.group_for(process_group)
    _ASYNC.pending = _ASYNC.executor.submit(_save_staged, staged, path, overwrite, group, wait)
    return _ASYNC.pending


def _save_staged(
    state_dict: dict[str, Any], path: Folder, overwrite: bool, group: Any, wait: bool | float
) -> SaveInfo:
    """The background part of `async_save`, on its own group (targets and arguments
    already checked in the foreground)."""
    return _save(state_dict, path, Agreement(_comm(group)), wait, overwrite)
