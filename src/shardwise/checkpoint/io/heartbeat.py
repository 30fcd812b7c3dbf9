"""The heartbeat of a held save lease: its lock record rewritten while the save runs.

A daemon thread rewrites the record's `heartbeat` every period, as long as the
record still names the save; a save that froze stops beating and its lease is
taken for stale once the heartbeat is older than `lease.STALE_AFTER_S`.
"""

from __future__ import annotations

import threading
import time
from dataclasses import asdict

from ...storage import Folder
from .lock_record import Holder, read_record

__all__ = ["Heartbeat"]


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
