"""The plan of a save's keys, from what every rank holds of them.

No process group here: `plan_save` is a pure function of the ranks'
`inventory.Entry` lists. In a collective save each rank runs it over the keys
it owns (`key_owners`), fed every rank's entries of those keys; its cost is
linear in the number of entries (plus a sort of the replicated ones). It decides:

* which rank writes each distinct box: a box one rank holds is written by it;
  a box several ranks hold (a plain tensor, a replicated block) by the holder
  with the fewest bytes assigned so far by this plan, largest boxes first, ties
  to the holder nearest after rank `first` (each owner passes its own rank, so
  owners spread replicated state over different ranks deterministically); an
  object by the lowest rank holding it;
* where each record goes (`place_records`, on the writing rank): its records
  in its own inventory order, so every offset follows from the records'
  lengths (`record_frame`), known before any byte is written;
* what is wrong: a key held as a tensor on one rank and an object on another,
  or with different dtypes or global shapes, boxes out of bounds or
  overlapping, or not covering the tensor. Stock DCP accepts holes in a
  one-process save; shardwise never does, whatever the world size: a hole
  would read back as whatever memory the reader allocated.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ...layout import Block
from ...layout.coverage import analyze
from ..format.manifest import dtype_from_name
from ..format.record_write import record_frame
from ..format.tiles import tile_count, tile_shape
from .holes import first_hole, region
from .inventory import Box, Entry
from .places import FIELDS, Places

__all__ = ["SavePlan", "TensorPlan", "file_count", "place_records", "plan_save"]

_PAIRWISE = 16  # up to this many distinct boxes per key, overlap is checked pair by pair


@dataclass(slots=True)
class TensorPlan:
    dtype: str
    shape: tuple[int, ...]
    requires_grad: bool
    # (offsets, sizes, writing rank, position in that rank's writes), in rank order
    chunks: list[tuple[tuple[int, ...], tuple[int, ...], int, int]] = field(default_factory=list)


@dataclass
class SavePlan:
    """What every rank writes and what the checkpoint will hold."""

    tensors: dict[str, TensorPlan]
    objects: dict[str, tuple[int, int]]  # key -> (writing rank, position in its writes)
    # per rank: (key, index of the box in that rank's own entry; -1 for an object)
    writes: list[list[tuple[str, int]]]
    # DCP's planner_data: flattened key -> path, where it is not (key,)
    mappings: dict[str, tuple[Any, ...]]
    problems: list[str]


# A rank writing this much or more spreads its records over several data files (up to
# `MAX_FILES`, one per `FILE_BYTES`): file systems take one writer per file at a time
# (tmpfs, ext4 and XFS lock a file for a buffered write), so one file caps a rank at
# one stream's speed. DCP's `FileSystemWriter` splits by `thread_count` the same way.
SPLIT_BYTES = 512 << 20
FILE_BYTES = 256 << 20
MAX_FILES = 8


def file_count(total: int) -> int:
    """How many data files a rank writing `total` bytes of records uses."""
    return 1 if total < SPLIT_BYTES else min(MAX_FILES, total // FILE_BYTES)


def plan_save(
    inventories: list[list[Entry]], first: int = 0, loads: list[int] | None = None
) -> SavePlan:
    """The plan for every rank's `inventory.describe` entries, in rank order. `first`:
    where ties between the holders of a shared box start, and the writer of the objects
    it holds (the planning owner: `key_owners`); `loads`: the bytes each rank
    holds in all (when `inventories` are a part of what they hold), the load shared
    boxes are balanced against."""
    tensors: dict[str, TensorPlan] = {}
    objects: dict[str, tuple[int, int]] = {}
    mappings: dict[str, tuple[Any, ...]] = {}
    problems: list[str] = []
    # key -> (dtype, shape, first rank, {box: its holder (rank, box index), or a list of
    # several; later its writer})
    keys: dict[str, tuple[str | None, Any, int, dict[Box, Any] | None]] = {}
    for rank, entries in enumerate(inventories):
        for key, path, dtype, shape, requires_grad, held in entries:
            info = keys.get(key)
            if info is None:
                if path is not None:
                    mappings[key] = path
                if dtype is None:
                    objects[key] = (rank, -1)
                    keys[key] = (None, None, rank, None)
                    continue
                boxes: dict[Box, Any] | None = {}
                keys[key] = (dtype, shape, rank, boxes)
                tensors[key] = TensorPlan(dtype, shape, requires_grad)  # type: ignore[arg-type]
            elif info[0] != dtype or info[1] != shape:
                problems.append(_disagreement(key, info[:3], (dtype, shape, rank)))
                continue
            else:
                boxes = info[3]
            if boxes is None:
                if dtype is None and rank == first:  # its owner writes it: it knows its crc32c
                    objects[key] = (rank, -1)
                continue
            for index, box in enumerate(held):
                holders = boxes.get(box)
                if holders is None:  # a sole holder as itself, not a list: most boxes have one
                    boxes[box] = (rank, index)
                elif type(holders) is tuple:
                    boxes[box] = [holders, (rank, index)]
                else:
                    holders.append((rank, index))
    _assign_writers(keys, len(inventories), first, loads)
    writes: list[list[tuple[str, int]]] = [[] for _ in inventories]
    for rank, entries in enumerate(inventories):  # each rank writes in its own inventory order
        mine = writes[rank]
        for key, _path, dtype, shape, _grad, held in entries:
            dtype_seen, shape_seen, _first, boxes = keys[key]
            if dtype is None:
                if objects.get(key) == (rank, -1):
                    objects[key] = (rank, len(mine))
                    mine.append((key, -1))
                continue
            if boxes is None or dtype_seen != dtype or shape_seen != shape:
                continue
            chunks = tensors[key].chunks
            for index, box in enumerate(held):
                if boxes[box] == (rank, index):
                    chunks.append((box[0], box[1], rank, len(mine)))
                    mine.append((key, index))
    for key, plan in tensors.items():
        problem = _check_boxes(key, plan)
        if problem:
            problems.append(problem)
    return SavePlan(tensors, objects, writes, mappings, problems)


def _assign_writers(
    keys: dict[str, Any], world_size: int, first: int, loads: list[int] | None
) -> None:
    """Replace each box's holders by its writer: a sole holder writes its box; shared
    boxes go, largest first, to the holder with the fewest bytes so far (with `loads`:
    the fewest bytes held, plus those assigned)."""
    load = [0] * world_size if loads is None else list(loads)
    itemsizes: dict[str, int] = {}
    shared = []
    for order, (dtype, _shape, _rank, boxes) in enumerate(keys.values()):
        if boxes is None:
            continue
        itemsize = itemsizes.get(dtype)
        if itemsize is None:
            itemsize = itemsizes[dtype] = dtype_from_name(dtype).itemsize
        for box, holders in boxes.items():
            nbytes = math.prod(box[1]) * itemsize
            if type(holders) is tuple:  # its sole holder writes it
                if loads is None:
                    load[holders[0]] += nbytes
            else:
                shared.append((-nbytes, order, box, boxes, holders))
    shared.sort(key=lambda s: s[:3])
    for minus_nbytes, _order, box, boxes, holders in shared:
        rank, index = min(holders, key=lambda h: (load[h[0]], (h[0] - first) % world_size))
        boxes[box] = (rank, index)
        load[rank] -= minus_nbytes


def _disagreement(key: str, first: tuple[Any, ...], other: tuple[Any, ...]) -> str:
    def what(kind: tuple[Any, ...]) -> str:
        dtype, shape, rank = kind
        if dtype is None:
            return f"rank {rank} holds a Python object"
        return f"rank {rank} holds a tensor of dtype {dtype}, shape {tuple(shape)}"

    return f"'{key}': {what(first)} but {what(other)}"


def _check_boxes(key: str, plan: TensorPlan) -> str | None:
    """Out of bounds, overlapping (as stock DCP refuses) or not covering (which stock
    refuses across ranks only). Plain loops, no generators: this runs once per tensor."""
    shape = plan.shape
    chunks = plan.chunks
    if len(chunks) == 1 and chunks[0][1] == shape and not any(chunks[0][0]):
        return None  # one chunk, the whole tensor: the common case
    ndim = len(shape)
    volume = 0
    solid = []
    for offsets, sizes, _rank, _position in chunks:
        inside = len(offsets) == ndim and len(sizes) == ndim
        for d in range(ndim if inside else 0):
            if offsets[d] < 0 or sizes[d] < 0 or offsets[d] + sizes[d] > shape[d]:
                inside = False
                break
        if not inside:
            return f"'{key}': chunk at offsets {offsets} sizes {sizes} is out of bounds of {shape}"
        n = math.prod(sizes)
        volume += n
        if n:
            solid.append((offsets, sizes))
    if len(solid) > _PAIRWISE:
        found = analyze([Block(o, s) for o, s in solid], shape).overlap
        if found is not None:
            return f"'{key}': chunks at offsets {found[0].offsets} and {found[1].offsets} overlap"
    else:
        for i, (ao, an) in enumerate(solid):
            for bo, bn in solid[i + 1 :]:
                for d in range(ndim):
                    if ao[d] >= bo[d] + bn[d] or bo[d] >= ao[d] + an[d]:
                        break  # apart along d: no overlap
                else:
                    return f"'{key}': chunks at offsets {ao} and {bo} overlap"
    if volume != math.prod(shape):
        hole = region(first_hole(solid, shape))
        return (
            f"'{key}': elements {hole} are held by no rank (the chunks saved cover "
            f"{volume} of its {math.prod(shape)} elements); every element must be saved: "
            "give the layout blocks that cover the tensor"
        )
    return None


def place_records(
    writes: Iterable[tuple[str, int]], entries: list[Entry], serialization_id: str
) -> Places:
    """Where each record of a rank's `writes` ((key, box index), -1 for an object)
    lands, in write order (`entries`: that rank's inventory): one data file, or
    `file_count` of them for a large share, each record in the one holding the
    fewest bytes so far (so consecutive large records go to different files and
    are written at once)."""
    boxes = {e[0]: e for e in entries}
    # (dtype, sizes) -> (the record's length, its head's, its checksums)
    frames: dict[tuple[str | None, tuple[int, ...]], tuple[int, int, int]] = {}
    # (length, head length; -1 for an object, checksums: 0 for an object)
    sized: list[tuple[int, int, int]] = []
    for key, index in writes:
        _key, _path, dtype, _shape, _grad, held = boxes[key]
        if index < 0:
            sized.append((held[0], -1, 0))  # an object's entry holds its length and crc32c
            continue
        sizes = held[index][1]
        known = frames.get((dtype, sizes))
        if known is None:
            torch_dtype = dtype_from_name(dtype)  # type: ignore[arg-type]
            head, tail = record_frame(torch_dtype, sizes, serialization_id)
            nbytes = math.prod(sizes) * torch_dtype.itemsize
            crcs = tile_count(sizes, tile_shape(sizes, torch_dtype.itemsize))
            known = frames[(dtype, sizes)] = (len(head) + nbytes + len(tail), len(head), crcs)
        sized.append(known)
    count = file_count(sum(n for n, _at, _crcs in sized))
    ends = [0] * count  # each file's length so far; a record goes to the shortest
    rows = []
    for n, at, _crcs in sized:
        k = 0 if count == 1 else min(range(count), key=ends.__getitem__)
        pos = ends[k]
        rows.append([pos, n, pos + at if at >= 0 else pos, k, -1])
        ends[k] = pos + n
    for row, (_n, at, crcs) in zip(rows, sized):  # each file's checksums last
        if at >= 0:
            row[4] = ends[row[3]]
            ends[row[3]] += 4 * (1 + crcs)  # the frame, then one per tile
    return Places(np.array(rows, np.int64).reshape(len(rows), FIELDS))
