"""Leases and planted lock records, shared by the tests of `lease` and `io.lease`."""

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


def record_text(**fields: object) -> bytes:
    """The JSON text of a lock record of another host, with `fields` written as given
    (the text, not a value: `1e400` and `NaN` are what a crafted file holds)."""
    record = {
        "save_id": '"0123456789abcdef"',
        "host": '"elsewhere"',
        "pid": "4242",
        "pid_namespace": '""',
        "process_start": '""',
        "since": repr(time.time() - 60),
        "heartbeat": repr(time.time() - 5),
        **{k: str(v) for k, v in fields.items()},
    }
    return ("{" + ", ".join(f'"{k}": {v}' for k, v in record.items()) + "}").encode()


def crafted_locks() -> dict[str, bytes]:
    """Lock records no save writes, each of which a reader once choked on (a bare
    OverflowError, RecursionError or ValueError instead of "unreadable"), or took for
    a holder it is not."""
    return {
        "pid-1e400": record_text(pid="1e400"),
        "pid-Infinity": record_text(pid="Infinity"),
        "pid-2**64": record_text(pid=str(1 << 64)),
        "pid-0": record_text(pid="0"),
        "pid-true": record_text(pid="true"),
        "pid-float": record_text(pid="4242.0"),
        "nested-40000": b"[" * 40_000 + b"]" * 40_000,
        "nested-20000": b"[" * 20_000 + b"]" * 20_000,  # under 64 KiB: read whole
        "nested-host": record_text(host="[" * 20_000 + "]" * 20_000),
        "since-1e20": record_text(since="1e20"),
        "since-NaN": record_text(since="NaN"),
        "since-negative": record_text(since="-1"),
        "stale-since-1e20": record_text(since="1e20", heartbeat=repr(time.time() - 1e5)),
        "stale-since-NaN": record_text(since="NaN", heartbeat=repr(time.time() - 1e5)),
        "heartbeat-Infinity": record_text(heartbeat="Infinity"),
        "heartbeat-1e400": record_text(heartbeat="-1e400"),
        "host-number": record_text(host="7"),
        "save_id-null": record_text(save_id="null"),
        "not-utf-8": record_text(host='"X"').replace(b'"X"', b'"\xff"'),
        "utf-16": record_text().decode().encode("utf-16"),
        "over-64-KiB": record_text() + b" " * (1 << 16),  # sound JSON, but not all of it is read
    }
