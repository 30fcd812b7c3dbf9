"""`async_save`: a collective save whose writing runs in the background, its device
copies overlapping the caller's next steps (`SaveFuture.staged`)."""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_for
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ...comm.agreement import Agreement
from ...comm.communicator import gloo_group
from ...errors import InvalidArgumentError
from ...storage import Folder
from ..clients.megatron_returned import save_targets
from ..engine.adapters import adapted_for_save
from ..engine.inventory import serialize_objects
from ..engine.rank_file import Staging
from ..engine.staging import Staged, Stager
from .edge import _comm, _user_state, agree_route, agreement, open_target
from .save import PENDING, _check_target, _save, _save_arguments, _staging

__all__ = ["SaveFuture", "async_save"]


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
    path: str | Path | Folder,
    *,
    overwrite: bool = False,
    process_group: Any = None,
    storage_options: dict[str, Any] | None = None,
    wait: bool | float = False,
    staging: str = "blocking",
    staging_bytes: int | None = None,
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
    call also creates its gloo group, `dist.new_group`), then `saving`'s in the
    background (seven, or four when the plan is reused: `engine.saving`).
    """
    folder, problem = open_target(path, storage_options)
    if PENDING.future is not None:  # its error is its future's: never every later save's
        wait_for([PENDING.future])
    state_dict, user_problem = _user_state(state_dict)
    spec, staging_problem = _staging(staging_bytes)
    if staging not in _MODES:
        staging_problem = InvalidArgumentError(f"staging must be one of {_MODES}, got {staging!r}")
    where = folder.identity if folder is not None else repr(path)
    call = agreement(process_group, _save_arguments(where, overwrite, False))
    problem = problem or user_problem or staging_problem
    by_key = agree_route(state_dict, False, call, problem)
    assert folder is not None  # else `agree_route` raised its problem on every rank
    if by_key:  # as `save` stores them: Megatron's values under their Megatron keys
        state_dict = save_targets(state_dict, process_group, False)
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
        _check_target(folder, overwrite, call, local_problem=problem)
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
