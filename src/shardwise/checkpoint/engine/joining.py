"""Rank 0's share of a collective save: the records joined beside its writes, committed.

The join copies every owner's part into `.metadata`, `shardwise.json` and the index
(`io.record_join`): O(W × N) bytes, 155 MiB at 1,024 ranks × 1,000 tensors. Since
format version 5 the parts follow from the plan and the places alone (the checksums
stay in the writers' files), so every part is written before any data: the join
then runs on a thread of its own while every rank writes its data, off the save's
critical path, and its records are committed only once every rank's data is durable.
"""

from __future__ import annotations

import contextlib
import threading

from torch.distributed.checkpoint.metadata import StorageMeta

from ...storage import Folder
from ..format.manifest import Manifest
from ..io.commit import RecordNames, commit
from ..io.lease import Lease
from ..io.record_join import join_records, part_name
from .key_owners import file_name
from .save_records import SaveRecords

__all__ = ["Joining"]


class Joining:
    """Rank 0's join of the records on a thread of its own (`index`: rank 0's next data
    file, known before any data is written), then their commit."""

    def __init__(
        self, path: Folder, world: int, index: str, token: str, meta: StorageMeta, sync: bool
    ) -> None:
        self.path, self.world, self.index, self.token, self.sync = path, world, index, token, sync
        self._out: tuple[str, str] | BaseException | None = None
        self._committing = False  # from then on, the commit owns the records' files
        self._thread = threading.Thread(target=self._run, args=(meta,), name="shardwise-join")
        self._thread.start()

    def _run(self, meta: StorageMeta) -> None:
        try:
            frame = _frame(self.world, meta)
            where = (self.world, self.index)
            self._out = join_records(self.path, where, self.token, meta, frame, self.sync)
        except BaseException as e:  # noqa: BLE001 - given to the committing thread
            self._out = e

    def join(self) -> None:
        self._thread.join()

    def commit(self, most: int, lease: Lease | None) -> BaseException | None:
        """Commit the joined records once every rank's data is durable; the problem.
        `most`: the most data files a rank wrote: every name this save may have written
        is kept by the commit's collection (a superset, from the names alone: never a
        listing, which a shared file system may show late), and so is every part: each
        owner removes its own once the save is committed."""
        self._committing = True
        try:
            self.join()
            if isinstance(self._out, BaseException):
                raise self._out
            assert self._out is not None
            metadata, manifest = self._out
            keep = {file_name(r, k, self.token) for r in range(self.world) for k in range(most)}
            keep.add(self.index)
            keep |= {part_name(self.token, r) for r in range(self.world)}  # their owners
            commit(self.path, metadata, manifest, keep, RecordNames(), sync=self.sync, lease=lease)
        except Exception as e:  # noqa: BLE001 - the other ranks wait for the verdict
            return e
        return None

    def discard(self) -> None:
        """A failed save's: every rank's part and, unless the commit began (it may have
        made them visible), what the join wrote, removed (this save wrote them: their
        names say so). Best effort: the next commit's collection removes what is left."""
        self.join()
        names = [part_name(self.token, r) for r in range(self.world)]
        if not self._committing:
            names += [self.index, *(self._out if isinstance(self._out, tuple) else ())]
        for name in names:
            with contextlib.suppress(Exception):  # absent (never written), or gone already
                self.path.remove(name)


def _frame(world: int, meta: StorageMeta) -> Manifest:
    """The manifest's fields but its entries and planner data (`record_join`)."""
    frame = SaveRecords(world, meta, {}).draft()
    frame.set_planner_data({})
    return frame
