"""The lock record of a save lease: its name, what it says about its holder, reading it.

A lock record (`.shardwise.lock`, or `__{rank}.shardwise.lock` for one rank's
records) is a few hundred bytes of JSON naming the save that holds the lease:
its id, host, pid (with its pid namespace and start time, so a reused pid is
not mistaken for the holder), when it was taken, and its last heartbeat. The
protocol around it (taking, breaking, the heartbeat) is in `lease.py`.

Anyone who can write beside a checkpoint can write its lock record, so
`Holder.parse` is the one validator every reader goes through: it returns a
`Holder` whose every field is in its domain (so nothing computed from it can
raise), or None for anything else, whatever the bytes: too big, not UTF-8,
nested, NaN or infinite, a number out of range, a field of the wrong type. None
means "unreadable", which every consumer treats alike (`lease.py`: held, named in
the refusal, broken by a waiting save after its quiet period; never collected
around).
"""

from __future__ import annotations

import json
import math
import os
import re
import socket
import time
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import TypeGuard

from ...storage import Folder

__all__ = ["HOST", "LOCK", "PID_NAMESPACE", "Holder", "lock_name", "process_alive", "read_record"]

LOCK = ".shardwise.lock"
LOCK_NAME = re.compile(r"(?:__(\d+))?" + re.escape(LOCK), re.ASCII)
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


def lock_name(rank: int | None) -> str:
    """The lock record of the global records (`rank` None) or of one rank's."""
    return LOCK if rank is None else f"__{rank}{LOCK}"


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
