"""The public entry points: `save`, `async_save`, `load`, `read_tensor`.

Every entry point does the same at its edge before the engine runs: it opens
the folder once, checks its arguments the same on every rank, and lets a
registered client route its values; then it hands one `Agreement` to the
engine. `async_save` returns once the state is staged and writes in the
background; its future says when the checkpoint is committed.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_for
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.stateful import Stateful

from ..comm.agreement import Agreement, digest, require_same
from ..comm.communicator import Communicator, SingleProcess, communicator, gloo_group
from ..errors import (
    CheckpointExistsError,
    InvalidArgumentError,
    InvalidTypeError,
    ShardwiseError,
    UnsupportedStorageError,
)
from ..layout import Block
from ..storage import Folder, open_folder
from .clients import MEGATRON, metadata_json_problem, write_metadata_json
from .engine import (
    Route,
    SaveReport,
    Staged,
    Stager,
    Staging,
    Targets,
    adapted_for_load,
    adapted_for_save,
    held_adapted,
    load_state,
    require_same_adapted,
    route_named,
    route_of,
    routes,
    save_state,
    serialize_objects,
)
from .format import Manifest, gc_paused
from .io import in_the_way
from .io import staging_bytes as budget_of
from .offline import open_checkpoint

__all__ = ["LoadInfo", "SaveFuture", "SaveInfo", "async_save", "load", "read_tensor", "save"]

log = logging.getLogger("shardwise")


# -----------------------------------------------------------------------------
# What every entry point does at the API edge, before the engine runs: the folder
# opened, the caller's `Stateful` values read, and one exchange (`agree_route`)
# that raises any rank's problem so far on every rank and puts every rank on the
# same route (by Megatron key or by dict path, the same adapted values).
# -----------------------------------------------------------------------------


def _read_once(
    older: bool | None, read_once: bool | str | None
) -> tuple[bool | None, InvalidArgumentError | None]:
    """`load`'s read-once switch for the engine (None: where it pays), or what is wrong
    with it (raised on every rank by the call's first exchange)."""
    if older is not None:
        return bool(older), None
    if read_once == "auto" or read_once is None:
        return None, None
    if isinstance(read_once, bool):
        return read_once, None
    return None, InvalidArgumentError(f"read_once={read_once!r}: expected 'auto', True or False")


def _path_or_checkpoint_id(
    call: str, path: str | Path | Folder | None, checkpoint_id: str | Path | Folder | None
) -> str | Path | Folder:
    """The folder a call names: `path`, or DCP's keyword for it, `checkpoint_id=`
    (what `dcp.save` / `dcp.load` users type); one of them, not both."""
    if path is not None and checkpoint_id is not None:
        raise InvalidArgumentError(
            f"{call}() got both a path ({path!r}) and checkpoint_id={checkpoint_id!r}: "
            "checkpoint_id is DCP's name for the path; pass one of them"
        )
    found = path if path is not None else checkpoint_id
    if found is None:
        raise InvalidTypeError(
            f"{call}() needs the checkpoint's path: pass it positionally "
            f"(swc.{call}(state_dict, path)) or as checkpoint_id=, as DCP names it"
        )
    return found


@dataclass(frozen=True)
class SaveInfo:
    """What `save` returns: where the checkpoint is (a `Path`, or the URL), how
    long the save took, and the bytes this rank wrote to data files."""

    path: Path | str
    seconds: float
    bytes_written: int = 0


def _distributed(group: Any) -> bool:
    return dist.is_available() and dist.is_initialized()


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


def open_target(
    path: str | Path | Folder, storage_options: dict[str, Any] | None
) -> tuple[Folder | None, BaseException | None]:
    """`open_folder`, its refusal (an unknown scheme, a missing backend) returned for
    `agree_route` to raise on every rank."""
    try:
        return open_folder(path, storage_options), None
    except ShardwiseError as e:
        return None, e


def agreement(group: Any, arguments: tuple[str, Any]) -> Agreement:
    """The agreement of one collective call, made at its edge and carried through the
    engine: `arguments` (what they are, this rank's value) must be the same on every
    rank, checked at the first exchange."""
    return Agreement(_comm(group), arguments)


def agree_route(
    state_dict: Any,
    megatron: bool,
    agreement: Agreement,
    problem: BaseException | None,
    statefuls: tuple[str, ...] = (),
) -> Route | None:
    """The edge's one exchange (one fixed-size `all_reduce`; the values gathered only
    when they differ, to name the ranks): the client route this save or load takes
    (`engine.inventory.Route`, found by the classes of the state's values:
    Megatron-Core's when `megatron=True` or a Megatron value is on any rank), or
    None, checked so that every rank takes the same route. On a route the ranks'
    top-level `Stateful` keys must agree; off it, their adapted values too
    (`engine.inventory`). `problem` (this rank's failure so far: the folder, a
    `state_dict()`) is raised on every rank by the exchange, and the call's
    arguments are compared there (`agreement`)."""
    route = route_named(MEGATRON) if megatron else route_of(state_dict)
    mine_route = 0 if route is None else routes().index(route) + 1
    agreement.defer(problem)
    if agreement.world_size == 1:
        agreement.exchange()  # raises `problem`; nothing to compare with another rank
        return route
    held = None if route is not None or problem is not None else held_adapted(state_dict, statefuls)
    mine = digest((statefuls, held))
    any_route, most, least = agreement.agree([mine_route, mine, -mine])  # maxima
    if most == -least:  # the largest digest is the smallest: every rank holds the same
        return routes()[any_route - 1] if any_route else None
    everyone = agreement.exchange((mine_route, statefuls, held))  # to name what differs
    taken = max(r for r, _s, _h in everyone)
    if taken:
        require_same(
            [s for _r, s, _h in everyone],
            "their Stateful values",
            shown=str,
            verb="hold",
            fix="every rank must pass the same Stateful keys",
        )
        return routes()[taken - 1]
    require_same_adapted([h for _r, _s, h in everyone])
    return None


# -----------------------------------------------------------------------------
# `save` and `async_save`: collective saves of sharded state to a DCP checkpoint.
# -----------------------------------------------------------------------------


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
    path: str | Path | Folder | None = None,
    *,
    checkpoint_id: str | Path | Folder | None = None,
    overwrite: bool = False,
    process_group: Any = None,
    megatron: bool = False,
    storage_options: dict[str, Any] | None = None,
    wait: bool | float = False,
    staging_bytes: int | None = None,
    progress: Callable[[int], None] | None = None,
) -> SaveInfo:
    """Save `state_dict` to `path`. Collective.

    The checkpoint appears at `path` only once every rank's data is durable;
    an existing one is refused unless `overwrite=True`, which replaces it
    atomically. The folder may exist and hold other files: they are kept.
    Values may be `Stateful` (their `state_dict()` is saved), as with `dcp.save`.

    Megatron-Core's state dicts save as returned (model and optimizer
    `sharded_state_dict()`s, virtual pipeline chunks, factories, the distributed
    optimizer's buckets, ShardedObjects) as Megatron's `dist_checkpointing.save`
    saves them: tensors under their Megatron key, each block written once, every
    non-sharded value in Megatron's common state object, and in a local folder
    Megatron's `metadata.json`, so Megatron opens the checkpoint. `megatron=True`
    saves so without a Megatron value (see `shardwise.checkpoint.clients.megatron`).

    `checkpoint_id=` is accepted for `path`, as `dcp.save` names it.
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

    `progress(n)` is called with the bytes of each record this rank writes, as it
    goes to its file. Rank 0 logs what the save did and where the time went on the
    `shardwise` logger (INFO; every rank's detail at DEBUG).

    Collective, whatever the number of tensors: the edge's one fixed-size
    `all_reduce` (the folder opens everywhere, one route, the same adapted
    values: `api.agree_route`), then `engine.save`'s seven (a save of a structure this
    group saved before: four fixed-size `all_reduce`s, its plan reused), each rank's
    traffic O(what it holds and the keys it owns) whatever the world size
    (`engine.save`). By Megatron
    key, `save_targets`' own exchanges, the target check and (`megatron=True`)
    Megatron's `metadata.json` come before `engine.save`'s.
    """
    path = _path_or_checkpoint_id("save", path, checkpoint_id)
    folder, problem = open_target(path, storage_options)
    if PENDING.future is not None:  # one save at a time: the next commit collects unnamed files
        wait_for([PENDING.future])
    state_dict, user_problem = _user_state(state_dict)
    staging, staging_problem = _staging(staging_bytes)
    staging.progress = progress
    where = folder.identity if folder is not None else repr(path)
    call = agreement(process_group, _save_arguments(where, overwrite, megatron))
    route = agree_route(state_dict, megatron, call, problem or user_problem or staging_problem)
    assert folder is not None  # else `agree_route` raised its problem on every rank
    if route is not None:
        # by Megatron key (as sharded_state_dict() returns it), with Megatron's files
        state_dict = route.save_targets(state_dict, process_group)
        files = _megatron_files(route, folder, megatron)
        _check_target(folder, overwrite, call, files)
        if files:
            _write_megatron_metadata(folder, call)
        # overwrite=True: _check_target refused a checkpoint in the way, and
        # Megatron's metadata.json is now in place
        return _save(state_dict, folder, call, wait, True, staging)
    state_dict = adapted_for_save(state_dict, process_group, agreed=True)
    call.defer(_target_problem(folder, overwrite, call))
    return _save(state_dict, folder, call, wait, overwrite, staging)


def _megatron_files(route: Route, folder: Folder, megatron: bool) -> bool:
    """Whether a save on `route` writes Megatron's `metadata.json`: always with
    `megatron=True` (which refuses a remote folder), else on Megatron's route into a
    local folder (Megatron's loader reads local paths only)."""
    return megatron or (route.name == MEGATRON and folder.local_path is not None)


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
    """The engine's save (`engine.save.save_state`) on the call's agreement, timed and
    logged (rank 0, INFO)."""
    start = time.perf_counter()
    with gc_paused():
        report = SaveReport()
        save_state(
            state_dict, path, call, wait=wait, overwrite=overwrite, staging=staging, report=report
        )
    seconds = time.perf_counter() - start
    if call.rank == 0:
        log.info(
            "saved %s in %.3f s on %d ranks; rank 0 wrote %d tensors and %d objects, %s in "
            "%d files (plan %s; %s)",
            path,
            seconds,
            call.world_size,
            report.tensors,
            report.objects,
            _mib(report.bytes_written),
            report.files,
            "reused" if report.plan_reused else "made",
            ", ".join(f"{k} {v:.3f} s" for k, v in report.phases.items()),
        )
    return SaveInfo(path.checkpoint_id, seconds, report.bytes_written)


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f} MiB"


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


# -----------------------------------------------------------------------------
# `async_save`: a collective save whose writing runs in the background, its device
# copies overlapping the caller's next steps (`SaveFuture.staged`).
# -----------------------------------------------------------------------------


class SaveFuture(Future):
    """An asynchronous save: `.result()` is its `SaveInfo` once committed (or raises
    its error); `.staged` completes once the state may be modified again.

    `staging_completion` / `upload_completion` name the same two futures as DCP's
    `AsyncSaveResponse`. `.staged` completes also when the save fails: the state
    is then no longer read, and the error is `.result()`'s.
    """

    def __init__(self) -> None:
        super().__init__()
        self.staged: Future = Future()
        self._marking = threading.Lock()

    @property
    def staging_completion(self) -> Future:
        return self.staged

    @property
    def upload_completion(self) -> Future:
        return self

    def _mark_staged(self) -> None:
        with self._marking:  # from the caller's thread and the save's
            if not self.staged.done():
                self.staged.set_result(None)


class _AsyncSaver:
    """One background thread and one gloo group of its own, so the save's
    collectives never interleave with the training loop's on the default group."""

    def __init__(self) -> None:
        self.stager = Stager()
        self.executor = ThreadPoolExecutor(1, thread_name_prefix="shardwise-async-save")
        self.groups: dict[Any, tuple[Any, Any]] = {}  # (the default group then, ours)
        # `PENDING` names the save submitted last, so a later save waits for every earlier one
        self.submitting = threading.Lock()
        self.local = threading.local()  # `.saving` on the save thread while it saves

    def on_save_thread(self) -> bool:
        return getattr(self.local, "saving", False)

    def submit(self, future: SaveFuture, *args: Any) -> None:
        with self.submitting:
            PENDING.future = future
            self.executor.submit(_save_staged, future, *args)

    def group_for(self, process_group: Any) -> Any:
        if not (dist.is_available() and dist.is_initialized()):
            return None
        world = dist.group.WORLD
        kept = self.groups.get(process_group)
        if kept is None or kept[0] is not world:  # none yet, or made before a re-init
            # collective: every rank gets here together
            ranks = None if process_group is None else dist.get_process_group_ranks(process_group)
            kept = self.groups[process_group] = (world, gloo_group(ranks))
        return kept[1]


_ASYNC = _AsyncSaver()

_MODES = ("blocking", "background")


def async_save(
    state_dict: dict[str, Any],
    path: str | Path | Folder | None = None,
    *,
    checkpoint_id: str | Path | Folder | None = None,
    overwrite: bool = False,
    process_group: Any = None,
    storage_options: dict[str, Any] | None = None,
    wait: bool | float = False,
    staging: str = "blocking",
    staging_bytes: int | None = None,
    progress: Callable[[int], None] | None = None,
) -> SaveFuture:
    """Save `state_dict` in the background. Collective.

    Host tensors and objects are copied into buffers kept between calls before it
    returns; each save holds its buffers until it has written them, so saves in
    flight at once (from several threads) never share bytes. CUDA tensors are
    copied by the background save itself, through at most `staging_bytes` of
    pinned memory (as `save`), on a side stream that follows the caller's stream
    as it was at the call. `staging`:

    * "blocking" (default): return once every CUDA byte is on the host
      (`.staged` is done): the state may be modified right away;
    * "background": return once the copies are set going (milliseconds). The
      state must not change until `.staged` is done — in a training loop, save
      after `optimizer.step()`, let the next forward and backward run while the
      copies do, and wait for `.staged` before the next `optimizer.step()`.

    `.result()` on the returned `SaveFuture` waits for the commit and returns
    `SaveInfo` (or raises the save's error). A previous pending save is waited
    for first. `path`, `storage_options` and `wait` as for `save` (the lease is
    taken in the background: `.result()` raises its `CheckpointBusyError`).

    Collective: two fixed-size `all_reduce` per rank before it returns (the
    folder and the adapted values; the staging, objects and target check; the first
    call also creates its gloo group, `dist.new_group`), then `engine.save`'s in the
    background (seven, or four when the plan is reused: `engine.save`).
    `checkpoint_id=` is accepted for `path`, as `dcp.async_save` names it.
    `progress` and logging as for `save`, from the background thread.
    """
    path = _path_or_checkpoint_id("async_save", path, checkpoint_id)
    folder, problem = open_target(path, storage_options)
    if PENDING.future is not None:  # its error is its future's: never every later save's
        wait_for([PENDING.future])
    state_dict, user_problem = _user_state(state_dict)
    spec, staging_problem = _staging(staging_bytes)
    spec.progress = progress
    if staging not in _MODES:
        staging_problem = InvalidArgumentError(f"staging must be one of {_MODES}, got {staging!r}")
    where = folder.identity if folder is not None else repr(path)
    call = agreement(process_group, _save_arguments(where, overwrite, False))
    problem = problem or user_problem or staging_problem
    route = agree_route(state_dict, False, call, problem)
    assert folder is not None  # else `agree_route` raised its problem on every rank
    files = route is not None and _megatron_files(route, folder, False)
    if route is not None:  # as `save` stores them: Megatron's values under their Megatron keys
        state_dict = route.save_targets(state_dict, process_group)
    else:
        state_dict = adapted_for_save(state_dict, process_group, agreed=True)
    staged: Staged | None = None
    try:  # a value that cannot be staged on one rank fails every rank, not only that one
        staged = _ASYNC.stager.stage(state_dict)
        spec.after = _marks(staged.cuda_devices)
        # objects as the engine stores them: one unpicklable fails here
        problem = problem or serialize_objects(staged.objects)[1]
    except Exception as e:  # noqa: BLE001 - raised on every rank by _check_target
        problem = problem or e
    try:
        _check_target(folder, overwrite, call, files, local_problem=problem)
        if files:  # before any data, as `save` writes it
            _write_megatron_metadata(folder, call)
            overwrite = True  # `_check_target` refused a checkpoint in the way
        group = _ASYNC.group_for(process_group)
    except BaseException:
        if staged is not None:
            _ASYNC.stager.release(staged)
        raise
    assert staged is not None  # else `_check_target` raised its problem
    future = SaveFuture()
    spec.on_staged = future._mark_staged
    if _ASYNC.on_save_thread():
        # called by a done callback of an earlier save, on the one save thread: queued
        # behind the callback, it would wait for itself; it runs here instead
        _save_staged(future, staged, folder, overwrite, group, wait, spec)
        return future
    _ASYNC.submit(future, staged, folder, overwrite, group, wait, spec)
    if not staged.cuda_devices:
        future._mark_staged()  # every host value was copied by `stage`
    if staging == "blocking":
        future.staged.result()
    return future


def _marks(devices: set[int]) -> dict[int, torch.cuda.Event]:
    """An event on each device's current stream: the background copies follow it."""
    marks = {}
    for index in devices:
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(index))
        marks[index] = event
    return marks


def _save_staged(
    future: SaveFuture,
    staged: Staged,
    path: Folder,
    overwrite: bool,
    group: Any,
    wait: bool | float,
    staging: Staging,
) -> None:
    """The background part of `async_save`, on its own group (targets and arguments
    already checked in the foreground); its outcome goes to `future`. The staging
    buffers go back to the stager once the save no longer reads them."""
    outer, _ASYNC.local.saving = _ASYNC.on_save_thread(), True
    try:
        info = _save(staged.state, path, Agreement(_comm(group)), wait, overwrite, staging)
    except BaseException as e:  # noqa: BLE001 - the caller's `.result()` raises it
        _ASYNC.stager.release(staged)
        future._mark_staged()
        future.set_exception(e)
    else:
        _ASYNC.stager.release(staged)
        future._mark_staged()
        future.set_result(info)
    finally:
        _ASYNC.local.saving = outer


# -----------------------------------------------------------------------------
# `load` and `read_tensor`: filling sharded state in place from any checkpoint, any layout.
# -----------------------------------------------------------------------------


@dataclass(frozen=True, repr=False)
class LoadInfo:
    """What `load` returns: where the checkpoint is (a `Path`, or the URL), how long
    the load took, the bytes this rank read from data files, and the manifest it
    followed (None for a stock DCP checkpoint, whose `.metadata` it followed).
    Its repr is a summary (the manifest's counts and first keys): the fields hold
    the details."""

    path: Path | str
    seconds: float
    bytes_read: int
    manifest: Manifest | None

    def __repr__(self) -> str:
        m = self.manifest
        if m is None:
            followed = "None (stock DCP .metadata)"
        else:
            keys = [*m.tensors, *m.objects]
            shown = ", ".join(repr(k) for k in keys[:_REPR_KEYS])
            more = f", ... and {len(keys) - _REPR_KEYS} more" if len(keys) > _REPR_KEYS else ""
            followed = (
                f"<{len(m.tensors)} tensors, {len(m.objects)} objects, saved by "
                f"{m.world_size} ranks: {shown}{more}>"
            )
        return (
            f"LoadInfo(path={self.path!r}, seconds={self.seconds:.3f}, "
            f"bytes_read={self.bytes_read}, manifest={followed})"
        )


_REPR_KEYS = 3  # keys a LoadInfo's repr shows; `manifest` holds them all


def load(
    state_dict: dict[str, Any],
    path: str | Path | Folder | None = None,
    *,
    checkpoint_id: str | Path | Folder | None = None,
    strict: bool = True,
    verify: bool = True,
    cast_dtype: bool = False,
    process_group: Any = None,
    megatron: bool = False,
    storage_options: dict[str, Any] | None = None,
    trust_objects: bool = False,
    extension_registry: Any = None,
    staging_bytes: int | None = None,
    broadcast_replicated: bool | None = None,
    shape_mismatch: Iterable[str] = (),
    progress: Callable[[int], None] | None = None,
    read_once: bool | str | None = "auto",
) -> LoadInfo:
    """Fill `state_dict`'s tensors and objects in place from `path`. Collective.

    Targets may use any layout and world size: each rank reads only the byte
    ranges its targets need. `strict=True` requires every key of `state_dict`
    in the checkpoint (stored keys not asked for are fine, as with `dcp.load`).
    `checkpoint_id=` is accepted for `path`, as `dcp.load` names it.
    Stored values left unused because the target holds an empty mapping where they
    go (`optimizer.state` of an optimizer that has not stepped yet) are named in a
    warning on the `shardwise` logger (rank 0): nothing was restored there.
    Key, shape and dtype problems are all listed at
    once, on every rank, before any target is modified. `cast_dtype=True`
    casts stored values to each target's dtype instead (as `dcp.load` does,
    e.g. an fp32 checkpoint into a bf16 model). `Stateful` values are filled
    through their `state_dict()` / `load_state_dict()`, as with `dcp.load`.
    `shape_mismatch` names keys (dotted paths) whose stored global shape may differ
    from the target's (same number of dimensions): their overlap is loaded and the
    rest left as it is, as for a vocabulary padded to another multiple.
    Megatron-Core's `sharded_state_dict()` loads as Megatron's
    `dist_checkpointing.load` loads it, filled in place: its pieces are found
    anywhere and loaded by their Megatron key (factories merged, ShardedObjects'
    `data` by their unique key, `allow_shape_mismatch` pieces zeroed and their
    overlap loaded), and the checkpoint's common state merged into `state_dict`
    (`iteration`, `args`..., keys it lacks added); common values of a checkpoint
    without one are loaded by their dotted path. `megatron=True` takes that route
    without a Megatron value in `state_dict`.
    `path` may be an fsspec URL, `storage_options` its backend's options (as for `save`).
    A checkpoint is untrusted input: non-tensor values unpickle only as far as
    `torch.load(weights_only=True)` allows (plus `allow_object_globals`); anything
    else raises `UnsafeMetadataError` on every rank, before it runs.
    `trust_objects=True` unpickles them with plain `pickle` (only for checkpoints
    you trust). A stored tensor against a non-tensor target, or the reverse, is a
    `CheckpointMismatchError`, as with `dcp.load`. `extension_registry` (DCP's
    `ExtensionRegistry`, as `FileSystemReader`'s `_extension_registry`) decodes
    records written through custom stream extensions.
    CUDA targets are filled through at most `staging_bytes` of pinned host memory
    per rank (as `save`), reads overlapping the copies to the device on a side
    stream; when `load` returns, the copies are done.
    Each stored byte several ranks need can be read by one of them and sent to
    the others, so it leaves the storage once instead of once per rank
    (`read_once`): values every rank loads whole (plain tensors, replicated
    DTensors and ShardedTensors) by a broadcast, and the chunks of DTensors and
    ShardedTensors that several ranks' blocks overlap (DP replicas of TP shards,
    HSDP, a row-wise checkpoint loaded column-wise) by an exchange among them
    (`engine.read_once`), CPU targets only. `read_once="auto"` does so where it pays:
    an object store, a network file system, or ranks on several hosts; `True`
    always, `False` never. It applies when every rank loads the same such values
    with the same layouts. `broadcast_replicated` is its older name (it wins when
    given).
    Returns a `LoadInfo` (its `bytes_read` says what this rank read).
    `progress(n)` is called with the bytes of each read as it lands (from the
    reading threads, one call at a time). Rank 0 logs what the load did on the
    `shardwise` logger (INFO; every rank's detail, with its timings, at DEBUG).

    Collective: three fixed-size `all_reduce` per rank, whatever the number of
    tensors or the kind of checkpoint (shardwise, stock DCP, per-rank records): the
    edge's one exchange (`agree_route`: the folder opens everywhere, the Megatron
    route, the adapted values), then `engine.load`'s targets-fit check and read verdict;
    four when the state holds a `Stateful` (one more after its `load_state_dict()`);
    and when replicated values are broadcast, one `broadcast` per batch of them;
    when sharded chunks are exchanged, point-to-point messages in rounds of about
    64 MiB of a rank's targets and one more `all_reduce` (their verdict).
    """
    started = time.perf_counter()
    path = _path_or_checkpoint_id("load", path, checkpoint_id)
    folder, problem = open_target(path, storage_options)
    try:
        budget = budget_of(staging_bytes)
    except InvalidArgumentError as e:  # raised on every rank by `agree_route`
        budget, problem = 0, problem or e
    # Stateful values as their state dicts first (as dcp.load does), so that what they
    # hold is adapted too; filled back through load_state_dict after.
    statefuls = {k: v for k, v in state_dict.items() if _is_stateful(v)}
    plain, user_problem = _user_state(state_dict) if statefuls else (state_dict, None)
    where = folder.identity if folder is not None else repr(path)
    once, bad = _read_once(broadcast_replicated, read_once)
    problem = problem or bad
    call = agreement(
        process_group,
        (
            "load path, strict, cast_dtype, trust_objects and read_once (broadcast_replicated)",
            (where, strict, cast_dtype, trust_objects, once),
        ),
    )
    # the one exchange at the edge: raises either problem everywhere, one route for all
    route = agree_route(plain, megatron, call, problem or user_problem, tuple(sorted(statefuls)))
    assert folder is not None  # else `agree_route` raised its problem on every rank
    problem = None

    def read(targets: Targets) -> tuple[int, Manifest | None]:
        return _load_adapted(
            targets,
            folder,
            call,
            (strict, verify, cast_dtype, trust_objects),
            (extension_registry, budget, once, progress),
        )

    mismatch = frozenset(shape_mismatch)
    if route is not None:
        # by Megatron key, as sharded_state_dict() nests it
        targets = route.load_targets(plain, process_group)
        call.defer(targets.problem)  # raised on every rank by the load's first exchange
        done = read(targets._replace(shape_mismatch=targets.shape_mismatch | mismatch))
        for finish in targets.finishers:
            finish()
    else:
        # other libraries' values as ShardedTensors (agreed on by `agree_route`)
        with adapted_for_load(plain, process_group, agreed=True) as adapted:
            done = read(Targets(plain, [], mismatch))
            adapted.finish()
        if call.rank == 0:  # the same on every rank (agreed above): said once
            _warn_unused(plain, folder, done[1])
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
    for key in plain.keys() - state_dict.keys():  # added by a merged Megatron common state
        state_dict[key] = plain[key]
    if statefuls:  # every rank has the same Stateful keys (agreed above): all get here
        call.defer(problem)
        call.verdict()
    info = LoadInfo(folder.checkpoint_id, time.perf_counter() - started, *done)
    if call.rank == 0:
        manifest = info.manifest
        log.info(
            "loaded %s in %.3f s on %d ranks; rank 0 read %s (%s)",
            info.path,
            info.seconds,
            call.world_size,
            _mib(info.bytes_read),
            "stock DCP checkpoint"
            if manifest is None
            else f"saved by {manifest.world_size} ranks: {len(manifest.tensors)} tensors, "
            f"{len(manifest.objects)} objects",
        )
    return info


def _empty_mappings(value: Any, at: str = "") -> list[str]:
    """The dotted paths of the empty mappings in a state dict: places a stored value
    would go but that the load cannot fill, as flattening skips them."""
    if not isinstance(value, Mapping):
        return []
    if not value:
        return [at] if at else []
    found = []
    for key, inner in value.items():
        if isinstance(inner, Mapping):
            found += _empty_mappings(inner, f"{at}.{key}" if at else str(key))
    return found


def _warn_unused(state: dict[str, Any], folder: Folder, manifest: Manifest | None) -> None:
    """A warning naming the stored values under an empty mapping of `state` (an
    optimizer's `state` before its first step): `load` restored none of them, and
    `optimizer.load_state_dict` would then restore nothing, silently."""
    empty = _empty_mappings(state)
    if not empty:
        return
    if manifest is not None:
        stored = [*manifest.tensors, *manifest.objects]
    else:  # a stock checkpoint: its .metadata once more, only in this rare case
        try:
            stored = list(open_checkpoint(folder).metadata.state_dict_metadata)
        except (OSError, ValueError):  # the load itself read it: a race, not worth an error
            return
    prefixes = tuple(f"{p}." for p in empty)
    unused = [k for k in stored if k.startswith(prefixes)]
    if not unused:
        return
    places = sorted({p for p in empty if any(k.startswith(f"{p}.") for k in unused)})
    examples = ", ".join(repr(k) for k in unused[:3])
    log.warning(
        f"{len(unused)} stored value{'s' if len(unused) > 1 else ''} went unused (e.g. "
        f"{examples}): the state dict holds an empty {' and '.join(map(repr, places))} "
        "where they go, as an optimizer has before its first step, so nothing was "
        "restored there. Call shardwise.checkpoint.init_optimizer_state(optimizer) before "
        "building the state dict and loading (or build it with "
        "torch.distributed.checkpoint.state_dict.get_state_dict(model, optimizer), which "
        "initialises the optimizer state too)"
    )


def _load_adapted(
    targets: Targets,
    path: Folder,
    call: Agreement,
    checks: tuple[bool, bool, bool, bool],
    reading: tuple[Any, int, bool | None, Callable[[int], None] | None],
) -> tuple[int, Manifest | None]:
    """The engine's load of `targets`; `checks`: (strict, verify, cast_dtype,
    trust_objects); `reading`: (extension registry, staging budget, broadcast, progress)."""
    strict, verify, cast_dtype, trust_objects = checks
    extension_registry, budget, broadcast, progress = reading
    with gc_paused():
        return load_state(
            targets.flat,
            path,
            call,
            strict=strict,
            verify=verify,
            cast_dtype=cast_dtype,
            trust_objects=trust_objects,
            extension_registry=extension_registry,
            staging_bytes=budget,
            broadcast=broadcast,
            shape_mismatch=targets.shape_mismatch,
            optional=targets.optional,
            progress=progress,
        )


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


# -----------------------------------------------------------------------------
# The public entry points: `save`, `async_save`, `load`, `read_tensor`.
#
# `api` holds what each of them does first (open the folder on every rank, read
# the caller's `Stateful` values, agree on problems); `save` and `load` hand the
# state to the engine (`checkpoint.engine`).
# -----------------------------------------------------------------------------
