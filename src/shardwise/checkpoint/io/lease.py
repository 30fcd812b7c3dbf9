"""The save lease: at most one save of a checkpoint's records in flight at a time.

The lease is a lock record beside the checkpoint: its name, what it says about
its holder (host, process, start), its one validator, and its heartbeat (the
record rewritten while the save runs, so a crashed holder goes stale and a
live one never does).
"""

from __future__ import annotations

import json
import math
import os
import socket
import threading
import time
import uuid
import warnings
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import TypeGuard

from ...errors import CheckpointBusyError
from ...storage import Folder
from ..format import LOCK, LOCK_NAME, lock_name

__all__ = [
    "HEARTBEAT_S",
    "HOST",
    "Heartbeat",
    "Holder",
    "LOCK",
    "Lease",
    "PID_NAMESPACE",
    "STALE_AFTER_S",
    "live_scopes",
    "lock_name",
    "process_alive",
    "read_record",
    "stale_reason",
]


# -----------------------------------------------------------------------------
# The lock record of a save lease: its name, what it says about its holder, reading it.
#
# A lock record (`.shardwise.lock`, or `__{rank}.shardwise.lock` for one rank's
# records) is a few hundred bytes of JSON naming the save that holds the lease:
# its id, host, pid (with its pid namespace and start time, so a reused pid is
# not mistaken for the holder), when it was taken, and its last heartbeat. The
# protocol around it (taking, breaking, the heartbeat) is in `lease.py`.
#
# Anyone who can write beside a checkpoint can write its lock record, so
# `Holder.parse` is the one validator every reader goes through: it returns a
# `Holder` whose every field is in its domain (so nothing computed from it can
# raise), or None for anything else, whatever the bytes: too big, not UTF-8,
# nested, NaN or infinite, a number out of range, a field of the wrong type. None
# means "unreadable", which every consumer treats alike (`lease.py`: held, named in
# the refusal, broken by a waiting save after its quiet period; never collected
# around).
# -----------------------------------------------------------------------------

_FORMAT = "shardwise-lease/1"

# A lock record is a few hundred bytes; a bigger one (a crafted, sparse 100 GB file) is
# read only this far, so it parses as unreadable instead of filling memory.
_MAX_RECORD = 1 << 16

# A record is one flat JSON object; the few `[` / `{` it holds are in strings
# ("pid:[4026531836]"). JSON nests no deeper than its count of openers, so with at
# most this many the decoder's recursion stays shallow (40,000 nested lists would
# raise RecursionError instead of parsing as unreadable).
_MAX_OPENERS = 16

_MAX_PID = (1 << 31) - 1  # pid_t: a bigger one overflows `os.kill`

# The times a lock record may hold: 1970 to the last second `datetime` can show
# (9999-12-31T23:59:59Z); `time.time()` is always in it, 1e20 or NaN never.
_LATEST = 253402300799.0


def read_record(folder: Folder, name: str) -> bytes:
    """The lock record `name` (a plain file only), or its first `_MAX_RECORD` bytes.

    Its size is read fresh: unlike data files, a lock record is rewritten
    (heartbeats, a new holder), so a size remembered from an earlier listing (object
    stores) would cut it short. A local file's own size is fresh (one `fstat`: a
    listing would cost each lease check O(files in the folder), 1,000s at scale)."""
    local = folder.local_path is not None
    size = _MAX_RECORD if local else folder.sizes().get(name, _MAX_RECORD)  # not listed: new
    f = folder.open(name)  # refuses a link; FileNotFoundError when it is gone
    try:
        return f.pread(min(f.size() if local else size, _MAX_RECORD), 0)
    finally:
        f.close()


def _pid_namespace() -> str:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


def _process_start(pid: int) -> tuple[str, str] | None:
    """(state, start time in clock ticks) of `pid` from `/proc`; None if it has no
    entry; ("", "") where `/proc` is not there."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return None if Path("/proc/self/stat").exists() else ("", "")
    except OSError:
        return ("", "")
    fields = stat.rsplit(")", 1)[-1].split()  # the command name may hold spaces
    return (fields[0], fields[19]) if len(fields) > 19 else ("", "")


HOST = socket.gethostname()

PID_NAMESPACE = _pid_namespace()


def process_alive(pid: int, started: str) -> bool:
    """Whether process `pid` of this host and pid namespace is still the holder."""
    found = _process_start(pid)
    if found is None:
        return False
    state, start = found
    if state in ("Z", "X"):
        return False  # a zombie holds nothing
    if start and started:
        return start == started  # a reused pid is another process
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@dataclass(frozen=True)
class Holder:
    """What a lock record says about the save that holds it."""

    save_id: str
    host: str
    pid: int
    pid_namespace: str
    process_start: str
    since: float
    heartbeat: float

    @classmethod
    def of_this_process(cls, save_id: str) -> Holder:
        now = time.time()
        state = _process_start(os.getpid())
        start = state[1] if state else ""
        return cls(save_id, HOST, os.getpid(), PID_NAMESPACE, start, now, now)

    @classmethod
    def parse(cls, data: bytes) -> Holder | None:
        """The holder a lock record names, or None if it is unreadable: any bytes
        that are not a record this module could have written, with every field in
        its domain. Never raises; reads at most `_MAX_RECORD` bytes of JSON."""
        if len(data) >= _MAX_RECORD:  # read only that far (`read_record`): cut short
            return None
        try:
            text = data.decode("utf-8")
            if text.count("[") + text.count("{") > _MAX_OPENERS:
                return None
            doc = json.loads(text)  # NaN, Infinity and 1e400 come back as floats `_is_time` refuses
        except ValueError:  # not UTF-8, not JSON, an int over 4,300 digits
            return None
        if not isinstance(doc, dict):
            return None
        save_id, host, namespace, start = (
            doc.get(k) for k in ("save_id", "host", "pid_namespace", "process_start")
        )
        pid, since, beat = doc.get("pid"), doc.get("since"), doc.get("heartbeat")
        if not (
            isinstance(save_id, str)
            and isinstance(host, str)
            and isinstance(namespace, str)
            and isinstance(start, str)
            and type(pid) is int
            and 0 < pid <= _MAX_PID
            and _is_time(since)
            and _is_time(beat)
        ):
            return None
        return cls(save_id, host, pid, namespace, start, float(since), float(beat))

    def to_bytes(self) -> bytes:
        return (json.dumps({"format": _FORMAT, **asdict(self)}, indent=1) + "\n").encode()

    def describe(self) -> str:
        # A parsed holder's `since` is always a date; one built by hand may not be,
        # and a message about a lock must never fail in its making.
        since = (
            datetime.fromtimestamp(self.since, timezone.utc).isoformat(timespec="seconds")
            if _is_time(self.since)
            else repr(self.since)
        )
        beat = max(0.0, time.time() - self.heartbeat)
        return (
            f"save {self.save_id[:12]} of pid {self.pid} on host {self.host}, "
            f"since {since} (last heartbeat {beat:.0f} s ago)"
        )


def _is_time(value: object) -> TypeGuard[float]:
    """Whether `value` is a JSON number a clock can show (not a bool, not NaN)."""
    return (
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and math.isfinite(value)
        and 0 <= value <= _LATEST
    )


# -----------------------------------------------------------------------------
# The heartbeat of a held save lease: its lock record rewritten while the save runs.
#
# A daemon thread rewrites the record's `io.lease` every period, as long as the
# record still names the save; a save that froze stops beating and its lease is
# taken for stale once the heartbeat is older than `lease.STALE_AFTER_S`.
# -----------------------------------------------------------------------------


class Heartbeat:
    """The heartbeat of the lock record `name` of `folder` held by save `save_id`.

    `lock` is held by each beat; whoever stops the heartbeat and then removes the
    record holds it too, so no beat writes the record back after its removal."""

    def __init__(self, folder: Folder, name: str, save_id: str) -> None:
        self.folder, self.name, self.save_id = folder, name, save_id
        self.lock = threading.Lock()
        self._stop = threading.Event()

    def start(self, period: float) -> None:
        self._stop.clear()
        threading.Thread(
            target=self._run, args=(period,), name="shardwise-lease-heartbeat", daemon=True
        ).start()

    def stop(self) -> None:
        """Stop beating; call it holding `lock`."""
        self._stop.set()

    def _run(self, period: float) -> None:
        while not self._stop.wait(period):
            self.beat()

    def beat(self) -> None:
        """Rewrite the heartbeat, if the record still names this save."""
        with self.lock:
            if self._stop.is_set():
                return
            try:
                holder = Holder.parse(read_record(self.folder, self.name))
                if holder is None or holder.save_id != self.save_id:
                    return  # taken over: `Lease.confirm` reports it
                beat = Holder(**{**asdict(holder), "heartbeat": time.time()})
                self.folder.write_durably(self.name, beat.to_bytes())
            except OSError:
                pass  # the next beat tries again; the bound leaves room for many misses


# -----------------------------------------------------------------------------
# The save lease: at most one save of a checkpoint's records in flight at a time.
#
# Two saves of one path (two jobs, or a restarted job and its zombie) would
# otherwise each collect the other's unfinished data as leftovers and commit
# records naming deleted files. So a save first takes the path's lease, an
# exclusively created lock record beside the checkpoint, and holds it until it
# has committed and collected (or failed):
#
# - `.shardwise.lock` for the global records (`swc.save`, `dcp.save` + `Writer`),
#   `__{rank}.shardwise.lock` for one rank's records (DCP's
#   `use_collectives=False`, where every rank commits on its own): one lease per
#   record scope, taken by whoever commits that scope (the coordinator, or each rank);
# - JSON: the save id, host, pid (with its pid namespace and start time, so a
#   reused pid is not mistaken for the holder), when it was taken, and a heartbeat
#   that a daemon thread rewrites every `HEARTBEAT_S` while the lease is held
#   (`io.lease`);
# - created with `Folder.create_exclusive`: `link(2)` of a fsynced temporary file
#   locally (atomic, NFS included), a conditional PUT (`If-None-Match: *`) on
#   object stores that offer it; elsewhere best effort (look, then write). Either
#   way the creator re-reads the record and holds the lease only if it names it.
#
# A second save fails fast with `CheckpointBusyError` naming the holder, or polls
# until the lease is free when asked to (`wait=True`, or `wait=` seconds). A stale
# lease is broken with a warning: its process is gone (same host and pid
# namespace: the pid is dead, a zombie, or a different process), it was left by a
# save of this very process that no longer holds it, or its heartbeat is older
# than `STALE_AFTER_S` (clocks of the hosts sharing the folder are assumed to agree
# to well within that). An unreadable record (anything `Holder.parse` refuses:
# garbage, over 64 KiB, not UTF-8, nested, NaN, infinite or out-of-range numbers, a
# field of the wrong type) is live, named in the refusal with the file to remove, and
# stale once a waiting save has seen it unchanged for `STALE_AFTER_S`, so `wait=True`
# never hangs on one. Nothing a lock record holds ever makes judging it raise: a
# committed save reports success whatever lock records lie beside it. A save whose
# lease was broken (it froze past the bound) learns it before committing (`confirm`)
# and commits nothing.
#
# The lock record is never a checkpoint record: readers, `holds_checkpoint` and
# stock `dcp.load` never look at it, and collection never deletes another scope's.
# The record itself (its name, its fields, reading it) is `io.lease`.
# -----------------------------------------------------------------------------

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
