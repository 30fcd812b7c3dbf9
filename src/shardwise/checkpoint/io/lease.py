"""The save lease: at most one save of a checkpoint's records in flight at a time.

Two saves of one path (two jobs, or a restarted job and its zombie) would
otherwise each collect the other's unfinished data as leftovers and commit
records naming deleted files. So a save first takes the path's lease, an
exclusively created lock record beside the checkpoint, and holds it until it
has committed and collected (or failed):

- `.shardwise.lock` for the global records (`swc.save`, `dcp.save` + `Writer`),
  `__{rank}.shardwise.lock` for one rank's records (DCP's
  `use_collectives=False`, where every rank commits on its own): one lease per
  record scope, taken by whoever commits that scope (the coordinator, or each rank);
- JSON: the save id, host, pid (with its pid namespace and start time, so a
  reused pid is not mistaken for the holder), when it was taken, and a heartbeat
  that a daemon thread rewrites every `HEARTBEAT_S` while the lease is held
  (`heartbeat`);
- created with `Folder.create_exclusive`: `link(2)` of a fsynced temporary file
  locally (atomic, NFS included), a conditional PUT (`If-None-Match: *`) on
  object stores that offer it; elsewhere best effort (look, then write). Either
  way the creator re-reads the record and holds the lease only if it names it.

A second save fails fast with `CheckpointBusyError` naming the holder, or polls
until the lease is free when asked to (`wait=True`, or `wait=` seconds). A stale
lease is broken with a warning: its process is gone (same host and pid
namespace: the pid is dead, a zombie, or a different process), it was left by a
save of this very process that no longer holds it, or its heartbeat is older
than `STALE_AFTER_S` (clocks of the hosts sharing the folder are assumed to agree
to well within that). An unreadable record (anything `Holder.parse` refuses:
garbage, over 64 KiB, not UTF-8, nested, NaN, infinite or out-of-range numbers, a
field of the wrong type) is live, named in the refusal with the file to remove, and
stale once a waiting save has seen it unchanged for `STALE_AFTER_S`, so `wait=True`
never hangs on one. Nothing a lock record holds ever makes judging it raise: a
committed save reports success whatever lock records lie beside it. A save whose
lease was broken (it froze past the bound) learns it before committing (`confirm`)
and commits nothing.

The lock record is never a checkpoint record: readers, `holds_checkpoint` and
stock `dcp.load` never look at it, and collection never deletes another scope's.
The record itself (its name, its fields, reading it) is `lock_record`.
"""

from __future__ import annotations

import os
import threading
import time
import uuid
import warnings

from ...errors import CheckpointBusyError
from ...storage import Folder
from .heartbeat import Heartbeat
from .lock_record import (
    HOST,
    LOCK,
    LOCK_NAME,
    PID_NAMESPACE,
    Holder,
    lock_name,
    process_alive,
    read_record,
)

__all__ = [
    "HEARTBEAT_S",
    "HOST",
    "LOCK",
    "PID_NAMESPACE",
    "STALE_AFTER_S",
    "Holder",
    "Lease",
    "live_scopes",
    "lock_name",
    "stale_reason",
]

HEARTBEAT_S = 15.0  # how often a held lease's heartbeat is rewritten
STALE_AFTER_S = 300.0  # a heartbeat older than this: the holder is taken for dead


_HELD: dict[tuple[str, str], Lease] = {}  # (folder identity, lock name) -> held by this process
_HELD_LOCK = threading.Lock()
# Save ids of leases this process is taking right now: between its exclusive create and
# `_hold`, a record naming this pid is another thread's live save, not one left behind.
_ACQUIRING: set[str] = set()


def stale_reason(holder: Holder, where: tuple[str, str] | None = None) -> str | None:
    """Why the save `holder` names is taken for dead, or None while it may be alive.
    `where`: the lease's (folder identity, lock name), to ask this process's own leases."""
    if holder.host == HOST and holder.pid_namespace == PID_NAMESPACE:
        if holder.pid == os.getpid():
            with _HELD_LOCK:
                mine = _HELD.get(where) if where is not None else None
                taking = holder.save_id in _ACQUIRING
            if not taking and (mine is None or mine.save_id != holder.save_id):
                return "a save of this process left it and no longer holds it"
        elif not process_alive(holder.pid, holder.process_start):
            return f"its process (pid {holder.pid} on this host) is gone"
    age = time.time() - holder.heartbeat
    if age > STALE_AFTER_S:
        return f"its heartbeat is {age:.0f} s old (a lease is stale after {STALE_AFTER_S:.0f} s)"
    # Further ahead than clocks ever disagree (or NaN in a holder built by hand; a
    # parsed one has a finite heartbeat): no live holder wrote it.
    if not age >= -STALE_AFTER_S:
        return f"its heartbeat {holder.heartbeat!r} is no time a live holder could have written"
    return None


def live_scopes(folder: Folder, names: list[str], mine: Lease | None = None) -> set[int | None]:
    """The record scopes (None: global, or a rank) of leases in `folder` other than
    `mine` whose holders may be alive: their saves' files are never collected.
    An unreadable lock record counts as live. Never raises: collection runs after a
    commit, and no lock record may turn a committed save into a reported failure."""
    found: set[int | None] = set()
    for name in names:
        m = LOCK_NAME.fullmatch(name)
        if m is None or (mine is not None and mine.held and name == mine.name):
            continue
        try:
            holder = Holder.parse(read_record(folder, name))
            live = holder is None or stale_reason(holder, (folder.identity, name)) is None
        except FileNotFoundError:
            continue
        except Exception:  # noqa: BLE001 - a lock that cannot be judged is live: its files stay
            live = True
        if live:
            found.add(None if m.group(1) is None else int(m.group(1)))
    return found


class Lease:
    """The lease of one record scope of `folder` (see the module docstring).

    `with Lease(folder).acquire(wait):` holds it for the block; `release` is idempotent.
    """

    def __init__(self, folder: Folder, rank: int | None = None, *, save_id: str = "") -> None:
        self.folder, self.rank = folder, rank
        self.name = lock_name(rank)
        self.save_id = save_id or uuid.uuid4().hex
        self.held = False
        self._made = False
        self._heartbeat = Heartbeat(folder, self.name, self.save_id)

    @property
    def where(self) -> str:
        return self.folder.where(self.name)

    def _key(self) -> tuple[str, str]:
        return (self.folder.identity, self.name)

    def _read(self) -> bytes | None:
        try:
            return read_record(self.folder, self.name)
        except FileNotFoundError:
            return None

    def _names_me(self) -> bool:
        data = self._read()
        holder = Holder.parse(data) if data is not None else None
        return holder is not None and holder.save_id == self.save_id

    def acquire(self, wait: bool | float = False) -> Lease:
        """Take the lease, breaking a stale one; `CheckpointBusyError` if it is held and
        `wait` is False (or still held after `wait` seconds). `wait=True` waits forever."""
        deadline = None if wait is True else time.monotonic() + max(0.0, float(wait or 0))
        with _HELD_LOCK:
            _ACQUIRING.add(self.save_id)
        try:
            return self._acquire(deadline, wait)
        finally:
            with _HELD_LOCK:
                _ACQUIRING.discard(self.save_id)

    def _acquire(self, deadline: float | None, wait: bool | float) -> Lease:
        self._made = not self.folder.is_folder()
        self.folder.make()
        delay = 0.02
        unreadable: tuple[bytes, float] | None = None  # a record no holder can be read from
        vanished = 0  # creates refused, then nothing to read: released meanwhile, or no file
        while True:
            record = Holder.of_this_process(self.save_id)
            try:
                self.folder.create_exclusive(self.name, record.to_bytes())
            except FileExistsError:
                pass
            if self._names_me():
                self._hold()
                return self
            data = self._read()
            if data is None:
                vanished += 1
                if vanished < 100:
                    continue  # released meanwhile: try again at once
                data = b""  # a name no plain file answers to (a folder): unreadable, busy
            holder = Holder.parse(data)
            reason = stale_reason(holder, self._key()) if holder is not None else None
            if holder is None:  # crafted or damaged: live, unless it stays so past the bound
                if unreadable is None or unreadable[0] != data:
                    unreadable = (data, time.monotonic())
                elif time.monotonic() - unreadable[1] > STALE_AFTER_S:
                    reason = (
                        f"it stayed unreadable for {STALE_AFTER_S:.0f} s while this save waited"
                    )
            if reason is not None:
                self._break(data, holder, reason)
                unreadable = None
                continue
            if deadline is not None and time.monotonic() >= deadline:
                self._undo_make()
                raise CheckpointBusyError(self._busy(holder, data, wait))
            pause = delay if deadline is None else min(delay, deadline - time.monotonic())
            time.sleep(max(0.0, pause))
            delay = min(delay * 2, 1.0)

    def _busy(self, holder: Holder | None, data: bytes, wait: bool | float) -> str:
        who = (
            holder.describe()
            if holder is not None
            else f"a holder whose lock record is unreadable ({data[:60]!r})"
        )
        waited = f"; still held after waiting {float(wait):g} s" if wait else ""
        return (
            f"cannot save to {self.folder}: another save of it is in flight ({who} holds "
            f"{self.where}){waited}. Wait for it (pass wait=True, or wait=<seconds>), or, "
            f"if that save is gone for good, remove {self.where}"
        )

    def _break(self, data: bytes, holder: Holder | None, reason: str) -> None:
        """Remove a stale lock record, if it still is the one judged stale."""
        if self._read() != data:
            return  # changed meanwhile (released, refreshed, taken over): look again
        who = holder.describe() if holder is not None else f"unreadable: {data[:60]!r}"
        warnings.warn(
            f"breaking the stale save lease {self.where} ({who}): {reason}",
            stacklevel=4,
        )
        try:
            self.folder.remove(self.name)
        except FileNotFoundError:
            pass  # someone else broke it first
        except OSError as e:
            raise CheckpointBusyError(
                f"cannot save to {self.folder}: the stale lease {self.where} ({reason}) "
                f"cannot be removed ({e}); remove it by hand"
            ) from e

    def _hold(self) -> None:
        self.held = True
        with _HELD_LOCK:
            _HELD[self._key()] = self
        self._heartbeat.start(HEARTBEAT_S)

    def still_held(self) -> bool:
        """Whether the lock record still names this save (it was not broken as stale)."""
        try:
            return self.held and self._names_me()
        except OSError:
            return False

    def confirm(self) -> None:
        """Raise `CheckpointBusyError` unless this save still holds the lease: called
        right before a commit, so a save whose lease was broken commits nothing."""
        if self.still_held():
            return
        data = self._read()
        holder = Holder.parse(data) if data is not None else None
        now = holder.describe() if holder is not None else "nobody"
        raise CheckpointBusyError(
            f"the save lease {self.where} was broken while this save ran (it was taken "
            f"for dead; now held by {now}): nothing of this save was committed"
        )

    def release(self) -> None:
        """Give the lease back (its record removed if it still names this save). A
        folder the lease created is removed again if nothing else is in it."""
        with self._heartbeat.lock:
            if not self.held:
                return
            self._heartbeat.stop()
            self.held = False
            with _HELD_LOCK:
                if _HELD.get(self._key()) is self:
                    del _HELD[self._key()]
            try:
                if self._names_me():
                    self.folder.remove(self.name)
            except FileNotFoundError:
                pass
            except OSError as e:
                warnings.warn(
                    f"could not remove the save lease {self.where} ({e}); the next save "
                    "breaks it as stale",
                    stacklevel=2,
                )
        self._undo_make()

    def _undo_make(self) -> None:
        if self._made:
            self._made = False
            self.folder.remove_if_empty()

    def __enter__(self) -> Lease:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()
