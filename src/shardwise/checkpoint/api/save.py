"""`save` and `async_save`: collective saves of sharded state to a DCP checkpoint."""

from __future__ import annotations

import time
from concurrent.futures import Future
from concurrent.futures import wait as wait_for
from pathlib import Path
from typing import Any

from ...comm.agreement import Agreement
from ...errors import (
    CheckpointExistsError,
    InvalidArgumentError,
    UnsupportedStorageError,
)
from ...storage import Folder
from ..clients.megatron_format import metadata_json_problem, write_metadata_json
from ..clients.megatron_returned import save_targets
from ..engine.adapters import adapted_for_save
from ..engine.rank_file import Staging
from ..engine.saving import save_state
from ..format.gc_pause import gc_paused
from ..io.commit import in_the_way
from ..io.host_slabs import staging_bytes as budget_of
from .edge import SaveInfo, _user_state, agree_route, agreement, open_target


class _Pending:
    """The asynchronous save in flight, if any: a later save of this process waits for it."""

    future: Future | None = None


PENDING = _Pending()


def _target_problem(
    path: Folder, overwrite: bool, call: Agreement, megatron: bool = False
) -> BaseException | None:
    """What rank 0 finds in the way of a save: a checkpoint (unless `overwrite`; other
    files are fine), a file, or a foreign `metadata.json` (for a Megatron-readable save).
    Returned, never raised: every rank raises it at the next verdict, none waits alone."""
    if call.rank != 0:
        return None
    try:
        return _in_the_way(path, overwrite, megatron)
    except Exception as e:  # noqa: BLE001 - the folder's own problem, for every rank
        return e


def _in_the_way(path: Folder, overwrite: bool, megatron: bool) -> BaseException | None:
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
    call.verdict()


def save(
    state_dict: dict[str, Any],
    path: str | Path | Folder,
    *,
    overwrite: bool = False,
    process_group: Any = None,
    megatron: bool = False,
    storage_options: dict[str, Any] | None = None,
    wait: bool | float = False,
    staging_bytes: int | None = None,
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

    CUDA tensors are copied to the host through at most `staging_bytes` of pinned
    memory per rank (default: `SHARDWISE_STAGING_BYTES`, else 1 GiB), on a side
    stream that follows the caller's current stream, while earlier copies are
    checksummed and written; a larger state goes in waves.

    Collective, whatever the number of tensors: the edge's one fixed-size
    `all_reduce` (the folder opens everywhere, one route, the same adapted
    values: `edge.agree_route`), then `saving`'s seven (a save of a structure this
    group saved before: four fixed-size `all_reduce`s, its plan reused), each rank's
    traffic O(what it holds and the keys it owns) whatever the world size
    (`engine.saving`). By Megatron
    key, `save_targets`' own exchanges, the target check and (`megatron=True`)
    Megatron's `metadata.json` come before `saving`'s.
    """
    folder, problem = open_target(path, storage_options)
    if PENDING.future is not None:  # one save at a time: the next commit collects unnamed files
        wait_for([PENDING.future])
    state_dict, user_problem = _user_state(state_dict)
    staging, staging_problem = _staging(staging_bytes)
    where = folder.identity if folder is not None else repr(path)
    call = agreement(process_group, _save_arguments(where, overwrite, megatron))
    by_key = agree_route(state_dict, megatron, call, problem or user_problem or staging_problem)
    assert folder is not None  # else `agree_route` raised its problem on every rank
    if by_key:
        # by Megatron key (as sharded_state_dict() returns it); megatron=True adds Megatron's files
        state_dict = save_targets(state_dict, process_group, megatron)
        _check_target(folder, overwrite, call, megatron)
        if megatron:
            _write_megatron_metadata(folder, call)
        # overwrite=True: _check_target refused a checkpoint in the way, and
        # Megatron's metadata.json is now in place
        return _save(state_dict, folder, call, wait, True, staging)
    state_dict = adapted_for_save(state_dict, process_group, agreed=True)
    call.defer(_target_problem(folder, overwrite, call))
    return _save(state_dict, folder, call, wait, overwrite, staging)


def _staging(given: int | None) -> tuple[Staging, BaseException | None]:
    """The staging budget asked for, or the problem every rank raises at the first exchange."""
    try:
        return Staging(budget_of(given)), None
    except InvalidArgumentError as e:
        return Staging(), e


def _save(
    state_dict: dict[str, Any],
    path: Folder,
    call: Agreement,
    wait: bool | float,
    overwrite: bool,
    staging: Staging,
) -> SaveInfo:
    """The engine's save (`saving.save_state`) on the call's agreement, timed."""
    start = time.perf_counter()
    with gc_paused():
        save_state(state_dict, path, call, wait=wait, overwrite=overwrite, staging=staging)
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
    call.verdict()
