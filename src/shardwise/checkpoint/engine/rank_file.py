"""One rank's data files of a save: its records in plan order, device tensors staged.

Split from `saving` (the collective steps) so that how bytes leave the device —
bounded pinned slabs, side streams, the staged signal — reads on its own.
"""

from __future__ import annotations

import sys
import threading
from array import array
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ...errors import ShardwiseError
from ...storage import Folder
from ..io.chunk_writer import DataFile, Written
from ..io.device_copies import Copier, DeviceCopier, HostCopier
from ..io.faults import failpoint
from ..io.host_slabs import slabs_for, staging_bytes
from ..io.staged_writer import write_records
from .places import Places

_U32 = next(code for code in "IL" if array(code).itemsize == 4)

__all__ = ["Once", "Staging", "write_rank_file"]


@dataclass
class Staging:
    """How a save's device tensors reach its files (`io.staged_writer`).

    `budget`: host bytes per rank for staging (None: `host_slabs.staging_bytes`).
    `after`: per CUDA device, an event on the caller's stream the copies follow
    (None: the caller's current stream, when the save runs on the caller's thread).
    `on_staged`: called once this rank no longer reads the state (every byte it
    writes is on the host, or the save failed), from any thread.
    `host`: stage host tensors too (tests run the device pipeline on CPU this way).
    """

    budget: int | None = None
    after: dict[int, torch.cuda.Event] | None = None
    on_staged: Callable[[], None] | None = None
    host: bool = False


class Once:
    """A callback called at most once, from whichever thread gets there first."""

    def __init__(self, fn: Callable[[], None] | None) -> None:
        self._fn, self._lock = fn, threading.Lock()

    def __call__(self) -> None:
        with self._lock:
            fn, self._fn = self._fn, None
        if fn is not None:
            fn()


def write_rank_file(
    folder: Folder,
    names: list[str],
    records: tuple[list[Any], Places],
    serialization_id: str,
    sync: bool,
    staging: Staging,
    staged: Once,
) -> None:
    """This rank's records (tensors, objects' bytes), in plan order, each into the new
    file of `names` its place says (`planning.place_records`): device tensors through
    the staging slabs (`staged_writer`), host tensors straight from their memory.
    Each file then ends with the frame and tile checksums of its tensor records, where
    their places say (`crc_at`): the checksums stay with their writer (format 5)."""
    failpoint("before-write")
    folder.make()
    values, placed = records
    on_device = _any_on_device(values)  # host-only states skip the staging machinery
    slabs = slabs_for("save", staging_bytes(staging.budget))
    with slabs.lease(), ExitStack() as stack:
        files = [stack.enter_context(DataFile(folder, name)) for name in names]
        written = write_records(
            files,
            (values, placed.rows[:, 3].tolist()),
            serialization_id,
            slabs,
            _copier(values, staging, on_device),
            stage=_always if staging.host else (_on_device if on_device else None),
            on_staged=staged,
        )
        for k, file in enumerate(files):
            _write_checksums(file, k, placed, written)
            file.finish(sync)


def _write_checksums(file: DataFile, k: int, placed: Places, written: list[Written]) -> None:
    """File `k`'s checksum block: each tensor record's frame and tiles, in place order."""
    rows = placed.rows
    mine = np.flatnonzero((rows[:, 3] == k) & (rows[:, 4] >= 0)).tolist()
    if not mine:
        return
    words = array(_U32)
    start = file.pos
    for i, at in zip(mine, rows[mine, 4].tolist()):
        if at != start + 4 * len(words):  # the plan and the bytes disagree: a writer's bug
            raise ShardwiseError(f"{file.name}: checksums planned at {at}, not where they go")
        w = written[i]
        words.append(w.frame)
        words.extend(w.crcs)
    if sys.byteorder != "little":
        words.byteswap()
    file.write_record(words.tobytes())


def _any_on_device(records: list[Any]) -> bool:
    return any(isinstance(r, torch.Tensor) and r.device.type != "cpu" for r in records)


def _copier(records: list[Any], staging: Staging, on_device: bool) -> Copier:
    cuda = on_device and any(isinstance(r, torch.Tensor) and r.is_cuda for r in records)
    return DeviceCopier(staging.after) if cuda else HostCopier()


def _on_device(t: torch.Tensor) -> bool:
    return t.device.type != "cpu"


def _always(t: torch.Tensor) -> bool:
    return True
