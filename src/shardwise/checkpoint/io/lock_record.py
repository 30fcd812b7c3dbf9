"""The lock record of a save lease: its name, what it says about its holder, reading it.

A lock record (`.shardwise.lock`, or `__{rank}.shardwise.lock` for one rank's
records) is a few hundred bytes of JSON naming the save that holds the lease:
its id, host, pid (with its pid namespace and start time, so a reused pid is
not mistaken for the holder), when it was taken, and its last heartbeat. The
protocol around it (taking, breaking, the heartbeat) is in `lease.py`.
"""

from __future__ import annotations

import json
import os
import re
import socket
import time
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path

from ...storage import Folder

__all__ = ["HOST", "LOCK", "PID_NAMESPACE", "Holder", "lock_name", "process_alive", "read_record"]

LOCK = ".shardwise.lock"
LOCK_NAME = re.compile(r"(?:__(\d+))?" + re.escape(LOCK), re.ASCII)
_FORMAT = "shardwise-lease/1"
# A lock record is a few hundred bytes; a bigger one (a crafted, sparse 100 GB file) is
# read only this far, so it parses as unreadable instead of filling memory.
_MAX_RECORD = 1 << 16


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
        try:
            doc = json.loads(data)
            return cls(
                str(doc["save_id"]),
                str(doc["host"]),
                int(doc["pid"]),
                str(doc["pid_namespace"]),
                str(doc["process_start"]),
                float(doc["since"]),
                float(doc["heartbeat"]),
            )
        except (ValueError, KeyError, TypeError):
            return None

    def to_bytes(self) -> bytes:
        return (json.dumps({"format": _FORMAT, **asdict(self)}, indent=1) + "\n").encode()

    def describe(self) -> str:
        since = datetime.fromtimestamp(self.since, timezone.utc).isoformat(timespec="seconds")
        beat = max(0.0, time.time() - self.heartbeat)
        return (
            f"save {self.save_id[:12]} of pid {self.pid} on host {self.host}, "
            f"since {since} (last heartbeat {beat:.0f} s ago)"
        )
