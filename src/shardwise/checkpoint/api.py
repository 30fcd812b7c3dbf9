"""`save`, `load`, `read_tensor`: checkpoints of sharded state over DCP.

`save` and `load` are collective (every rank calls them with its own state
dict) and check everything they can before touching disk or targets: a
problem on any rank is raised, listing every offending key, on every rank.
`read_tensor` works offline, in one process, with no process group.
"""

from __future__ import annotations

import pickle
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_for
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata
from torch.distributed.checkpoint.stateful import Stateful

from ..comm.agreement import exchange, require_same
from ..comm.communicator import Communicator, SingleProcess, communicator
from ..errors import (
    CheckpointExistsError,
    CheckpointMismatchError,
    ShardwiseError,
    UnsupportedStorageError,
)
from ..layout import Block
from ..storage import Folder, open_folder
from .adapters import adapted_for_load, adapted_for_save
from .commit import in_the_way, per_rank_records
from .gc_pause import gc_paused
from .loading import load_state
from .megatron import metadata_json_problem, save_planner, write_metadata_json
from .megatron_returned import load_targets, megatron_route, save_targets
from .offline import open_checkpoint
from .reader import Reader
from .saving import save_state
from .staging import Stager
from .writer import Writer

__all__ = ["SaveInfo", "async_save", "load", "read_tensor", "save"]


@dataclass(frozen=True)
class SaveInfo:
    """What `save` returns: where the checkpoint is (a `Path`, or the URL) and how
    long the save took."""

    path: Path | str
    seconds: float


def _distributed(group: Any) -> bool:
    return dist.is_available() and dist.is_initialized()


def _agree(
    problem: BaseException | None, group: Any, arguments: Any = None, what: str = ""
) -> None:
    """Raise `problem` (from any rank) on every rank; locally when not distributed.
    Ranks must also have passed the same `arguments` (path, flags)."""
    if _distributed(group):
        require_same(exchange(problem, arguments, group), what)
    elif problem is not None:
        raise problem


def _unwrap(e: CheckpointException) -> BaseException:
    """DCP wraps per-rank failures; surface the first real one, same type on every rank."""
    for failure in e.failures.values():
        inner = failure[0] if isinstance(failure, tuple) else failure
        if isinstance(inner, (ShardwiseError, OSError, ValueError)):
            return inner
    return e


def _is_stateful(value: Any) -> bool:
    return not isinstance(value, torch.Tensor) and isinstance(value, Stateful)


def _state_dicts_of(state_dict: dict[str, Any]) -> dict[str, Any]:
    """Top-level `Stateful` values (a model, an optimizer wrapper) replaced by
    their `state_dict()`, as `dcp.save` does, before anything looks inside."""
    return {k: v.state_dict() if _is_stateful(v) else v for k, v in state_dict.items()}


def _user_state(state_dict: dict[str, Any]) -> tuple[dict[str, Any], BaseException | None]:
    """`_state_dicts_of`, with a failure of the caller's `state_dict()` returned, not
    raised: it rides on the first exchange, so every rank raises it together (a rank
    raising alone would leave the others waiting in a collective)."""
    out: dict[str, Any] = {}
    for key, value in state_dict.items():
        if not _is_stateful(value):
            out[key] = value
            continue
        try:
            out[key] = value.state_dict()
        except Exception as e:  # noqa: BLE001 - the caller's own code: raised on every rank
            return {}, e
    return out, None


def _comm(process_group: Any) -> Communicator:
    return communicator(process_group) if _distributed(process_group) else SingleProcess()


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


def _folder(
    path: str | Path | Folder, storage_options: dict[str, Any] | None, process_group: Any
) -> Folder:
    """`open_folder`, its refusal (an unknown scheme, a missing backend) raised on every rank."""
    problem: BaseException | None = None
    folder: Folder | None = None
    try:
        folder = open_folder(path, storage_options)
    except ShardwiseError as e:
        problem = e
    _agree(problem, process_group)
    assert folder is not None
    return folder


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
    `shardwise.checkpoint.megatron_returned`).

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


def _mismatches(state_dict: dict[str, Any], metadata: Any, strict: bool, cast: bool) -> list[str]:
    flat, _ = flatten_state_dict(_state_dicts_of(state_dict))
    stored = metadata.state_dict_metadata
    problems = []
    for key, value in flat.items():
        md = stored.get(key)
        if md is None:
            if strict:
                problems.append(f"'{key}' is missing from the checkpoint")
            continue
        if isinstance(md, TensorStorageMetadata) and not _fills_as_tensor(value):
            # dcp.load refuses this too (strict or not): the value would stay as it was
            problems.append(
                f"'{key}' is a Python {type(value).__name__} here but a tensor in the checkpoint"
            )
        if isinstance(value, torch.Tensor):
            if not isinstance(md, TensorStorageMetadata):
                problems.append(f"'{key}' is a tensor here but a Python object in the checkpoint")
                continue
            if tuple(value.shape) != tuple(md.size):
                problems.append(
                    f"'{key}' shape {tuple(value.shape)} here, {tuple(md.size)} in the checkpoint"
                )
            if value.dtype != md.properties.dtype and not cast:
                problems.append(
                    f"'{key}' dtype {value.dtype} here, {md.properties.dtype} in the checkpoint"
                )
    # Keys stored but not asked for are fine, as with `dcp.load`: loading only the
    # model from a model + optimizer checkpoint is a partial state dict, not an error.
    return problems


def _fills_as_tensor(value: Any) -> bool:
    """A target DCP fills from stored chunks: a tensor or a `_Checkpointable`."""
    return isinstance(value, torch.Tensor) or hasattr(type(value), "__create_chunk_list__")


def load(
    state_dict: dict[str, Any],
    path: str | Path | Folder,
    *,
    strict: bool = True,
    verify: bool = True,
    cast_dtype: bool = False,
    process_group: Any = None,
    megatron: bool = False,
    storage_options: dict[str, Any] | None = None,
    trust_objects: bool = False,
    extension_registry: Any = None,
) -> Reader:
    """Fill `state_dict`'s tensors and objects in place from `path`. Collective.

    Targets may use any layout and world size: each rank reads only the byte
    ranges its targets need. `strict=True` requires every key of `state_dict`
    in the checkpoint (stored keys not asked for are fine, as with `dcp.load`).
    Key, shape and dtype problems are all listed at
    once, on every rank, before any target is modified. `cast_dtype=True`
    casts stored values to each target's dtype instead (as `dcp.load` does,
    e.g. an fp32 checkpoint into a bf16 model). `Stateful` values are filled
    through their `state_dict()` / `load_state_dict()`, as with `dcp.load`.
    Megatron-Core's `sharded_state_dict()` loads as it nests it: its pieces are
    found anywhere and loaded by their Megatron key (ShardedObjects' `data` by
    their unique key), the way Megatron and `swc.save` store them; other values
    by their dotted path, or, with `megatron=True` (a Megatron-format
    checkpoint), left as they are (`shardwise.checkpoint.megatron.read_common_state`).
    `path` may be an fsspec URL, `storage_options` its backend's options (as for `save`).
    A checkpoint is untrusted input: non-tensor values unpickle only as far as
    `torch.load(weights_only=True)` allows (plus `allow_object_globals`); anything
    else raises `UnsafeMetadataError` on every rank, before it runs.
    `trust_objects=True` unpickles them with plain `pickle` (only for checkpoints
    you trust). A stored tensor against a non-tensor target, or the reverse, is a
    `CheckpointMismatchError`, as with `dcp.load`. `extension_registry` (DCP's
    `ExtensionRegistry`, as `FileSystemReader`'s `_extension_registry`) decodes
    records written through custom stream extensions.
    Returns the reader (its `bytes_read` says what this rank read).

    Collective: five small `all_gather_object` per rank, whatever the number of
    tensors (the folder opens everywhere, the Megatron route, the adapted values,
    then `loading`'s targets-fit check and read verdict), six when the state holds
    a `Stateful` (one more after its `load_state_dict()`). A checkpoint without
    `shardwise.json` (stock DCP) leaves after the targets-fit check: one more
    agreement, then `dcp.load`'s own three (`gather_object` + `scatter_object_list`
    to plan, `all_gather_object` to read).
    """
    path = _folder(path, storage_options, process_group)
    # Stateful values as their state dicts first (as dcp.load does), so that what they
    # hold is adapted too; filled back through load_state_dict after.
    statefuls = {k: v for k, v in state_dict.items() if _is_stateful(v)}
    plain, problem = _user_state(state_dict) if statefuls else (state_dict, None)
    # the exchange raises `problem` everywhere and makes every rank take the same route

    def read(targets: dict[str, Any]) -> Reader:
        return _load_adapted(
            targets,
            path,
            strict,
            verify,
            cast_dtype,
            process_group,
            trust_objects,
            extension_registry,
        )

    if megatron_route(plain, megatron, process_group, problem, tuple(sorted(statefuls))):
        # by Megatron key, as sharded_state_dict() nests it; megatron=True: rest left as is
        targets, finishers = load_targets(plain, process_group, megatron)
        reader = read(targets)
        for finish in finishers:
            finish()
    else:
        # other libraries' values as ShardedTensors; every rank agrees on the Stateful keys
        with adapted_for_load(plain, process_group, None, tuple(sorted(statefuls))) as adapted:
            reader = read(plain)
            adapted.finish()
    # As dcp.load ends: Stateful values load their state, every other top-level value
    # is assigned back (`state_dict[key] = ...`, which a dict subclass may observe).
    for key in sorted(state_dict):  # sorted: load_state_dict may be collective
        if key in statefuls:
            try:  # every rank still calls the others: they may be collective
                statefuls[key].load_state_dict(plain[key])
            except Exception as e:  # noqa: BLE001 - the caller's own code: raised on every rank
                problem = problem or e
        elif key in plain:
            state_dict[key] = plain[key]
    if statefuls:  # every rank has the same Stateful keys (agreed above): all get here
        _agree(problem, process_group)
    return reader


def _load_adapted(
    state_dict: dict[str, Any],
    path: Folder,
    strict: bool,
    verify: bool,
    cast_dtype: bool,
    process_group: Any,
    trust_objects: bool = False,
    extension_registry: Any = None,
) -> Reader:
    reader = Reader(path, extension_registry, verify=verify, trust_objects=trust_objects)
    arguments = (
        "load path, strict, cast_dtype and trust_objects",
        (path.identity, strict, cast_dtype, trust_objects),
    )
    with gc_paused():
        read = load_state(
            state_dict,
            path,
            _comm(process_group),
            arguments,
            strict=strict,
            verify=verify,
            cast_dtype=cast_dtype,
            trust_objects=trust_objects,
        )
    if read is not None:
        reader.bytes_read, reader.manifest = read
        return reader
    return _load_through_dcp(reader, state_dict, path, strict, cast_dtype, process_group)


def _load_through_dcp(
    reader: Reader,
    state_dict: dict[str, Any],
    path: Folder,
    strict: bool,
    cast_dtype: bool,
    process_group: Any,
) -> Reader:
    """Stock checkpoints, per-rank records, transformed chunks: `dcp.load` with `Reader`."""
    problem: BaseException | None = None
    try:
        try:
            metadata = reader.read_metadata()
        except FileNotFoundError:
            if not per_rank_records(path):
                raise
            # saved with use_collectives=False: each rank reads its own records, as dcp.load does
            metadata = reader.read_metadata(
                rank=dist.get_rank(process_group) if _distributed(process_group) else 0
            )
        found = _mismatches(state_dict, metadata, strict, cast_dtype)
        if found:
            problem = CheckpointMismatchError(f"{path}: " + "; ".join(found))
    except (ShardwiseError, OSError, ValueError, pickle.UnpicklingError) as e:
        problem = e
    _agree(
        problem,
        process_group,
        (path.identity, strict, cast_dtype, reader.trust_objects),
        "load path, strict, cast_dtype and trust_objects",
    )
    try:
        dcp.load(
            state_dict,
            storage_reader=reader,
            planner=DefaultLoadPlanner(allow_partial_load=not strict),
            process_group=process_group,
        )
    except CheckpointException as e:
        raise _unwrap(e) from e
    return reader


def read_tensor(
    path: str | Path,
    fqn: str,
    region: Block | None = None,
    *,
    storage_options: dict[str, Any] | None = None,
    extension_registry: Any = None,
) -> torch.Tensor:
    """Read tensor `fqn` (or only `region` of it, in global coordinates) offline.

    One process, no process group; reads only the bytes of the region (ranged
    GETs when `path` is a URL). `extension_registry` as for `load`.
    """
    ckpt = open_checkpoint(
        path, storage_options=storage_options, extension_registry=extension_registry
    )
    return ckpt.read(fqn, region)
