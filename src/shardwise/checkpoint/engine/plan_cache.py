"""A save's plan kept for the next save of the same structure: repeated saves plan for free.

A training loop saves one structure again and again: the same keys, dtypes,
shapes, layouts and world. Each rank keeps what the last plans of its group
decided for it — its writes and their places, and as an owner its keys' plan
(`key_owners`) — under a signature of what it described (its `inventory.Entry`
list with objects by length, the world size, its rank, the kind of storage).
The next save computes its signature and every rank learns in one fixed-size
`all_reduce` (`Agreement.agree`) whether every rank found its own signature
kept under the same plan id, the way nvidia-resiliency-ext decides to reuse
last save's metadata; that works after a restart too, where nothing is kept
and the ranks simply plan. Any difference on any rank replans everywhere: a
key, a layout, a dtype, a shape, the world size, the storage, or the length of
an object (offsets follow from lengths). Names and ids that change with each
save (its token, `save_id`, the folder) are never part of a plan.
"""

from __future__ import annotations

import hashlib
import pickle
import threading
from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass

from .inventory import Entry
from .key_owners import MyWrites
from .places import Places
from .planning import SavePlan

__all__ = ["Planned", "forget", "keep", "lookup", "signature"]

KEEP = 4  # plans kept per group: a model's and an optimizer's state saved in turn both hit
# Groups kept, least recently used dropped: a group made for one save is never seen again.
# A process is one rank of a few groups; the in-process communicator runs 1,024 ranks,
# each a group of its own (`bench scale`).
GROUPS = 1024


@dataclass(frozen=True)
class Planned:
    """One rank's share of a plan: what it writes and where, its keys' plan and where
    their records lie (`places`, per writer), and whether any rank writes an object
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


def signature(entries: list[Entry], world_size: int, rank: int, storage: str) -> bytes:
    """What a plan depends on, hashed: every field of every entry but an object's
    crc32c (its bytes may change, its length may not). Like shapes and boxes are one
    tuple (`inventory.describe`), pickled by reference: the same structure hashes the
    same at every save; anything else only replans."""
    digest = hashlib.blake2b(digest_size=16)
    digest.update(pickle.dumps((world_size, rank, storage, len(entries)), protocol=4))
    for start in range(0, len(entries), CACHE_BATCH):
        batch = entries[start : start + CACHE_BATCH]
        shapes = [e if e[2] is not None else (*e[:5], e[5][0]) for e in batch]
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
