"""Each key of a save planned by one rank, its owner: per-rank cost O(N), not O(W × N).

Why owners, not a coordinator: a coordinator receives every rank's inventory
(W × N entries, 75 MB at 1,024 ranks × 1,000 tensors) and plans it alone, so
its time grows with the world; stock DCP's `create_global_plan` is that
design. Here key k belongs to rank crc32c(k) mod W. Each rank routes each of
its entries to the key's owner (one `all_to_all`); each owner runs
`planning.plan_save` — the same checks, the same choice of writers — over the
entries of its keys, and routes back to each rank only which of its boxes it
writes (a second `all_to_all`). Each rank reports the places of its records to
their owners, which build their keys' share of the records (`owned_part`).
The checksums stay with the writers, in their files: an owner keeps the places
(`plan_cache`), so a repeated save reports nothing, unless an object is written
by a rank other than its owner (an owner holding the object writes it itself:
`plan_save(first=)`), whose crc32c its owner needs. A rank thus receives what the world holds of
the keys it owns (N/W keys × W pieces ≈ N in an FSDP layout) and one decision
per box it holds: O(N) bytes and work, whatever W.

An owner's problems (disagreeing dtypes or shapes, overlaps, holes) go to
every rank with the decisions: every rank raises the same error, listing them
in owner order.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from functools import partial
from typing import Any

import crc32c
import numpy as np
from torch.distributed.checkpoint.metadata import StorageMeta

from ...comm.agreement import Agreement
from ..format.manifest import dtype_from_name
from ..io.record_names import data_file_name
from .inventory import Entry
from .places import FIELDS, Places
from .planning import SavePlan, plan_save
from .save_records import plan_records

__all__ = [
    "MyWrites",
    "Report",
    "file_name",
    "held_bytes",
    "owned_part",
    "owner_of",
    "plan_by_owners",
    "remote_objects",
    "reports_for",
    "routed",
]

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
    one list of keys: a plan keeps them from save to save (`plan_cache`)."""

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
        owner = owner_of(entry[0], world)
        sent[owner].append(entry)
        where[owner].append(position)
    total = 0
    try:  # a dtype no record can hold (a quantized one) is refused on every rank, by the route
        total = held_bytes(entries)
    except Exception as e:  # noqa: BLE001 - raised on every rank by the route below
        agreement.defer(e)
    received = agreement.route([(total, theirs) for theirs in sent])
    # received[r]: what r holds in all, and its entries of the keys this rank owns
    plan = SavePlan({}, {}, [[] for _ in range(world)], {}, [])
    replies: list[Any] = [([], [])] * world
    try:  # a failure here would leave the others in the next route: it rides on it
        plan = plan_save([e for _n, e in received], first=rank, loads=[n for n, _e in received])
        replies = []
        for r, (_n, theirs) in enumerate(received):
            at = {e[0]: i for i, e in enumerate(theirs)}
            chosen = [(at[key], index) for key, index in plan.writes[r]]
            replies.append((np.array(chosen, np.int64).reshape(-1, 2), plan.problems))
        plan.writes.clear()  # replied: the plan this rank keeps (`plan_cache`) needs them no more
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
    keys = [entries[p][0] for p in positions[order].tolist()]
    return MyWrites(keys, boxes[order], for_owner)


def held_bytes(entries: list[Entry]) -> int:
    """The bytes of the shards in `entries` (boxes smaller than their tensor): the load
    a rank carries before replicated values, which owners balance against it. A whole
    tensor may be a replica every rank holds, so it does not count."""
    total = 0
    for _key, _path, dtype, shape, _grad, held in entries:
        if dtype is None or (len(held) == 1 and held[0][1] == shape):
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
    the index, batch by batch: the `places` its writers reported, per writer in plan
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
