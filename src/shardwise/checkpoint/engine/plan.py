"""The plan of a save: which rank writes which chunk, in which file, and the
records that describe it.

Each key is planned by one rank, its owner (per-rank cost O(N), not O(W x N));
the owner decides the key's chunks from what every rank holds of it, finds the
holes, places its archives (one row of five integers per archive) and builds
its part of the save's two records (`shardwise.json`, DCP's `.metadata`) with
the one builder of both. A plan is kept for the next save of the same
structure, so repeated saves plan for free.
"""

from __future__ import annotations

import hashlib
import math
import pickle
import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import crc32c
import numpy as np
import torch
from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION, _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from ...comm.agreement import Agreement
from ...layout import Block, overlap
from ...layout.coverage import analyze
from ..format import (
    ChunkEntry,
    IndexRef,
    Manifest,
    ObjectEntry,
    TensorEntry,
    archive_frame,
    dtype_from_name,
    manifest_sections,
    metadata_sections,
    tile_count,
    tile_shape,
    write_sections,
)
from ..io import data_file_name
from .inventory import Box, Entry

__all__ = [
    "FIELDS",
    "MyWrites",
    "Placement",
    "Places",
    "Planned",
    "Report",
    "SavePlan",
    "SaveRecords",
    "TensorPlan",
    "file_count",
    "file_name",
    "first_hole",
    "forget",
    "held_bytes",
    "holes_in_plans",
    "keep",
    "kind_disagreements",
    "lookup",
    "owned_part",
    "owner_of",
    "place_archives",
    "plan_by_owners",
    "plan_records",
    "plan_save",
    "ranks_text",
    "region",
    "remote_objects",
    "reports_for",
    "routed",
    "signature",
]


# -----------------------------------------------------------------------------
# Where a rank's records lie: one row of five integers per record, not one object.
#
# A rank keeps its records' places, and an owner those of its keys' records,
# from one save to the next (`engine.plan`): 100,000 records as frozen dataclass
# instances held 30 MiB of Python objects per rank, the same as an int64 array
# of 4 MiB. The places are also what a writer reports to an owner on a first
# save (`engine.plan.reports_for`): an array pickles as one buffer.
# -----------------------------------------------------------------------------

FIELDS = 5  # offset, length, payload, file, crc_at: `Placement`'s, in order


@dataclass(frozen=True)
class Placement:
    """Where one record lies: which of its rank's data files, and where in it."""

    offset: int
    length: int
    payload: int  # absolute offset of a tensor record's payload (of an object: its offset)
    file: int = 0  # index of the rank's data file
    # where the file keeps a tensor record's frame and tile checksums (format version 5:
    # after every record of the file, in record order); -1 for an object
    crc_at: int = -1


class Places:
    """The places of a rank's records, in its write order: `rows[i]` is record i's
    (offset, length, payload, file, crc_at)."""

    __slots__ = ("rows",)

    def __init__(self, rows: np.ndarray | None = None) -> None:
        self.rows = np.zeros((0, FIELDS), np.int64) if rows is None else rows
        assert self.rows.ndim == 2 and self.rows.shape[1] == FIELDS

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> Placement:
        return Placement(*self.rows[i].tolist())

    def files(self) -> int:
        """How many data files the records use."""
        return int(self.rows[:, 3].max()) + 1 if len(self.rows) else 0


# -----------------------------------------------------------------------------
# Holes in a save: the regions of a tensor no chunk covers, found and named.
#
# A hole would read back as whatever memory the reader allocated, so the engine's
# plan (`engine.plan`) and `Writer`'s global plan refuse them, naming the first
# uncovered region as the slice that selects it.
# -----------------------------------------------------------------------------


def first_hole(
    boxes: list[tuple[tuple[int, ...], tuple[int, ...]]], shape: tuple[int, ...]
) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """A region (offsets, sizes) that no box covers, grown from the first uncovered
    element `coverage.analyze` finds; None when the boxes cover the shape or overlap.
    `boxes` are in bounds. For the refusal path: O(boxes x ndim) per dimension."""
    ndim = len(shape)
    if not ndim:
        return ((), ()) if not boxes else None
    solid = [b for b in boxes if math.prod(b[1])]
    point = analyze([Block(o, s) for o, s in solid], shape).hole if solid else (0,) * ndim
    if point is None:
        return None
    lo, hi = list(point), [p + 1 for p in point]
    for d in range(ndim):
        lo[d], hi[d] = _extent(solid, lo, hi, d, shape[d])
    return tuple(lo), tuple(h - lo_ for lo_, h in zip(lo, hi))


def _extent(
    solid: list[tuple[tuple[int, ...], tuple[int, ...]]],
    lo: list[int],
    hi: list[int],
    d: int,
    size: int,
) -> tuple[int, int]:
    """How far the uncovered region [lo, hi) can grow along dim `d`: up to the nearest
    box on each side among those it meets in every other dim."""
    start, end = 0, size
    for offsets, sizes in solid:
        if all(
            offsets[e] < hi[e] and lo[e] < offsets[e] + sizes[e] for e in range(len(lo)) if e != d
        ):
            if offsets[d] >= hi[d]:
                end = min(end, offsets[d])
            else:  # the region is uncovered, so a box meeting it elsewhere ends before it
                start = max(start, offsets[d] + sizes[d])
    return start, end


def holes_in_plans(plans: Sequence[Any]) -> list[str]:
    """The tensors a DCP global plan (every rank's `SavePlan`, after the planner's
    dedup) leaves partly unwritten, each with its first uncovered region. Stock DCP
    checks coverage only across ranks; `Writer` refuses holes in a one-process
    save too. Overlaps are the planner's own check (`_validate_global_plan`)."""
    found: dict[str, tuple[tuple[int, ...], set[tuple[tuple[int, ...], tuple[int, ...]]]]] = {}
    for plan in plans:
        for item in plan.items:
            data = item.tensor_data
            if data is None:
                continue
            shape = tuple(data.size)
            boxes = found.setdefault(item.index.fqn, (shape, set()))[1]
            boxes.add((tuple(data.chunk.offsets), tuple(data.chunk.sizes)))
    problems = []
    for key, (shape, boxes) in found.items():
        volume = sum(math.prod(sizes) for _offsets, sizes in boxes)
        if volume < math.prod(shape):
            hole = region(first_hole(sorted(boxes), shape))
            problems.append(
                f"'{key}': elements {hole} are written by no rank (the chunks "
                f"planned cover {volume} of its {math.prod(shape)} elements); every element "
                "must be saved"
            )
    return problems


def region(found: tuple[tuple[int, ...], tuple[int, ...]] | None) -> str:
    """`[4:6, 0:8]`: a region as the slice that selects it."""
    if found is None:
        return "(somewhere: the chunks also overlap)"
    offsets, sizes = found
    return "[" + ", ".join(f"{o}:{o + n}" for o, n in zip(offsets, sizes)) + "]"


# -----------------------------------------------------------------------------
# The plan of a save's keys, from what every rank holds of them.
#
# No process group here: `plan_save` is a pure function of the ranks'
# `inventory.Entry` lists. In a collective save each rank runs it over the keys
# it owns (`engine.plan`), fed every rank's entries of those keys; its cost is
# linear in the number of entries (plus a sort of the replicated ones). It decides:
#
# * which rank writes each distinct box: a box one rank holds is written by it;
#   a box several ranks hold (a plain tensor, a replicated block) by the holder
#   with the fewest bytes assigned so far by this plan, largest boxes first, ties
#   to the holder nearest after rank `first` (each owner passes its own rank, so
#   owners spread replicated state over different ranks deterministically), or,
#   with `ordinals` (each holder numbers its tensor boxes in its own order, one
#   int per entry sent to owners), to the holders in turn by that number: the DP
#   copies of a TP shard hold the same boxes in the same order, so each writes
#   its share of them; an object by the lowest rank holding it;
# * where each record goes (`place_archives`, on the writing rank): its records
#   in its own inventory order, so every offset follows from the records'
#   lengths (`archive_frame`), known before any byte is written;
# * what is wrong: a key held as a tensor on one rank and an object on another,
#   or with different dtypes or global shapes, boxes out of bounds or
#   overlapping, or not covering the tensor. Stock DCP accepts holes in a
#   one-process save; shardwise never does, whatever the world size: a hole
#   would read back as whatever memory the reader allocated.
# -----------------------------------------------------------------------------

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
    inventories: list[list[Entry]],
    first: int = 0,
    loads: list[int] | None = None,
    ordinals: list[list[int]] | None = None,
) -> SavePlan:
    """The plan for every rank's `inventory.describe` entries, in rank order. `first`:
    where ties between the holders of a shared box start, and the writer of the objects
    it holds (the planning owner: `engine.plan`); `loads`: the bytes each rank
    holds in all (when `inventories` are a part of what they hold), the load shared
    boxes are balanced against; `ordinals`: for each rank's entries, how many tensor
    boxes the rank holds before it (`_box_ordinals`), which turn ties between the
    holders of a shared box instead (below)."""
    tensors: dict[str, TensorPlan] = {}
    objects: dict[str, tuple[int, int]] = {}
    mappings: dict[str, tuple[Any, ...]] = {}
    problems: list[str] = []
    # key -> (dtype, shape, first rank, {box: its holder (rank, box index), or a list of
    # several; later its writer})
    keys: dict[str, tuple[str | None, Any, int, dict[Box, Any] | None]] = {}
    # (key, dtype, shape) unlike the key's first holder's -> the ranks holding it so
    odd: dict[tuple[str, str | None, Any], list[int]] = {}
    turns: dict[str, int] = {}  # key -> the least ordinal its holders sent
    for rank, entries in enumerate(inventories):
        for at, (key, path, dtype, shape, requires_grad, held) in enumerate(entries):
            if ordinals is not None:
                ordinal = ordinals[rank][at]
                turns[key] = min(turns.get(key, ordinal), ordinal)
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
                odd.setdefault((key, dtype, shape), []).append(rank)
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
    for (key, dtype, shape), ranks in odd.items():
        problems.append(_disagreement(key, keys[key][:3], (dtype, shape, ranks)))
    _assign_writers(keys, len(inventories), first, loads, turns if ordinals is not None else None)
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
                    offsets, sizes = box
                    chunks.append((offsets, sizes, rank, len(mine)))
                    mine.append((key, index))
    for key, plan in tensors.items():
        problem = _check_boxes(key, plan, partial(_holders, inventories, key))
        if problem:
            problems.append(problem)
    return SavePlan(tensors, objects, writes, mappings, problems)


def _assign_writers(
    keys: dict[str, Any],
    world_size: int,
    first: int,
    loads: list[int] | None,
    turns: dict[str, int] | None = None,
) -> None:
    """Replace each box's holders by its writer: a sole holder writes its box; shared
    boxes go, largest first, to the holder with the fewest bytes so far (with `loads`:
    the fewest bytes held, plus those assigned). Ties go to the holder nearest after
    `first`; with `turns` (a key's place among the tensor boxes its holders hold), to
    its holders in turn: the box numbered n by them to the (n mod k)-th of its k holders.
    Owners decide alone, each for its own keys, and holders of the same boxes (the DP
    replicas of a TP shard) number them alike, so each replica writes its share of the
    group's chunks, not 1 to 3 of 8: on an object store a load then reads each of
    their files whole (`read_once._readers`)."""
    load = [0] * world_size if loads is None else list(loads)
    itemsizes: dict[str, int] = {}
    shared = []
    for order, (key, (dtype, _shape, _rank, boxes)) in enumerate(keys.items()):
        if boxes is None:
            continue
        itemsize = itemsizes.get(dtype)
        if itemsize is None:
            itemsize = itemsizes[dtype] = dtype_from_name(dtype).itemsize
        for box, holders in boxes.items():
            _offsets, sizes = box
            nbytes = math.prod(sizes) * itemsize
            if type(holders) is tuple:  # its sole holder writes it
                if loads is None:
                    load[holders[0]] += nbytes
            else:
                shared.append((-nbytes, order, box, boxes, holders, key))
    shared.sort(key=lambda s: s[:3])
    for minus_nbytes, _order, box, boxes, holders, key in shared:
        start = first
        if turns is not None and key in turns:
            ranks = sorted(h[0] for h in holders)
            start = ranks[(turns[key] + holders[0][1]) % len(ranks)]
        rank, index = min(holders, key=lambda h: (load[h[0]], (h[0] - start) % world_size))
        boxes[box] = (rank, index)
        load[rank] -= minus_nbytes


def ranks_text(ranks: Sequence[int]) -> str:
    """`rank 3`, `ranks 2, 3`, `ranks 0-7, 9`: runs of three or more as ranges, at most
    eight items (then how many ranks in all), so a message stays short at any world size."""
    if len(ranks) <= 1:
        return f"rank {ranks[0]}" if ranks else "no rank"
    runs: list[list[int]] = []
    for r in sorted(ranks):
        if runs and r == runs[-1][1] + 1:
            runs[-1][1] = r
        else:
            runs.append([r, r])
    items: list[str] = []
    for lo, hi in runs:
        items.extend([f"{lo}-{hi}"] if hi - lo >= 2 else [str(r) for r in range(lo, hi + 1)])
    shown = ", ".join(items[:8])
    more = f", ... ({len(ranks)} ranks)" if len(items) > 8 else ""
    return f"ranks {shown}{more}"


def _disagreement(key: str, first: tuple[Any, ...], other: tuple[Any, ...]) -> str:
    """`first`: (dtype, shape, rank) of the key's first holder; `other`: (dtype, shape,
    ranks) of the holders unlike it."""

    def what(dtype: str | None, shape: Any, who: str, verb: str) -> str:
        if dtype is None:
            return f"{who} {verb} a Python object"
        return f"{who} {verb} a tensor of dtype {dtype}, shape {tuple(shape)}"

    dtype, shape, rank = first
    odd_dtype, odd_shape, ranks = other
    theirs = what(odd_dtype, odd_shape, ranks_text(ranks), "holds" if len(ranks) == 1 else "hold")
    return f"'{key}': {what(dtype, shape, f'rank {rank}', 'holds')} but {theirs}"


def kind_disagreements(kinds: Sequence[dict[str, tuple[str | None, Any]]]) -> list[str]:
    """The keys whose dtype or global shape differ between ranks, worded as `plan_save`
    words them: `kinds[r]` is rank r's (dtype name, shape) per key, (None, None) for an
    object. For `Writer`, whose global plan has lost the replicas DCP's planner dropped
    (one item per (key, offsets), whatever its shape or dtype)."""
    first: dict[str, tuple[Any, ...]] = {}
    odd: dict[tuple[str, str | None, Any], list[int]] = {}
    for rank, held in enumerate(kinds):
        for key, (dtype, shape) in held.items():
            seen = first.setdefault(key, (dtype, shape, rank))
            if seen[0] != dtype or seen[1] != shape:
                odd.setdefault((key, dtype, shape), []).append(rank)
    return [_disagreement(k, first[k], (d, s, ranks)) for (k, d, s), ranks in odd.items()]


def _holders(inventories: list[list[Entry]], key: str, box: Box) -> list[int]:
    """The ranks whose entry of tensor `key` holds `box` (for a refusal's message: a
    pass over every entry)."""
    return [
        rank
        for rank, entries in enumerate(inventories)
        for k, _path, dtype, _shape, _grad, held in entries
        if k == key and dtype is not None and box in held
    ]


# Where two blocks of a tensor partly overlap, the usual cause is replicas that disagree:
# the copies of a tensor on a process subgroup (one per data-parallel row) built with
# different layouts.
_REPLICAS = (
    "ranks holding copies of a part (replicas, such as the data-parallel copies of a "
    "tensor-parallel weight) must hold identical blocks: give every copy the same layout"
)


def _check_boxes(key: str, plan: TensorPlan, holders: Callable[[Box], list[int]]) -> str | None:
    """Out of bounds, overlapping (as stock DCP refuses) or not covering (which stock
    refuses across ranks only); `holders(box)`: the ranks holding a box, for the message.
    Plain loops, no generators: this runs once per tensor."""
    shape = plan.shape
    chunks = plan.chunks
    if len(chunks) == 1:
        offsets, sizes, _rank, _index = chunks[0]
        if sizes == shape and not any(offsets):
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
    pair = None
    if len(solid) > _PAIRWISE:
        found = analyze([Block(o, s) for o, s in solid], shape).overlap
        if found is not None:
            pair = ((found[0].offsets, found[0].sizes), (found[1].offsets, found[1].sizes))
    else:
        for i, (ao, an) in enumerate(solid):
            for bo, bn in solid[i + 1 :]:
                if overlap(ao, an, bo, bn) is not None:
                    pair = ((ao, an), (bo, bn))
                    break
            if pair is not None:
                break
    if pair is not None:
        (a, at), (b, bt) = sorted((box, holders(box)) for box in pair)
        if bt and (not at or bt[0] < at[0]):  # the block of the lowest rank first
            (a, at), (b, bt) = (b, bt), (a, at)
        return (
            f"'{key}': the block {region(a)} held by {ranks_text(at)} and the block "
            f"{region(b)} held by {ranks_text(bt)} partly overlap; {_REPLICAS}"
        )
    if volume != math.prod(shape):
        hole = region(first_hole(solid, shape))
        return (
            f"'{key}': elements {hole} are held by no rank (the chunks saved cover "
            f"{volume} of its {math.prod(shape)} elements); every element must be saved: "
            "give the layout blocks that cover the tensor"
        )
    return None


def place_archives(
    writes: Iterable[tuple[str, int]], entries: list[Entry], serialization_id: str
) -> Places:
    """Where each record of a rank's `writes` ((key, box index), -1 for an object)
    lands, in write order (`entries`: that rank's inventory): one data file, or
    `file_count` of them for a large share, each record in the one holding the
    fewest bytes so far (so consecutive large records go to different files and
    are written at once)."""
    boxes: dict[str, Entry] = {}
    for entry in entries:
        key, _path, _dtype, _shape, _grad, _held = entry
        boxes[key] = entry
    # (dtype, sizes) -> (the record's length, its head's, its checksums)
    frames: dict[tuple[str | None, tuple[int, ...]], tuple[int, int, int]] = {}
    # (length, head length; -1 for an object, checksums: 0 for an object)
    sized: list[tuple[int, int, int]] = []
    for key, index in writes:
        _key, _path, dtype, _shape, _grad, held = boxes[key]
        if index < 0:
            length, _crc = held  # an object's entry holds its length and crc32c
            sized.append((length, -1, 0))
            continue
        sizes = held[index][1]
        known = frames.get((dtype, sizes))
        if known is None:
            torch_dtype = dtype_from_name(dtype)  # type: ignore[arg-type]
            head, tail = archive_frame(torch_dtype, sizes, serialization_id)
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


# -----------------------------------------------------------------------------
# The one builder of a save's two records: `shardwise.json` and DCP's `.metadata`.
#
# `save`, `Writer` and `reshard` describe what they stored as plain manifest
# entries (each chunk's and object's place and checksums) and get both records
# from here, so the two always describe the same checkpoint. A collective save's
# entries carry no checksums: each chunk names where its writer keeps them in its
# data file (`crc_at`, format version 5), so they are known from the places alone;
# `Writer` and `reshard` fill the checksums in before `manifest` encodes them.
# `.metadata` needs no checksums: it can be built as soon as the places are known.
# Like objects are shared in its pickle (tensor properties, shapes, boxes), so it
# stays small and fast at 100,000 tensors.
# A collective save builds the records of each key on its owner (`engine.plan`):
# `part` encodes them there, `engine.records` joins every owner's part.
# -----------------------------------------------------------------------------


class SaveRecords:
    """What a new checkpoint holds, as manifest entries: add them to `tensors` and
    `format.pickles` (chunks in the order `.metadata` lists them), then build the records."""

    def __init__(self, world_size: int, storage_meta: StorageMeta, planner_data: Any) -> None:
        self.world_size = world_size
        self.storage_meta = storage_meta
        self.planner_data = planner_data  # DCP's: flattened key -> path, as its planner keeps
        self.tensors: dict[str, TensorEntry] = {}
        self.objects: dict[str, ObjectEntry] = {}
        self._draft: Manifest | None = None

    def draft(self) -> Manifest:
        """The manifest of these entries (the same objects: checksums filled later are
        in it), made once."""
        if self._draft is None:
            meta = self.storage_meta
            stored_meta = {
                "checkpoint_id": None if meta.checkpoint_id is None else str(meta.checkpoint_id),
                "save_id": meta.save_id,
                "modules": list(meta.modules),
            }
            self._draft = Manifest(
                world_size=self.world_size,
                tensors=self.tensors,
                objects=self.objects,
                storage_meta=stored_meta,
                dcp_version=CURRENT_DCP_VERSION,
            )
            self._draft.set_planner_data(self.planner_data)
        return self._draft

    def records(self, index_file: str) -> tuple[bytes, bytes, bytes]:
        """`.metadata`, `shardwise.json` (sealed) and the index file, to be written as
        `index_file` (a data file of the save) before the records are committed."""
        metadata = self.metadata()
        manifest, index = self.draft().indexed(index_file, metadata)
        return metadata, manifest, index

    def metadata(self) -> bytes:
        """The pickled DCP `Metadata` stock `dcp.load` reads."""
        state, storage = self._metadata_items()
        metadata = Metadata(
            state_dict_metadata=state,
            planner_data=self.planner_data,
            storage_data=storage,
            storage_meta=self.storage_meta,
            version=CURRENT_DCP_VERSION,
        )
        return pickle.dumps(metadata, protocol=pickle.HIGHEST_PROTOCOL)

    def part(self, planner_data: dict[str, Any], block: int) -> list[list[bytes]]:
        """These entries (an owner's keys) and their `format.entries` as a part of a
        collective save's records (`engine.records.write_part`), in one batch, their
        chunk sections as block `block` of its index."""
        return [self.sections(planner_data, block, 0)]

    def sections(self, planner_data: dict[str, Any], block: int, at: int) -> list[bytes]:
        """These entries' seven sections of a part, a batch of it (`write_part`): their
        chunk sections placed from byte `at` of block `block` of the index."""
        state, storage = self._metadata_items()
        index = write_sections(self.tensors, block)
        for t in self.tensors.values():
            assert t.section is not None
            t.section = (block, t.section[1] + at, *t.section[2:])
        entries = Manifest(
            world_size=self.world_size,
            tensors=self.tensors,
            objects=self.objects,
            index=IndexRef("", []),  # the frame's: only the entries are encoded here
        )
        return (
            metadata_sections(state, planner_data, storage)
            + manifest_sections(entries, planner_data)
            + [index]
        )

    def _metadata_items(self) -> tuple[dict[str, Any], dict[MetadataIndex, _StorageInfo]]:
        """`.metadata`'s `state_dict_metadata` and `storage_data` of these entries."""
        sizes: dict[tuple[int, ...], torch.Size] = {}

        def size(t: tuple[int, ...]) -> torch.Size:
            s = sizes.get(t)
            if s is None:
                s = sizes[t] = torch.Size(t)
            return s

        # Like boxes share one ChunkStorageMetadata (pickled once, then by reference):
        # 10,000 tensors sharded alike have as many chunk objects as one of them.
        boxes: dict[tuple[tuple[int, ...], tuple[int, ...]], ChunkStorageMetadata] = {}
        properties: dict[tuple[str, bool], TensorProperties] = {}
        state: dict[str, Any] = {}
        storage: dict[MetadataIndex, _StorageInfo] = {}
        for key, t in self.tensors.items():
            prop = properties.get((t.dtype, t.requires_grad))
            if prop is None:
                prop = properties[(t.dtype, t.requires_grad)] = TensorProperties(
                    dtype=getattr(torch, t.dtype), requires_grad=t.requires_grad
                )
            chunks = []
            for i, c in enumerate(t.chunks):
                chunk = boxes.get((c.offsets, c.sizes))
                if chunk is None:
                    chunk = boxes[(c.offsets, c.sizes)] = ChunkStorageMetadata(
                        size(c.offsets), size(c.sizes)
                    )
                chunks.append(chunk)
                index = MetadataIndex(key, None, i)
                # the shared torch.Size, as MetadataIndex.__init__ would store a copy of it:
                # pickled once and then by reference
                object.__setattr__(index, "offset", chunk.offsets)
                storage[index] = _StorageInfo(c.file, c.record[0], c.record[1], c.transform)
            state[key] = TensorStorageMetadata(properties=prop, size=size(t.shape), chunks=chunks)
        for key, o in self.objects.items():
            state[key] = BytesStorageMetadata()
            storage[MetadataIndex(key)] = _StorageInfo(o.file, o.offset, o.length, o.transform)
        return state, storage


def plan_records(
    plan: SavePlan,
    placements: list[Places],
    file_name: Callable[[int, int], str],
    storage_meta: StorageMeta,
    object_crcs: dict[str, int],
) -> SaveRecords:
    """The records of `plan`'s keys (an owner's share of a save, `engine.plan`), all
    known from the plan and the places: each chunk's checksums are where its place
    says in its writer's file (`crc_at`, format version 5), its tiles those
    `format.checksums.tile_shape` picks. `file_name(rank, k)`: the name of a rank's
    k-th data file."""
    records = SaveRecords(len(placements), storage_meta, plan.mappings)
    itemsizes: dict[str, int] = {}
    tiles: dict[tuple[tuple[int, ...], int], tuple[int, ...]] = {}
    for key, t in plan.tensors.items():
        entry = records.tensors[key] = TensorEntry(t.dtype, t.shape, requires_grad=t.requires_grad)
        itemsize = itemsizes.get(t.dtype)
        if itemsize is None:
            itemsize = itemsizes[t.dtype] = getattr(torch, t.dtype).itemsize
        for offsets, lengths, rank, position in t.chunks:
            at, length, payload_at, file, crc_at = placements[rank].rows[position].tolist()
            tile = tiles.get((lengths, itemsize))
            if tile is None:
                tile = tiles[(lengths, itemsize)] = tile_shape(lengths, itemsize)
            payload = (payload_at, math.prod(lengths) * itemsize)
            name = file_name(rank, file)
            chunk = ChunkEntry(offsets, lengths, name, (at, length), payload, [], 0, None, tile)
            chunk.crc_at = crc_at
            entry.chunks.append(chunk)
    for key, (rank, position) in plan.objects.items():
        place = placements[rank][position]
        records.objects[key] = ObjectEntry(
            file_name(rank, place.file), place.offset, place.length, object_crcs[key]
        )
    return records


# -----------------------------------------------------------------------------
# Each key of a save planned by one rank, its owner: per-rank cost O(N), not O(W × N).
#
# Why owners, not a coordinator: a coordinator receives every rank's inventory
# (W × N entries, 75 MB at 1,024 ranks × 1,000 tensors) and plans it alone, so
# its time grows with the world; stock DCP's `create_global_plan` is that
# design. Here key k belongs to rank crc32c(k) mod W. Each rank routes each of
# its entries to the key's owner (one `all_to_all`); each owner runs
# `engine.plan.plan_save` — the same checks, the same choice of writers — over the
# entries of its keys, and routes back to each rank only which of its boxes it
# writes (a second `all_to_all`). Each rank reports the places of its records to
# their owners, which build their keys' share of the records (`owned_part`).
# The checksums stay with the writers, in their files: an owner keeps the places
# (`engine.plan`), so a repeated save reports nothing, unless an object is written
# by a rank other than its owner (an owner holding the object writes it itself:
# `plan_save(first=)`), whose crc32c its owner needs. A rank thus receives what the world holds of
# the keys it owns (N/W keys × W pieces ≈ N in an FSDP layout) and one decision
# per box it holds: O(N) bytes and work, whatever W.
#
# An owner's problems (disagreeing dtypes or shapes, overlaps, holes) go to
# every rank with the decisions: every rank raises the same error, listing them
# in owner order.
#
# A tensor of a process subgroup (`st.group`: the TP group of a DP × TP job) is no
# special case: a rank describes the global boxes it holds, whatever its group, so
# the DP copies of a block are one box with several holders, written once, and its
# copies are checked against each other by the key's owner like any entries. Per
# such key a holder sends its entry (key, dtype, shape, its boxes: tens of bytes plus
# 16 × ndim per box) and receives one row of two int64 per box it writes; the owner
# receives one entry per rank holding the key (W for a TP weight copied over every DP
# row), about N entries over its N / W keys. Measured (`test_subgroup_plan`), a rank
# receives about 45 B per key plus 270 B per peer of message framing: 11.8 KB at
# W = 4 and 12.4 KB at W = 16 for N = 256. No rank gathers a group's layout or any
# other rank's entries of keys it does not own, and nothing here asks for `st.group`.
# -----------------------------------------------------------------------------

# The records a writer reports to a key's owner: one int64 row each, its place
# (`Places`' fields) and an object's crc32c (a tensor's checksums stay in its
# writer's file: -1).
Report = np.ndarray


def file_name(rank: int, k: int, token: str) -> str:
    """The name of `rank`'s k-th data file in the save of `token`."""
    return data_file_name(f"__{rank}_", k, token)


def owner_of(key: str, world_size: int) -> int:
    """The rank that plans `key`: the same in every process and run (not `hash`)."""
    return crc32c.crc32c(key.encode("utf-8", "surrogatepass")) % world_size  # never raises


@dataclass(frozen=True)
class MyWrites:
    """What this rank writes, in its inventory order: each record's key and the index
    of its box in the key's entry (-1: an object), and, per owner, the positions of
    that owner's records, in the order the owner expects their reports. Arrays and
    one list of keys: a plan keeps them from save to save (`engine.plan`)."""

    keys: list[str]
    boxes: np.ndarray  # int64, one per record
    for_owner: list[np.ndarray]  # int64 positions in `keys`

    def __len__(self) -> int:
        return len(self.keys)

    def pairs(self) -> Iterator[tuple[str, int]]:
        """(key, box index) of each record, in write order."""
        return zip(self.keys, self.boxes.tolist())


def plan_by_owners(
    entries: list[Entry], agreement: Agreement
) -> tuple[MyWrites, SavePlan, list[str]]:
    """This rank's writes, the plan of the keys it owns, and every owner's problems
    (the same list on every rank). Two `all_to_all`s."""
    world, rank = agreement.world_size, agreement.rank
    sent: list[list[Entry]] = [[] for _ in range(world)]
    where: list[list[int]] = [[] for _ in range(world)]  # positions in `entries`
    for position, entry in enumerate(entries):
        key, _path, _dtype, _shape, _grad, _held = entry
        owner = owner_of(key, world)
        sent[owner].append(entry)
        where[owner].append(position)
    total = 0
    try:  # a dtype no record can hold (a quantized one) is refused on every rank, by the route
        total = held_bytes(entries)
    except Exception as e:  # noqa: BLE001 - raised on every rank by the route below
        agreement.defer(e)
    numbered = _box_ordinals(entries)
    received = agreement.route(
        [(total, theirs, [numbered[p] for p in at]) for theirs, at in zip(sent, where)]
    )
    # received[r]: what r holds in all, its entries of the keys this rank owns, and the
    # place of each among the tensor boxes r holds
    plan = SavePlan({}, {}, [[] for _ in range(world)], {}, [])
    replies: list[Any] = [([], [])] * world
    try:  # a failure here would leave the others in the next route: it rides on it
        plan = plan_save(
            [e for _n, e, _o in received],
            first=rank,
            loads=[n for n, _e, _o in received],
            ordinals=[o for _n, _e, o in received],
        )
        replies = []
        for r, (_n, theirs, _o) in enumerate(received):
            at = {key: i for i, (key, _p, _d, _s, _g, _h) in enumerate(theirs)}
            chosen = [(at[key], index) for key, index in plan.writes[r]]
            replies.append((np.array(chosen, np.int64).reshape(-1, 2), plan.problems))
        plan.writes.clear()  # replied: the plan this rank keeps (`engine.plan`) needs them no more
    except Exception as e:  # noqa: BLE001 - raised on every rank by the route below
        agreement.defer(e)
    back = agreement.route(replies)
    return _mine(entries, where, [d for d, _p in back]), plan, [p for _d, ps in back for p in ps]


def _mine(entries: list[Entry], where: list[list[int]], back: list[np.ndarray]) -> MyWrites:
    """This rank's writes from each owner's decisions (rows of (i, box index): its
    i-th entry sent to that owner), in inventory order, then box order."""
    positions = np.concatenate(
        [np.asarray(where[o], np.int64)[d[:, 0]] for o, d in enumerate(back)]
    )
    boxes = np.concatenate([d[:, 1] for d in back])
    order = np.lexsort((boxes, positions))
    rank_of = np.empty(len(order), np.int64)
    rank_of[order] = np.arange(len(order))  # where each decision's record is written
    ends = np.cumsum([len(d) for d in back]).tolist()
    for_owner = [rank_of[start:end] for start, end in zip([0, *ends[:-1]], ends)]
    key_of = [key for key, _path, _dtype, _shape, _grad, _held in entries]
    keys = [key_of[p] for p in positions[order].tolist()]
    return MyWrites(keys, boxes[order], for_owner)


def _box_ordinals(entries: list[Entry]) -> list[int]:
    """For each entry, how many tensor boxes the entries before it hold: the same
    numbers on ranks holding the same boxes in the same order (DP replicas), which
    owners turn ties between holders by (`plan_save(ordinals=)`)."""
    out, count = [], 0
    for _key, _path, dtype, _shape, _grad, held in entries:
        out.append(count)
        if dtype is not None:
            count += len(held)
    return out


def held_bytes(entries: list[Entry]) -> int:
    """The bytes of the shards in `entries` (boxes smaller than their tensor): the load
    a rank carries before replicated values, which owners balance against it. A whole
    tensor may be a replica every rank holds, so it does not count."""
    total = 0
    for _key, _path, dtype, shape, _grad, held in entries:
        if dtype is None or (len(held) == 1 and [s for _o, s in held] == [shape]):
            continue
        itemsize = dtype_from_name(dtype).itemsize
        total += sum(math.prod(sizes) for _offsets, sizes in held) * itemsize
    return total


def reports_for(mine: MyWrites, placed: Places, crcs: dict[str, int]) -> list[Report]:
    """Per owner, the reports of its records in the order it planned them. `crcs`:
    each object's crc32c, known before it was written."""
    out = []
    for order in mine.for_owner:
        rows = np.empty((len(order), FIELDS + 1), np.int64)
        rows[:, :FIELDS] = placed.rows[order]
        objects = mine.boxes[order] < 0
        rows[:, FIELDS] = -1
        rows[objects, FIELDS] = [crcs[mine.keys[w]] for w in order[objects].tolist()]
        out.append(rows)
    return out


# keys whose records an owner builds and encodes at once (`owned_part`)
BATCH = 4096


def owned_part(
    plan: SavePlan,
    places: list[Places],
    crcs: dict[str, int],
    token: str,
    storage_meta: StorageMeta,
    rank: int,
) -> Iterator[list[bytes]]:
    """The part of the keys this rank owns (`SaveRecords.sections`), as block `rank` of
    the index, batch by batch: the `engine.plan` its writers reported, per writer in plan
    order; `crcs`: its objects' crc32c. `BATCH` keys at a time, each batch written as
    it is made (`write_part`): an owner holds one batch's entries, `.metadata` objects
    and bytes, not 50,000 keys'."""
    names = partial(file_name, token=token)
    at = 0  # where the next batch's chunk sections start in the block
    for kind in (plan.tensors, plan.objects):
        keys = list(kind)
        for start in range(0, len(keys), BATCH):
            batch = keys[start : start + BATCH]
            sub = SavePlan(
                {k: plan.tensors[k] for k in batch} if kind is plan.tensors else {},
                {k: plan.objects[k] for k in batch} if kind is plan.objects else {},
                [],
                {k: plan.mappings.get(k) or (k,) for k in batch},
                [],
            )
            sections = plan_records(sub, places, names, storage_meta, crcs).sections(
                sub.mappings, rank, at
            )
            at += len(sections[-1])
            yield sections


def routed(plan: SavePlan, received: list[Report]) -> tuple[list[Places], dict[str, int]]:
    """What the writers reported: the places of this owner's records, its objects' crc32c."""
    places = [Places(np.ascontiguousarray(theirs[:, :FIELDS])) for theirs in received]
    return places, {key: int(received[r][j, FIELDS]) for key, (r, j) in plan.objects.items()}


def remote_objects(plan: SavePlan, rank: int) -> int:
    """Of the objects this rank owns, how many another rank writes (their crc32c must be
    reported to it at every save)."""
    return sum(writer != rank for writer, _position in plan.objects.values())


# -----------------------------------------------------------------------------
# A save's plan kept for the next save of the same structure: repeated saves plan for free.
#
# A training loop saves one structure again and again: the same keys, dtypes,
# shapes, layouts and world. Each rank keeps what the last plans of its group
# decided for it — its writes and their places, and as an owner its keys' plan
# (`engine.plan`) — under a signature of what it described (its `inventory.Entry`
# list with objects by length, the world size, its rank, the kind of storage).
# The next save computes its signature and every rank learns in one fixed-size
# `all_reduce` (`Agreement.agree`) whether every rank found its own signature
# kept under the same plan id, the way nvidia-resiliency-ext decides to reuse
# last save's metadata; that works after a restart too, where nothing is kept
# and the ranks simply plan. Any difference on any rank replans everywhere: a
# key, a layout, a dtype, a shape, the world size, the storage, or the length of
# an object (offsets follow from lengths). Names and ids that change with each
# save (its token, `save_id`, the folder) are never part of a plan.
# -----------------------------------------------------------------------------

KEEP = 4  # plans kept per group: a model's and an optimizer's state saved in turn both hit

# Groups kept, least recently used dropped: a group made for one save is never seen again.
# A process is one rank of a few groups; the in-process communicator runs 1,024 ranks,
# each a group of its own (`bench scale`).
GROUPS = 1024


@dataclass(frozen=True)
class Planned:
    """One rank's share of a plan: what it writes and where, its keys' plan and where
    their records lie (`engine.plan`, per writer), and whether any rank writes an object
    it does not own (`routes`: its crc32c is then reported at every save)."""

    plan_id: int
    mine: MyWrites
    placed: Places
    owned: SavePlan
    places: list[Places] | None = None
    routes: bool = True


_KEPT: dict[Hashable, OrderedDict[bytes, Planned]] = {}

_LOCK = threading.Lock()  # async saves (and thread ranks) keep plans from other threads

# entries pickled into the signature's hash at a time: one pickle of 100,000 would
# hold its bytes and its memo at once (tens of MiB)
CACHE_BATCH = 4096


def _structure(entry: Entry) -> Entry:
    """An entry as a plan depends on it: an object's crc32c left out (its bytes may
    change, its length may not)."""
    key, path, dtype, shape, grad, held = entry
    if dtype is not None:
        return entry
    length, _crc = held
    return (key, path, dtype, shape, grad, length)


def signature(entries: list[Entry], world_size: int, rank: int, storage: str) -> bytes:
    """What a plan depends on, hashed: every field of every entry but an object's
    crc32c (its bytes may change, its length may not). Like shapes and boxes are one
    tuple (`inventory.describe`), pickled by reference: the same structure hashes the
    same at every save; anything else only replans."""
    digest = hashlib.blake2b(digest_size=16)
    digest.update(pickle.dumps((world_size, rank, storage, len(entries)), protocol=4))
    for start in range(0, len(entries), CACHE_BATCH):
        batch = entries[start : start + CACHE_BATCH]
        shapes = [_structure(entry) for entry in batch]
        digest.update(pickle.dumps(shapes, protocol=pickle.HIGHEST_PROTOCOL))
    return digest.digest()


def lookup(group: Hashable, sig: bytes) -> Planned | None:
    """The plan kept for `sig` on this rank of `group`, if any."""
    with _LOCK:
        kept = _KEPT.get(group)
        found = None if kept is None else kept.get(sig)
        if found is not None:
            kept.move_to_end(sig)  # type: ignore[union-attr]
        return found


def keep(group: Hashable, sig: bytes, planned: Planned) -> None:
    """Keep `planned` for `sig`, dropping the least recently used beyond `KEEP`."""
    with _LOCK:
        kept = _KEPT.pop(group, None) or OrderedDict()
        _KEPT[group] = kept  # the most recently used group last
        while len(_KEPT) > GROUPS:
            del _KEPT[next(iter(_KEPT))]
        kept[sig] = planned
        while len(kept) > KEEP:
            kept.popitem(last=False)


def forget(group: Hashable | None = None) -> None:
    """Drop the plans kept for `group` (None: every group)."""
    with _LOCK:
        if group is None:
            _KEPT.clear()
        else:
            _KEPT.pop(group, None)
