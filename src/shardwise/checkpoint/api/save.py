"""`save` and `async_save`: collective saves of sharded state to a DCP checkpoint."""

from __future__ import annotations

import pickle
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_for
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultSavePlanner
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.api import CheckpointException

from ...errors import (
    CheckpointExistsError,
    UnsupportedStorageError,
)
from ...storage import Folder
from ..clients.megatron import metadata_json_problem, save_planner, write_metadata_json
from ..clients.megatron_returned import megatron_route, save_targets
from ..dcp.writer import Writer
from ..engine.adapters import adapted_for_save
from ..engine.saving import save_state
from ..engine.staging import Stager
from ..format.gc_pause import gc_paused
from ..io.commit import in_the_way
from .edge import (
    SaveInfo,
    _agree,
    _comm,
    _distributed,
    _folder,
    _unwrap,
    _user_state,
)


def _target_problem(
    path: Folder, overwrite: bool, process_group: Any, megatron: bool = False
) -> BaseException | None:
    """What rank 0 finds in the way of a save: a checkpoint (unless `overwrite`; other
    files are fine), a file, or a foreign `metadata.json` (for a Megatron-readable save)."""
    if _distributed(process_group) and dist.get_rank(process_group) != 0:
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


def _save_arguments(path: Folder, overwrite: bool, megatron: bool) -> tuple[str, Any]:
    return ("save path, overwrite and megatron", (path.identity, overwrite, megatron))


def _check_target(
    path: Folder,
    overwrite: bool,
    process_group: Any,
    state_dict: dict[str, Any] | None = None,
    megatron: bool = False,
    local_problem: BaseException | None = None,
) -> None:
    """Collective pre-save check: same path and flags everywhere, nothing in the
    way (`_target_problem`), objects picklable; `local_problem` (found by the
    caller on this rank) raised on every rank with the rest."""
    problem: BaseException | None = local_problem
    if state_dict is not None and problem is None:
        flat, _ = flatten_state_dict(state_dict)
        for key, value in flat.items():
            if not isinstance(value, torch.Tensor):
                try:
                    pickle.dumps(value)
                except Exception as e:  # noqa: BLE001 - any pickling failure
                    problem = TypeError(
                        f"object '{key}' cannot be pickled ({type(e).__name__}: {e})"
                    )
                    break
    problem = problem or _target_problem(path, overwrite, process_group, megatron)
    what, arguments = _save_arguments(path, overwrite, megatron)
    _agree(problem, process_group, arguments, what)


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

    Collective: six small `all_gather_object` per rank, whatever the number of
    tensors: the folder opens everywhere, the Megatron route, the adapted values,
    then `saving`'s inventory, checksums report and commit verdict. A state only
    DCP's own machinery saves leaves after the inventory for `dcp.save`, which adds
    its own four (`gather_object` + `scatter_object_list` to plan,
    `gather_object` + `broadcast_object_list` to finish).
    """
    path = _folder(path, storage_options, process_group)
    if _ASYNC.pending is not None:  # one save at a time: the next commit collects unnamed files
        wait_for([_ASYNC.pending])
    state_dict, problem = _user_state(state_dict)
    if megatron_route(state_dict, megatron, process_group, problem):  # raises `problem` everywhere
        # by Megatron key (as sharded_state_dict() returns it); megatron=True adds Megatron's files
        state_dict = save_targets(state_dict, process_group, megatron)
        _check_target(path, overwrite, process_group, state_dict, megatron)
        if megatron:
            _write_megatron_metadata(path, process_group)
        return _save_checked(state_dict, path, overwrite, process_group, save_planner(), wait)
    state_dict = adapted_for_save(state_dict, process_group)
    start = time.perf_counter()
    problem = _target_problem(path, overwrite, process_group)
    with gc_paused():
        saved = save_state(
            state_dict,
            path,
            _comm(process_group),
            problem,
            _save_arguments(path, overwrite, False),
            wait=wait,
            overwrite=overwrite,
        )
    if not saved:  # a value only DCP's own machinery saves: its target check already ran
        return _save_checked(state_dict, path, overwrite, process_group, wait=wait)
    return SaveInfo(path.checkpoint_id, time.perf_counter() - start)


def _write_megatron_metadata(path: Folder, process_group: Any) -> None:
    """Megatron's `metadata.json`, written by rank 0 before the data: its content
    never changes, so a crash at any later point leaves the old checkpoint as it
    was (only marked Megatron's, which Megatron refuses cleanly if it was not) or
    no `.metadata` (refused by both); never new data that only one of them opens."""
    problem: BaseException | None = None
    if not _distributed(process_group) or dist.get_rank(process_group) == 0:
        try:
            local = path.local_path
            assert local is not None  # refused by _target_problem otherwise
            write_metadata_json(local)
        except OSError as e:
            problem = e
    _agree(problem, process_group)


def _save_checked(
    state_dict: dict[str, Any],
    path: Folder,
    overwrite: bool,
    process_group: Any,
    planner: Any = None,
    wait: bool | float = False,
) -> SaveInfo:
    start = time.perf_counter()
    # overwrite=True: _check_target (or save_state, under the lease) refused the rest
    writer = Writer(path, overwrite=True, wait=wait)
    try:
        dcp.save(
            state_dict,
            storage_writer=writer,
            planner=planner or DefaultSavePlanner(dedup_save_to_lowest_rank=False),
            process_group=process_group,
        )
    except CheckpointException as e:
        raise _unwrap(e) from e
    finally:
        writer.release_lease()  # held still if the save failed on another rank
    return SaveInfo(path.checkpoint_id, time.perf_counter() - start)


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

    Collective: three small `all_gather_object` per rank before it returns (the
    folder, the adapted values, the target check; the first call also creates its
    gloo group, `dist.new_group`), then `saving`'s three in the background.
    """
    path = _folder(path, storage_options, process_group)
    if _ASYNC.pending is not None:  # its error is its future's: never every later save's
        wait_for([_ASYNC.pending])
    state_dict, problem = _user_state(state_dict)
    state_dict = adapted_for_save(state_dict, process_group, problem)
    staged: Any = None
    try:  # a value that cannot be staged on one rank fails every rank, not only that one
        staged = _ASYNC.stager.stage(state_dict)
        _ASYNC.stager.synchronize()
    except Exception as e:  # noqa: BLE001 - raised on every rank by _check_target
        problem = e
    _check_target(path, overwrite, process_group, state_dict, local_problem=problem)
    group = _ASYNC.group_for(process_group)
    _ASYNC.pending = _ASYNC.executor.submit(_save_staged, staged, path, overwrite, group, wait)
    return _ASYNC.pending


def _save_staged(
    state_dict: dict[str, Any], path: Folder, overwrite: bool, group: Any, wait: bool | float
) -> SaveInfo:
    """The background part of `async_save`, on its own group (targets already checked)."""
    start = time.perf_counter()
    arguments = _save_arguments(path, overwrite, False)
    if save_state(state_dict, path, _comm(group), None, arguments, wait=wait, overwrite=overwrite):
        return SaveInfo(path.checkpoint_id, time.perf_counter() - start)
    return _save_checked(state_dict, path, overwrite, group, wait=wait)
