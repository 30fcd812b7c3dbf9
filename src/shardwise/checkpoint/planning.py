"""The global plan of a save, computed identically on every rank from the exchanged inventories.

No process group here: `plan_save` is a pure function of every rank's
`inventory.Entry` list, so each rank derives the same plan after one
`all_gather_object` and no plan is ever scattered. Its cost is linear in the
number of entries (plus a sort of the replicated ones). It decides:

* which rank writes each distinct box: a box one rank holds is written by it;
  a box several ranks hold (a plain tensor, a replicated block) by the holder
  with the fewest bytes assigned so far, largest boxes first, so replicated
  state is spread over the ranks deterministically; an object by the lowest
  rank holding it;
* where each record goes: rank r writes one file, its records in its own
  inventory order, so every offset follows from the records' lengths
  (`record_frame`), known before any byte is written;
* what is wrong: a key held as a tensor on one rank and an object on another,
  or with different dtypes or global shapes, boxes out of bounds or
  overlapping, or (on more than one rank, as stock DCP) not covering the tensor.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from ..layout import Block
from ..layout.coverage import analyze
from .inventory import Box, Entry
from .manifest import dtype_from_name
from .record_write import record_frame

__all__ = ["Placement", "SavePlan", "TensorPlan", "place_records", "plan_save"]

_PAIRWISE = 16  # up to this many distinct boxes per key, overlap is checked pair by pair


@dataclass
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
    mappings: dict[str, tuple[Any, ...]]  # DCP's planner_data: flattened key -> path
    problems: list[str]


@dataclass(frozen=True)
class Placement:
    """Where one record lies in its rank's data file."""

    offset: int
    length: int
    payload: int  # absolute offset of a tensor record's payload (of an object: its offset)


def _nbytes(dtype: str, sizes: tuple[int, ...]) -> int:
    return math.prod(sizes) * dtype_from_name(dtype).itemsize


def plan_save(inventories: list[list[Entry]]) -> SavePlan:
    """The plan for every rank's `inventory.describe` entries, in rank order."""
    tensors: dict[str, TensorPlan] = {}
    objects: dict[str, tuple[int, int]] = {}
    mappings: dict[str, tuple[Any, ...]] = {}
    problems: list[str] = []
    kinds: dict[str, tuple[str | None, tuple[int, ...] | None, int]] = {}
    holders: dict[tuple[str, Box], list[tuple[int, int]]] = {}  # -> [(rank, box index)]
    for rank, entries in enumerate(inventories):
        for key, path, dtype, shape, requires_grad, held in entries:
            mappings.setdefault(key, path)
            seen = kinds.get(key)
            if seen is None:
                kinds[key] = (dtype, shape, rank)
                if dtype is None:
                    objects[key] = (rank, -1)
                else:
                    tensors[key] = TensorPlan(dtype, shape, requires_grad)  # type: ignore[arg-type]
            elif seen[:2] != (dtype, shape):
                problems.append(_disagreement(key, seen, (dtype, shape, rank)))
                continue
            if dtype is not None:
                for index, box in enumerate(held):
                    holders.setdefault((key, box), []).append((rank, index))
    load = [0] * len(inventories)
    writer: dict[tuple[str, Box], tuple[int, int]] = {}
    shared = []
    for (key, box), held_by in holders.items():
        if len(held_by) == 1:
            writer[(key, box)] = held_by[0]
            load[held_by[0][0]] += _nbytes(tensors[key].dtype, box[1])
        else:
            shared.append((key, box, held_by))
    order = {key: i for i, key in enumerate(tensors)}
    shared.sort(key=lambda s: (-_nbytes(tensors[s[0]].dtype, s[1][1]), order[s[0]], s[1]))
    for key, box, held_by in shared:
        rank, index = min(held_by, key=lambda h: (load[h[0]], h[0]))
        writer[(key, box)] = (rank, index)
        load[rank] += _nbytes(tensors[key].dtype, box[1])
    writes: list[list[tuple[str, int]]] = [[] for _ in inventories]
    for rank, entries in enumerate(inventories):  # each rank writes in its own inventory order
        for key, _path, dtype, _shape, _grad, held in entries:
            if dtype is None:
                if key in objects and objects[key] == (rank, -1):
                    objects[key] = (rank, len(writes[rank]))
                    writes[rank].append((key, -1))
                continue
            if key not in tensors or kinds[key][:2] != (dtype, _shape):
                continue
            for index, box in enumerate(held):
                if writer.get((key, box)) == (rank, index):
                    tensors[key].chunks.append((*box, rank, len(writes[rank])))
                    writes[rank].append((key, index))
    multi_rank = len(inventories) > 1
    for key, plan in tensors.items():
        problem = _check_boxes(key, plan, multi_rank)
        if problem:
            problems.append(problem)
    for key in objects:
        if objects[key][1] < 0:  # cannot happen: the first holder writes it
            problems.append(f"object '{key}' has no writer")
    return SavePlan(tensors, objects, writes, mappings, problems)


def _disagreement(key: str, first: tuple[Any, ...], other: tuple[Any, ...]) -> str:
    def what(kind: tuple[Any, ...]) -> str:
        dtype, shape, rank = kind
        if dtype is None:
            return f"rank {rank} holds a Python object"
        return f"rank {rank} holds a tensor of dtype {dtype}, shape {tuple(shape)}"

    return f"'{key}': {what(first)} but {what(other)}"


def _check_boxes(key: str, plan: TensorPlan, multi_rank: bool) -> str | None:
    """Out of bounds, overlapping, or (across ranks) not covering: as stock DCP refuses."""
    shape = plan.shape
    boxes = [(o, s) for o, s, _r, _p in plan.chunks]
    for offsets, sizes in boxes:
        if len(offsets) != len(shape) or any(
            o < 0 or n < 0 or o + n > d for o, n, d in zip(offsets, sizes, shape)
        ):
            return f"'{key}': chunk at offsets {offsets} sizes {sizes} is out of bounds of {shape}"
    solid = [b for b in boxes if math.prod(b[1])]
    if len(solid) > 1:
        if len(solid) <= _PAIRWISE:
            for i, a in enumerate(solid):
                for b in solid[i + 1 :]:
                    if all(
                        max(ao, bo) < min(ao + an, bo + bn)
                        for ao, an, bo, bn in zip(a[0], a[1], b[0], b[1])
                    ):
                        return f"'{key}': chunks at offsets {a[0]} and {b[0]} overlap"
        else:
            found = analyze([Block(o, s) for o, s in solid], shape).overlap
            if found is not None:
                return (
                    f"'{key}': chunks at offsets {found[0].offsets} and {found[1].offsets} overlap"
                )
    volume = sum(math.prod(s) for _o, s in boxes)
    if multi_rank and shape and volume != math.prod(shape):
        return (
            f"'{key}': the chunks saved cover {volume} of its {math.prod(shape)} elements; "
            "every element must be held by some rank"
        )
    return None


def place_records(
    plan: SavePlan,
    entries: list[Entry],
    rank: int,
    serialization_id: str,
) -> list[Placement]:
    """Where each record of `rank`'s writes lands in its data file, in write order
    (`entries`: that rank's inventory)."""
    boxes = {e[0]: e for e in entries}
    out = []
    pos = 0
    for key, index in plan.writes[rank]:
        _key, _path, dtype, _shape, _grad, held = boxes[key]
        if index < 0:
            n = held  # an object's entry holds its byte length
            out.append(Placement(pos, n, pos))
            pos += n
            continue
        sizes = held[index][1]
        head, tail = record_frame(dtype_from_name(dtype), sizes, serialization_id)  # type: ignore[arg-type]
        length = len(head) + _nbytes(dtype, sizes) + len(tail)  # type: ignore[arg-type]
        out.append(Placement(pos, length, pos + len(head)))
        pos += length
    return out
