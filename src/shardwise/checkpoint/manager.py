"""`CheckpointManager`: numbered checkpoints under one root — step folders, the
latest committed step, restore, and retention (keep the last N, keep every K-th).

Each step is an ordinary shardwise checkpoint (`swc.save`) in a folder of the root
named `step_{step:08d}` (`step_00000100`; a step past 99,999,999 takes more digits).
Names are parsed strictly: a folder is a step folder only when formatting its number
gives its name back, so `step_100`, `step_00000100.bak` or `notes/` are not the
manager's and are never listed, restored or deleted.

Whether a step is committed is the library's own answer, never a folder's existence:
`engine.read_records` on the step folder, which reads the commit records (the
manifest's head and the tail of DCP's `.metadata`), no tensor data, and raises
`IncompleteCheckpointError` for a save that never committed (killed, or still
running: its lease is there). A step folder being deleted by a manager carries
`RETIRING` from before its records go: it is never committed again.
"""

from __future__ import annotations

import logging
import re
import threading
import warnings
from collections import Counter
from concurrent.futures import Future
from pathlib import Path
from typing import Any

from ..errors import (
    CheckpointNotFoundError,
    IncompleteCheckpointError,
    InvalidArgumentError,
    InvalidTypeError,
    ShardwiseError,
)
from ..storage import Folder, open_folder
from ..storage.folder import TEMPORARY
from .api import SaveFuture, SaveInfo, agreement, async_save, load, save
from .engine import read_records
from .format import DATA_FILE, GLOBAL_RECORDS, LOCK_NAME, MARKER
from .io import live_scopes, referenced_files

__all__ = ["RETIRING", "STEP_FOLDER", "CheckpointManager", "step_folder", "step_of"]

log = logging.getLogger("shardwise.checkpoint")

STEP_FOLDER = re.compile(r"step_(\d{8,})", re.ASCII)

# Written into a step folder before a manager removes its first record, removed last:
# the step is no longer committed, and a later retention finishes what a killed one began.
RETIRING = ".shardwise.retiring"

# data files named as stock `dcp.save` names them: deleted only when a record names them
_STOCK_DATA = re.compile(r"__\d+_\d+\.distcp", re.ASCII)

_COMMITTED, _RETIRED, _UNFINISHED = "committed", "retiring", "not committed"


def step_folder(step: int) -> str:
    """The name of the folder of `step` under a manager's root: `step_00000100`."""
    return f"step_{step:08d}"


def step_of(name: str) -> int | None:
    """The step whose folder `name` is (`step_folder`'s inverse), else None."""
    m = STEP_FOLDER.fullmatch(name)
    if m is None:
        return None
    step = int(m.group(1))
    return step if step_folder(step) == name else None


def _step(step: Any) -> int:
    if isinstance(step, bool) or not isinstance(step, int):
        raise InvalidTypeError(f"step must be an int, got {type(step).__name__} {step!r}")
    if step < 0:
        raise InvalidArgumentError(f"step must be >= 0, got {step}")
    return step


def _count(name: str, value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidTypeError(f"{name} must be an int or None, got {type(value).__name__}")
    if value < 1:
        raise InvalidArgumentError(f"{name} must be >= 1 (or None to keep every step), got {value}")
    return value


# -----------------------------------------------------------------------------
# The steps of this process in use: restored (held) or being deleted (claimed).
#
# One table for every manager of the process, keyed by (root identity, step), so
# two managers of one root see each other. A step is never both: retention claims
# only steps nobody holds, and `hold` waits while a step is claimed (then finds it
# gone). Other processes are not covered (see `CheckpointManager`).
# -----------------------------------------------------------------------------


class _InUse:
    def __init__(self) -> None:
        self._changed = threading.Condition()
        self._held: Counter[tuple[str, int]] = Counter()
        self._claimed: set[tuple[str, int]] = set()

    def hold(self, key: tuple[str, int]) -> None:
        with self._changed:
            while key in self._claimed:
                self._changed.wait()
            self._held[key] += 1

    def release(self, key: tuple[str, int]) -> None:
        with self._changed:
            self._held[key] -= 1
            if self._held[key] <= 0:
                del self._held[key]
            self._changed.notify_all()

    def claim(self, keys: list[tuple[str, int]]) -> list[tuple[str, int]]:
        """Of `keys`, those nobody holds or claims, claimed (for deletion) at once."""
        with self._changed:
            free = [k for k in keys if not self._held[k] and k not in self._claimed]
            self._claimed.update(free)
            return free

    def unclaim(self, keys: list[tuple[str, int]]) -> None:
        with self._changed:
            self._claimed.difference_update(keys)
            self._changed.notify_all()


_IN_USE = _InUse()


class CheckpointManager:
    """Numbered checkpoints under one root: save a step, find the latest committed
    one, restore it, and keep only the last `keep_last` (plus every `keep_every`-th)::

        import shardwise.checkpoint as swc

        manager = swc.CheckpointManager("ckpt", keep_last=3, keep_every=1000)
        start = manager.restore(state, missing_ok=True) or 0  # collective: latest committed
        for step in range(start + 1, steps + 1):
            train_one_step(state)
            if step % 100 == 0:
                manager.save(step, state)            # collective; then retention
        manager.wait_until_finished()                # after `save(..., async_=True)`

    `root` is a local path or an fsspec URL (`s3://bucket/run`, `memory://run`),
    `storage_options` its backend's options. Step `s` lives in `root/step_{s:08d}`
    (`step_folder`); anything else under the root is ignored and never deleted.
    `process_group`: the group of every collective call (default: the world).

    Which methods are collective (every rank of the group calls them, in the
    same order) and what each rank does:

    * `save(step, state)` — collective, as `swc.save` (refuses a step that is
      already there: `CheckpointExistsError`). Once it has committed, one fixed-size
      `all_reduce` (a barrier), then retention on rank 0 only.
      `async_=True` returns `swc.async_save`'s `SaveFuture`; retention runs on rank
      0 once that save has committed (its commit record proves every rank's data
      is durable), on the save's thread; `wait_until_finished()` waits for both.
    * `restore(state, step=None)` — collective, as `swc.load` (`**options` go to it):
      rank 0 alone lists the root and picks the step (the latest committed one when
      `step` is None), every rank learns it from one fixed-size `all_reduce`; then
      `swc.load` of that step. Returns the step restored. None committed:
      `CheckpointNotFoundError` naming the root, on every rank (with
      `missing_ok=True`, None and `state` untouched).
    * `steps()`, `latest()` — not collective: the calling rank lists the root
      itself (one listing, then per step folder one listing and a read of its
      commit records' heads, no tensor data; `latest()` stops at the first
      committed one from the top). `path(step)`: where a step is saved, for
      `swc.load` / `swc.inspect` / `swc.verify` (nothing listed).

    Per rank, whatever the world size: ranks other than 0 never list the root; rank
    0 reads the root's listing and the commit records of the step folders (O(step
    folders), which retention keeps at about `keep_last` plus the kept multiples).

    `latest()` and `steps()` return committed steps only: a step whose save was
    killed, is still running (its lease is there), or whose records cannot be read
    is never returned, nor one a manager is deleting (`RETIRING`).

    Retention (`keep_last` set): after a save commits, rank 0 keeps the
    `keep_last` newest committed steps, every committed step divisible by
    `keep_every`, and the step just saved; of the rest it deletes only committed
    step folders, and never:

    * a step folder that is not committed: a save of another writer may be
      running there, and staleness is not proven, so it is left for good (remove
      it by hand; the manager never touches it);
    * a step being restored in this process (any thread, any manager of the same
      root): `restore` holds it from before it checks the commit until `swc.load`
      returns, and retention skips held steps (and a restore waits for a deletion
      of its step that began first, then finds it gone);
    * a step whose folder holds a live save lease (an overwrite by someone else).

    Deleting a step writes `RETIRING` into its folder (durably), removes the
    manifest and `.metadata` (from here no reader opens it: shardwise reports it
    incomplete), then the data files, temporaries and lock records of the
    checkpoint, the marker and `RETIRING`, and the folder if nothing else is left.
    Files the checkpoint did not write stay (and the folder with them). A deletion
    killed halfway is finished by the next retention. Through the storage layer
    (`Folder.remove`), local or fsspec alike; a file that cannot be removed is
    warned about and retried by the next retention — the save stands.

    Across processes nothing is held: a restore or `swc.load` of a step in another
    process (or on another host) is not seen by this one's retention, so keep
    `keep_last` large enough for readers outside the training job (an evaluator),
    or copy the step first; such a reader whose step is deleted under it fails
    with `IncompleteCheckpointError` or a missing file, never with wrong values.
    Two managers saving to one root from two jobs are not supported.
    """

    def __init__(
        self,
        root: str | Path | Folder,
        *,
        keep_last: int | None = None,
        keep_every: int | None = None,
        storage_options: dict[str, Any] | None = None,
        process_group: Any = None,
    ) -> None:
        self.keep_last = _count("keep_last", keep_last)
        self.keep_every = _count("keep_every", keep_every)
        if self.keep_every is not None and self.keep_last is None:
            raise InvalidArgumentError(
                "keep_every keeps steps beyond the last keep_last; without keep_last every "
                "step is kept already: pass keep_last too"
            )
        self.root = open_folder(root, storage_options)
        self.process_group = process_group
        self._identity = self.root.identity
        self._retaining = threading.Lock()
        self._pending: tuple[SaveFuture, Future] | None = None

    def __repr__(self) -> str:
        return (
            f"CheckpointManager({self.root.location!r}, keep_last={self.keep_last!r}, "
            f"keep_every={self.keep_every!r})"
        )

    def path(self, step: int) -> Path | str:
        """Where `step` is saved (a `Path`, or the URL), whether or not it exists: what
        `swc.load`, `swc.inspect` or `swc.verify` take."""
        return self.root.child(step_folder(_step(step))).checkpoint_id

    # -- looking (any rank, not collective) ------------------------------------------------------

    def steps(self) -> list[int]:
        """The committed steps under the root, ascending."""
        return [s for s in self._listed() if self._status(s)[0] == _COMMITTED]

    def latest(self) -> int | None:
        """The newest committed step, or None: never a step whose save did not commit."""
        for step in reversed(self._listed()):
            if self._status(step)[0] == _COMMITTED:
                return step
        return None

    def _listed(self) -> list[int]:
        """Every step folder's step, ascending (one listing of the root)."""
        return sorted(s for s in map(step_of, self.root.folders()) if s is not None)

    def _status(self, step: int) -> tuple[str, BaseException | None]:
        """Whether `step` is committed (its records read and checked, no data), being
        deleted, or neither (with the reason)."""
        folder = self.root.child(step_folder(step))
        listing = folder.sizes()
        if RETIRING in listing:
            return _RETIRED, None
        try:
            read_records(folder, listing=listing)
        except (IncompleteCheckpointError, CheckpointNotFoundError) as e:
            return _UNFINISHED, e
        except (ShardwiseError, OSError, ValueError) as e:  # damaged records: never committed
            log.warning("%s is not a committed checkpoint: %s", folder, e)
            return _UNFINISHED, e
        return _COMMITTED, None

    # -- saving and retention --------------------------------------------------------------------

    def save(
        self, step: int, state: dict[str, Any], *, async_: bool = False, **options: Any
    ) -> SaveInfo | SaveFuture:
        """Save `state` as `step` (`swc.save` to `path(step)`). Collective.

        Returns `swc.save`'s `SaveInfo`, or with `async_=True` `swc.async_save`'s
        `SaveFuture` (`.staged`, then `.result()` once committed). `**options` are
        their keyword arguments (`progress=`, `staging=`, ...). Retention (see the
        class) runs only after the step has committed."""
        step = _step(step)
        target = self.root.child(step_folder(step))
        if async_:
            return self._save_async(step, target, state, options)
        info = save(state, target, process_group=self.process_group, **options)
        call = agreement(self.process_group, ("manager root", self._identity))
        call.verdict()  # every rank has committed step `step` before rank 0 deletes
        if call.rank == 0:
            self._retain(step)
        return info

    def _save_async(
        self, step: int, target: Folder, state: dict[str, Any], options: dict[str, Any]
    ) -> SaveFuture:
        rank = agreement(self.process_group, ("manager root", self._identity)).rank
        future = async_save(state, target, process_group=self.process_group, **options)
        retained: Future = Future()
        self._pending = (future, retained)

        def after(done: Future) -> None:
            try:
                if rank == 0 and not done.cancelled() and done.exception() is None:
                    self._retain(step)
            finally:
                retained.set_result(None)

        future.add_done_callback(after)
        return future

    def wait_until_finished(self) -> None:
        """Wait for the last `save(..., async_=True)` and its retention; raises that
        save's error, if it failed. Not collective."""
        pending = self._pending
        if pending is None:
            return
        future, retained = pending
        retained.result()
        future.result()

    def _retain(self, saved: int) -> list[int]:
        """Rank 0's retention after `saved` committed; the steps it deleted. Never raises:
        the save stands, and what could not be deleted is retried by the next one."""
        if self.keep_last is None:
            return []
        try:
            with self._retaining:
                return self._delete_unkept(saved)
        except Exception as e:  # noqa: BLE001 - the step is committed: a warning, not a failure
            warnings.warn(
                f"retention under {self.root.location} failed after step {saved} committed "
                f"({type(e).__name__}: {e}); the next save retries",
                stacklevel=2,
            )
            return []

    def _delete_unkept(self, saved: int) -> list[int]:
        assert self.keep_last is not None
        committed, retiring = [], []
        for step in self._listed():
            status = self._status(step)[0]
            if status == _COMMITTED:
                committed.append(step)
            elif status == _RETIRED:
                retiring.append(step)
        kept = set(committed[-self.keep_last :]) | {saved}
        if self.keep_every is not None:
            kept |= {s for s in committed if s % self.keep_every == 0}
        doomed = [s for s in committed if s not in kept] + retiring
        claimed = _IN_USE.claim([(self._identity, s) for s in doomed])
        deleted = []
        try:
            for _, step in claimed:
                if self._delete(step):
                    deleted.append(step)
        finally:
            _IN_USE.unclaim(claimed)
        if deleted:
            log.info("deleted steps %s under %s (retention)", deleted, self.root.location)
        return deleted

    def _delete(self, step: int) -> bool:
        """Delete the checkpoint of `step` (committed, or retiring), as the class says;
        whether its files are all gone."""
        folder = self.root.child(step_folder(step))
        listed = sorted(folder.sizes())
        if live_scopes(folder, listed):
            log.info("%s: a save holds its lease; left for a later retention", folder)
            return False
        stock = {n for n in referenced_files(folder, both=True) if _STOCK_DATA.fullmatch(n)}
        if RETIRING not in listed:
            folder.write_durably(RETIRING, f"deleting step {step} (retention)\n".encode())
        records = [GLOBAL_RECORDS.manifest, GLOBAL_RECORDS.metadata]
        files = [
            n
            for n in listed
            if n in stock
            or DATA_FILE.fullmatch(n)
            or TEMPORARY.fullmatch(n)
            or LOCK_NAME.fullmatch(n)
        ]
        last = [MARKER, RETIRING] if MARKER in listed else [RETIRING]
        ok = self._remove(folder, [n for n in records if n in listed])
        if ok:
            folder.sync()  # the records are gone before any data file goes
            ok = self._remove(folder, files) and self._remove(folder, last)
        if ok:
            folder.remove_if_empty()
        return ok

    @staticmethod
    def _remove(folder: Folder, names: list[str]) -> bool:
        for name in names:
            if not folder.removable(name):
                continue
            try:
                folder.remove(name)
            except FileNotFoundError:  # gone already (another retention)
                continue
            except OSError as e:
                warnings.warn(
                    f"could not remove {folder.where(name)} ({e}); the next retention retries",
                    stacklevel=3,
                )
                return False
        return True

    # -- restoring -------------------------------------------------------------------------------

    def restore(
        self,
        state: dict[str, Any],
        step: int | None = None,
        *,
        missing_ok: bool = False,
        **options: Any,
    ) -> int | None:
        """Fill `state` in place from `step` (the latest committed one when None), as
        `swc.load` does (`**options`: its keyword arguments); returns the step.
        Collective.

        Rank 0 picks the step and holds it against this process's retention until the
        load returns; the others learn it from one fixed-size `all_reduce`.
        `CheckpointNotFoundError` (naming the root) on every rank when `step` is not a
        committed step, or `step` is None and none is committed — unless `missing_ok`,
        which then returns None with `state` untouched."""
        step = None if step is None else _step(step)
        arguments = (self._identity, step, missing_ok)
        call = agreement(self.process_group, ("restore root, step and missing_ok", arguments))
        held: int | None = None
        if call.rank == 0:
            try:
                held = self._hold(step)
            except CheckpointNotFoundError as e:
                if not missing_ok:
                    call.defer(e)  # raised on every rank by `agree`
            except (ShardwiseError, OSError) as e:
                call.defer(e)
        try:
            (chosen,) = call.agree([-1 if held is None else held])  # rank 0's: the maximum
            if chosen < 0:  # nothing to restore, and missing_ok
                return None
            load(
                state,
                self.root.child(step_folder(chosen)),
                process_group=self.process_group,
                **options,
            )
            return chosen
        finally:
            if held is not None:
                _IN_USE.release((self._identity, held))

    def _hold(self, step: int | None) -> int:
        """The step to restore (`step`, or the newest committed), held: checked
        committed only once held, so retention can no longer claim it."""
        for candidate in [step] if step is not None else reversed(self._listed()):
            key = (self._identity, candidate)
            _IN_USE.hold(key)
            status, reason = self._status(candidate)
            if status == _COMMITTED:
                return candidate
            _IN_USE.release(key)
            if step is not None:
                raise CheckpointNotFoundError(
                    f"step {step} under {self.root.location} is not a committed checkpoint "
                    f"({status}{f': {reason}' if reason else ''}); "
                    f"committed steps: {self.steps() or 'none'}"
                )
        raise CheckpointNotFoundError(
            f"no committed checkpoint under {self.root.location} (no step_NNNNNNNN folder "
            "holds one): save a step first, or point the manager at the right root"
        )
