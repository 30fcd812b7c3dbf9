"""Leases and planted lock records, shared by the tests of `lease` and `heartbeat`."""

from __future__ import annotations

import json
import time
from pathlib import Path

from shardwise.checkpoint.io.lease import LOCK, Lease
from shardwise.storage import open_folder


def new_lease(path: Path | str, rank: int | None = None, **kw) -> Lease:
    """The lease of the global records (or `rank`'s) of the folder at `path`."""
    return Lease(open_folder(path), rank, **kw)


def plant_lock(folder: Path, **fields) -> bytes:
    """A lock record as another process would have written it."""
    record = {
        "save_id": "0123456789abcdef",
        "host": "elsewhere",
        "pid": 4242,
        "pid_namespace": "",
        "process_start": "",
        "since": time.time() - 60,
        "heartbeat": time.time() - 5,
        **fields,
    }
    folder.mkdir(parents=True, exist_ok=True)
    data = json.dumps(record).encode()
    (folder / LOCK).write_bytes(data)
    return data
