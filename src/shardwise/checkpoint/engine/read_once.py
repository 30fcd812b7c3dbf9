"""Every stored byte range read once per load: sharded targets whose global layouts
say which ranks need each stored chunk, one of them reading it and sending the
others their parts over the load's process group.

When k > 1 ranks of a load need bytes of one stored chunk (the replicas of a DP ×
TP job's TP shards, HSDP's replicate dimension, the column ranks that each take a
band of a stored row chunk), stock DCP reads them k times: k requests to an
object store, k × the bytes over a shared file system's link. Here one of the k
reads them (verifying them as any read does) and sends the others their parts,
point to point.

Which ranks need a chunk is a global fact: a `ShardedTensor`'s layout and a
DTensor's mesh and placements list every rank's blocks. So every rank works out
alone, with no exchange, who reads each chunk it needs and what it sends and
receives; the load's first verdict (one `all_reduce` it makes anyway) carries a
hash of what each rank takes part with (each key's layout, its ranks, whether
this rank's targets can take bytes: CPU or CUDA, of the stored dtype) and the largest
number of bytes a rank's targets hold, so every rank knows that every other
planned from the same facts, and how many rounds to cut the bytes into.

The reader of a chunk: the ranks needing exactly the same chunks (a DP replica
set, a column group) form a group, whose members each read about a k-th of its
bytes, so each rank reads about stored bytes ÷ W. Its files go whole, largest
first, to the least loaded member while it stays within 5/4 of its share (a file
is then one request on an object store); the chunks of the others fill the
members below their share in turn, in storage order (`_readers`). A chunk only
one rank needs is read by it, as without this.

Only a chunk's reader fetches the checksums its writer keeps in its data file
(format version 5): the other ranks plan with its row alone (`format.index.
Unsettled`, where the checksums lie checked on every rank), and the reader fetches
those of all its rounds' chunks in its first, with the bytes they check
(`io.read`: one ranged GET where they are neighbours).

The rule (`read_once=None`, "auto"): on a medium several readers share (an object
store, a network file system: `Folder.shared_medium`) or ranks on several hosts,
a byte read k times costs k of the medium's aggregate bandwidth while sending it
k - 1 times costs the fabric's, which each pair of ranks has of its own: it pays
whenever k > 1. On one host's own storage a read is a copy out of the page cache
and a send is that copy and a pass through the process group: it never pays, and
nothing is sent. `True` and `False` force it.

Per rank, for n chunks overlapping its pieces held by k ranks each: O(n · k) to
plan (the holders of each chunk, from an index of each distinct layout: O(B) once
for its B blocks), bytes read ≈ stored bytes ÷ W, bytes received = its targets'
bytes less what it reads itself, bytes sent = what it reads × (k - 1) overlap;
R = ⌈largest rank's target bytes ÷ `BATCH`⌉ rounds (at most one a key), each this
rank's receives posted, then its reads made and its parts sent; a round holds the
regions it reads for others (read straight into its target where the region is its
own part) and contiguous copies of parts that are not contiguous. A chunk held
whole by every rank of a DP group is read into the reader's target and sent from
there, received straight into the others' targets: no copy in between.
CUDA targets take part through host memory: the bytes a reader reads for
others are read into host memory and sent from there (over the group's gloo side
group under NCCL), a receiver takes them into pinned scratch and copies them to its
device once, asynchronously on the device's current stream; a reader's own part
goes to its device from pinned memory likewise. So a CUDA target's bytes cross the
host-to-device link once, on its own rank, as without the exchange, and storage is
read once. The load waits for those copies before it returns. (Sending them over
NCCL instead, device to device, is not built: NCCL's point-to-point messages
between a pair must be posted in one group call each way, which the exchange's
posting of receives before reads does not do.)
"""

from __future__ import annotations

import contextlib
import dataclasses
import heapq
import math
import os
import uuid
import zlib
from collections import defaultdict
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem

from ...comm.agreement import digest
from ...comm.communicator import Communicator, ProcessGroupCommunicator
from ...errors import CorruptCheckpointError, LayoutError
from ...layout import Block, BlockIndex, Layout
from ...storage import Folder, FsspecFolder, SharedReads
from ...tensor import ShardedTensor
from ..format import ChunkEntry, Unsettled
from ..io import ChunkRead, PendingChunk, ReadExecutor
from .inventory import Piece, pieces_of
from .stored import StoredBox, StoredView

__all__ = [
    "ARRIVAL_S",
    "BATCH",
    "Ask",
    "Exchange",
    "Fetch",
    "Holders",
    "ItemFetch",
    "Incoming",
    "ItemRoute",
    "Part",
    "Round",
    "agreed",
    "arrived",
    "eligible",
    "exchange",
    "item_routes",
    "may_pay",
    "records",
    "records_shared",
    "routed_plans",
    "run",
    "run_item_route",
    "shares_records",
    "words",
]

BATCH = 64 << 20  # about the bytes a rank's targets take per round

# a group's files go whole to a reader while it reads at most SLACK_NUM / SLACK_DEN
# of its share (`_readers`)
SLACK_NUM, SLACK_DEN = 5, 4

_PLAIN = (torch.Tensor, torch.nn.Parameter)


class Holders:
    """A target's global layout in the load group's ranks: which ranks hold which
    blocks, and who overlaps a stored chunk."""

    def __init__(
        self, layout: Layout, ranks: tuple[int, ...], inverse: Mapping[int, list[int]]
    ) -> None:
        self.layout = layout
        self.ranks = ranks  # layout rank -> load rank
        self._inverse = inverse  # load rank -> its layout ranks
        # Python's hash of ints and tuples of them is the same in every process; a
        # layout's is kept with it (O(B) once per layout object)
        self.fingerprint = hash((layout, ranks))
        self._index: BlockIndex | None = None

    def blocks_of(self, load_rank: int) -> list[Block]:
        """The non-empty blocks `load_rank` holds."""
        return [
            b
            for r in self._inverse.get(load_rank, ())
            for b in self.layout.blocks_of(r)
            if not b.is_empty()
        ]

    def overlapping(self, box: Block) -> list[tuple[int, Block, Block]]:
        """(load rank, block, its overlap with `box`) for every block sharing elements
        with `box`, by rank then block."""
        if self._index is None:
            self._index = BlockIndex(list(self.layout.distinct_blocks))
        out = []
        for block, common in self._index.query(box):
            for r in self.layout.ranks_holding(block):
                out.append((self.ranks[r], block, common))
        out.sort(key=lambda x: (x[0], x[1].offsets))
        return out


def may_pay(broadcast: bool | None, folder: Folder) -> bool:
    """Whether to work out what this rank could take part with at all (its cost, O(N)
    and O(B) per distinct layout, is spared where the rule cannot hold): forced, or
    on a shared medium, or unless the launcher says every rank is on this host
    (torchrun's `LOCAL_WORLD_SIZE` equal to its `WORLD_SIZE`). A rank that skips it
    hashes nothing, so every rank then reads its own bytes (also where ranks of one
    such host see the folder through different mounts)."""
    if broadcast is not None:
        return broadcast
    if folder.shared_medium:
        return True
    local, world = os.environ.get("LOCAL_WORLD_SIZE"), os.environ.get("WORLD_SIZE")
    return not (local is not None and local == world)  # the whole job on one host


def _load_ranks(comm: Communicator) -> dict[int, int] | None:
    """Global rank -> load rank; None: the load runs over the default group (or is
    no process group: ranks are layout ranks)."""
    if not isinstance(comm, ProcessGroupCommunicator) or comm.group in (None, dist.group.WORLD):
        return None
    return {g: i for i, g in enumerate(dist.get_process_group_ranks(comm.group))}


class _Known:
    """What one load's `eligible` has worked out: each mesh's ranks (torch computes
    `DeviceMesh.mesh` anew on each access) and each distinct layout's `Holders`."""

    def __init__(self) -> None:
        self.meshes: dict[int, tuple[tuple[int, ...], tuple[int, ...], Any]] = {}
        self.holders: dict[Any, Holders | None] = {}
        self.inverses: dict[tuple[int, ...], dict[int, list[int]]] = {}

    def inverse(self, ranks: tuple[int, ...]) -> dict[int, list[int]]:
        """Load rank -> the layout ranks it is, once per distinct rank tuple."""
        found = self.inverses.get(ranks)
        if found is None:
            found = self.inverses[ranks] = defaultdict(list)
            for r, load_rank in enumerate(ranks):
                found[load_rank].append(r)
        return found

    def mesh(self, mesh: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """The mesh's shape and its global ranks, row-major."""
        known = self.meshes.get(id(mesh))
        if known is None:  # the mesh is kept with them: its id stays its own
            grid = mesh.mesh
            ranks = tuple(grid.flatten().tolist())
            known = self.meshes[id(mesh)] = (tuple(grid.shape), ranks, mesh)
        return known[0], known[1]


def _holders(value: Any, load: dict[int, int] | None, known: _Known) -> Holders | None:
    """`value`'s layout in load ranks, when a global fact describes it: a ShardedTensor's
    layout on its mesh or group, a DTensor's placements on its mesh."""
    layout: Layout | None = None
    if isinstance(value, ShardedTensor):
        if not isinstance(value._layout, Layout):  # learned on first use: collective
            return None
        layout = value._layout
        if value._mesh is not None:
            ranks = known.mesh(value._mesh)[1]
        elif value._group is not None:
            try:  # a process group's global ranks (another Communicator: none known)
                ranks = tuple(dist.get_process_group_ranks(value._group))
            except (KeyError, ValueError, RuntimeError, AttributeError, TypeError):
                return None
        else:
            ranks = tuple(range(layout.world_size))
        # equal layouts share one entry (a layout's hash is kept: O(B) once per object)
        key: Any = (layout, ranks)
    elif _is_dtensor(value):
        mesh_shape, ranks = known.mesh(value.device_mesh)
        key = (mesh_shape, tuple(value.placements), tuple(value.shape), ranks)
    else:
        return None
    if key in known.holders:
        return known.holders[key]
    found = None
    try:
        if layout is None:
            layout = Layout.from_dtensor_spec(key[0], value.placements, value.shape)
        if len(ranks) == layout.world_size and (load is None or all(g in load for g in ranks)):
            mapped = ranks if load is None else tuple(load[g] for g in ranks)
            found = Holders(layout, mapped, known.inverse(mapped))
    except LayoutError:  # Partial, _StridedShard: no boxes
        pass
    known.holders[key] = found
    return found


def _is_dtensor(value: Any) -> bool:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - torch without DTensor
        return False
    return isinstance(value, DTensor)


def eligible(
    flat: Mapping[str, Any],
    view: StoredView,
    comm: Communicator,
    skip: set[str] | frozenset[str],
) -> tuple[dict[str, tuple[Holders, list[Piece]]], list[Any], int]:
    """The sharded targets this rank can take part with (its pieces on the CPU or a
    CUDA device, of the stored dtype, plain bytes, exactly its layout's blocks), what
    it hashes for the verdict (every layout-described key, and whether it takes
    part: equal everywhere only when every rank plans from the same facts), and
    the bytes its taking-part targets hold."""
    if view.per_rank:  # each rank sees its own records: no global fact to plan from
        return {}, [], 0
    load = _load_ranks(comm)
    rank = comm.rank
    known = _Known()
    found: dict[str, tuple[Holders, list[Piece]]] = {}
    signature: list[Any] = []
    nbytes = 0
    for key in sorted(flat):
        value = flat[key]
        stored = view.tensor(key) if isinstance(value, torch.Tensor) else None
        if stored is None or key in skip or tuple(value.shape) != stored[0]:
            continue
        holders = _holders(value, load, known)
        if holders is None:
            continue
        pieces = [p for p in (pieces_of(value) or []) if p.tensor.numel()]
        ok = _takes_bytes(pieces, stored[1]) and sorted(
            (p.offsets, p.sizes) for p in pieces
        ) == sorted((b.offsets, b.sizes) for b in holders.blocks_of(rank))
        signature.append((key, holders.fingerprint, ok))
        if ok:
            found[key] = (holders, pieces)
            nbytes += sum(p.tensor.numel() * p.tensor.element_size() for p in pieces)
    return found, signature, nbytes


def _takes_bytes(pieces: list[Piece], dtype: torch.dtype) -> bool:
    return all(_plain(p.tensor, dtype) for p in pieces)


def _plain(t: torch.Tensor, dtype: torch.dtype, devices: tuple[str, ...] = ("cpu", "cuda")) -> bool:
    """Whether `t` is plain strided memory of `dtype` on a device of `devices` (bytes
    land in it as stored; a CUDA target's travel in host memory first, `_staged`)."""
    return (
        type(t) in _PLAIN
        and t.dtype == dtype
        and t.device.type in devices
        and t.layout == torch.strided
        and not (t.is_conj() or t.is_neg())
    )


def _staged(t: torch.Tensor) -> bool:
    """Whether bytes bound for `t` land in host scratch first: `t` is not contiguous
    host memory (a CUDA target: pinned scratch, one copy to the device)."""
    return t.device.type != "cpu" or not t.is_contiguous()


def _scratch(shape: Any, dtype: torch.dtype, device_bound: bool) -> torch.Tensor:
    """Host memory for bytes on their way to a target: pinned when they go on to a
    device, so that copy runs asynchronously on the device's current stream (the
    caching host allocator keeps the memory until the copy is done)."""
    return torch.empty(shape, dtype=dtype, pin_memory=device_bound)


def _settle(devices: set[torch.device]) -> None:
    """Wait for the copies queued to `devices`' current streams: a load returns its
    targets filled, for any stream."""
    for device in devices:
        torch.cuda.current_stream(device).synchronize()


def _plain_host(t: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether `t` is plain strided CPU memory of `dtype` (bytes land in it as stored)."""
    return _plain(t, dtype, ("cpu",))


def words(signature: list[Any], view: StoredView | None, verify: bool, nbytes: int) -> list[int]:
    """What the first verdict carries: [hash, -hash] of the signature (with the
    checkpoint's save id and whether it verifies: a rank that verifies is never
    sent bytes another read unverified), and this rank's target bytes."""
    save_id = view.manifest.storage_meta.get("save_id") if view and view.manifest else None
    mine = digest((save_id, verify, signature)) if signature else 0
    return [mine, -mine, nbytes]


def agreed(maxima: list[int]) -> int | None:
    """The largest rank's target bytes when every rank hashed the same signature."""
    most, least, nbytes = maxima
    return nbytes if most and most == -least else None


# -- the plan --------------------------------------------------------------------------

Order = tuple[int, tuple[int, ...], tuple[int, ...]]  # (key's place, chunk offsets, block offsets)


@dataclass
class Fetch:
    """A stored region one rank reads for several: its read (straight into this rank's
    target when the region is exactly its own part, else into scratch), and where each
    part goes: this rank's target view, or a rank to send it to, in `Order`."""

    key: str
    info: Any
    chunk_sizes: tuple[int, ...]
    dtype: torch.dtype
    region: Block  # global box read, inside the chunk
    chunk_offsets: tuple[int, ...]
    into: torch.Tensor | None  # this rank's target, when the region is its part
    parts: list[tuple[int, Block, torch.Tensor | None, Order]]  # (rank, box, own view, order)


@dataclass
class Round:
    """One round of messages: what this rank reads and sends, and what it receives from
    whom (each sender's parts in `Order`, as the sender sends them)."""

    fetches: list[Fetch] = field(default_factory=list)
    incoming: dict[int, list[tuple[Order, torch.Tensor]]] = field(
        default_factory=lambda: defaultdict(list)
    )


@dataclass
class Exchange:
    """This rank's part of the read-once exchange, round by round."""

    rounds: list[Round]
    # (key, piece, chunks) only this rank needs: read as without the exchange
    alone: list[tuple[str, Piece, list[StoredBox]]]
    keys: frozenset[str]
    # (filled, its copy): a block a rank holds twice is filled once, then copied
    copies: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)

    def has_work(self) -> bool:
        """Whether this rank reads for others or receives from them."""
        return any(r.fetches or r.incoming for r in self.rounds)


def exchange(
    found: Mapping[str, tuple[Holders, list[Piece]]],
    covered: Mapping[str, list[tuple[Piece, list[StoredBox]]]],
    view: StoredView,
    rank: int,
    most_bytes: int,
    batch: int | None = None,
) -> Exchange:
    """This rank's reads, sends and receives for the `found` keys, from the stored
    chunks `covered` lists for each of its pieces: the same plan on every rank of
    a chunk's holders, from global facts alone."""
    limit = BATCH if batch is None else batch
    keys = sorted(found)
    # rounds take whole keys: never more rounds than keys
    count = min(len(keys), -(-max(most_bytes, 1) // limit))
    rounds_of = _rounds(keys, view, count)
    rounds = [Round() for _ in range(count)]
    solo: list[tuple[str, Piece, list[StoredBox]]] = []
    # chunks by the exact set of ranks needing them, in storage order within each set
    groups: dict[tuple[int, ...], list[tuple[int, str, StoredBox, Block, list[Any]]]] = defaultdict(
        list
    )
    for order, key in enumerate(keys):
        holders, _pieces = found[key]
        users_of: dict[tuple[tuple[int, ...], tuple[int, ...]], list[Any]] = {}
        for piece, chunks in covered.get(key, ()):
            alone = []
            for chunk in chunks:
                box = (tuple(chunk.offsets), tuple(chunk.sizes))
                known = users_of.get(box)
                users = known if known is not None else holders.overlapping(Block(*box))
                if known is None:  # the chunk's first piece here: it joins its group
                    users_of[box] = users
                    members = tuple(sorted({r for r, _b, _c in users}))
                    if members != (rank,):
                        region = _bounds([c for _r, _b, c in users])
                        groups[members].append((order, key, chunk, region, users))
                if all(r == rank for r, _b, _c in users):
                    alone.append(chunk)  # read as without the exchange
            if alone:
                solo.append((key, piece, alone))
    mine: dict[str, dict[Any, Piece]] = {}  # this rank's pieces by box: the first of equal ones
    copies: list[tuple[torch.Tensor, torch.Tensor]] = []
    for key in keys:
        boxes = mine[key] = {}
        for p in found[key][1]:
            first = boxes.setdefault((p.offsets, p.sizes), p)
            if first is not p:
                copies.append((first.tensor.detach(), p.tensor.detach()))
    for members, shared in groups.items():
        shared.sort(key=lambda c: (_place(c[2].stored), c[0], c[2].offsets))
        readers = _readers(
            members,
            [c[3].numel * _itemsize(view, c[1]) for c in shared],
            [_place(c[2].stored)[0] for c in shared],
        )
        for reader, (order, key, chunk, region, users) in zip(readers, shared, strict=True):
            rnd = rounds[rounds_of[key]]
            at = (order, tuple(chunk.offsets))
            if reader != rank:
                for r, block, common in users:
                    if r == rank:
                        place = (*at, tuple(block.offsets))
                        rnd.incoming[reader].append((place, _view_of(mine[key], block, common)))
                continue
            parts: list[tuple[int, Block, torch.Tensor | None, Order]] = []
            into = None
            for r, block, common in users:
                own = _view_of(mine[key], block, common) if r == rank else None
                if own is not None and common == region and own.device.type == "cpu":
                    into = own  # read straight into it (a device target: into host memory)
                parts.append((r, common, own, (*at, tuple(block.offsets))))
            rnd.fetches.append(
                Fetch(
                    key,
                    view.storage(key, chunk.stored),
                    tuple(chunk.sizes),
                    view.tensor(key)[1],  # type: ignore[index]
                    region,
                    tuple(chunk.offsets),
                    into,
                    parts,
                )
            )
    return Exchange(rounds, solo, frozenset(keys), copies)


def _itemsize(view: StoredView, key: str) -> int:
    return view.tensor(key)[1].itemsize  # type: ignore[index]


def _rounds(keys: list[str], view: StoredView, count: int) -> dict[str, int]:
    """Each key's round: keys in order cut into `count` runs of about equal global bytes
    (the same on every rank: global shapes only)."""
    sizes = [
        max(1, torch.Size(view.tensor(k)[0]).numel()) * _itemsize(view, k)  # type: ignore[index]
        for k in keys
    ]
    total = sum(sizes)
    out, at = {}, 0
    for key, n in zip(keys, sizes):
        out[key] = min(count - 1, (2 * at + n) * count // (2 * total))
        at += n
    return out


def _place(stored: Any) -> tuple[str, int]:
    """Where a stored chunk's record is (file, offset): the same on every rank."""
    entry = stored.entry if isinstance(stored, Unsettled) else stored
    if isinstance(entry, ChunkEntry):
        return entry.file, entry.record[0]
    return str(getattr(stored, "relative_path", "")), int(getattr(stored, "offset", 0))


def _readers(members: tuple[int, ...], sizes: list[int], files: list[str]) -> list[int]:
    """The reader of each of a group's chunks (in storage order, `files` naming each
    one's), so that each member reads about its share (the group's bytes ÷ k) and a
    file is one request on an object store (one reader: its chunks and their
    checksums in one ranged GET). Whole files go largest first to the least loaded
    member while it stays within `SLACK_NUM / SLACK_DEN` of its share; the chunks of
    the files left then fill the members below their share in turn, in storage
    order (so each member's are runs of a file). No member takes more than that
    many shares, or its share and a chunk. The members are turned by a hash of the
    group, so a rank first in many small groups is not every group's first reader.
    Integers only, ties broken by position: the same on every rank; O(F log k) for
    F files and k members."""
    k = len(members)
    total = sum(sizes)
    turn = zlib.crc32(repr(members).encode()) % k
    load = [0] * k  # by position p: member (p + turn) % k
    out = [-1] * len(sizes)
    runs: list[tuple[int, int]] = []  # each file's chunks: [start, end) in storage order
    for i in range(len(sizes)):
        if i and files[i] == files[i - 1]:
            runs[-1] = (runs[-1][0], i + 1)
        else:
            runs.append((i, i + 1))
    least = [(0, p) for p in range(k)]  # (load, position): a heap
    rest: list[int] = []  # chunks of files not given whole
    for lo, hi in sorted(runs, key=lambda r: (-sum(sizes[r[0] : r[1]]), r[0])):
        n = sum(sizes[lo:hi])
        p = least[0][1]
        if (load[p] + n) * k * SLACK_DEN <= total * SLACK_NUM:
            out[lo:hi] = [p] * (hi - lo)
            load[p] += n
            heapq.heapreplace(least, (load[p], p))
        else:
            rest += range(lo, hi)
    p = 0  # the position being filled
    for i in sorted(rest):
        while p < k - 1 and load[p] * k >= total:  # at its share: the next
            p += 1
        q = p if load[p] * k < total else min(range(k), key=lambda x: (load[x], x))
        out[i] = q
        load[q] += sizes[i]
    return [members[(q + turn) % k] for q in out]


def _bounds(boxes: list[Block]) -> Block:
    lo = [min(b.offsets[d] for b in boxes) for d in range(boxes[0].ndim)]
    hi = [max(b.offsets[d] + b.sizes[d] for b in boxes) for d in range(boxes[0].ndim)]
    return Block(lo, [h - o for h, o in zip(hi, lo)])


def _view_of(pieces: dict[Any, Piece], block: Block, common: Block) -> torch.Tensor:
    piece = pieces[(block.offsets, block.sizes)]
    return piece.tensor.detach()[common.relative_to(block).slices()]


# -- running it ------------------------------------------------------------------------


def run(
    comm: Communicator, executor: ReadExecutor, plan: Exchange
) -> tuple[BaseException | None, int]:
    """Every round: this rank's receives posted, then its fetches read (verified) and
    sent, its own parts copied into its targets (`Communicator.send_recv`: straight
    from and into the targets where they are contiguous, parts arriving while this
    rank reads). Every rank takes part in every round whatever its reads found (a
    failed read sends what its buffer holds, and the verdict raises the problem
    everywhere). Returns the first problem and the bytes this rank sent."""
    problems: list[BaseException] = []
    sent = 0
    # the checksums of every round's reads are fetched in the first (one request per
    # file and run of them, not one per round)
    unsettled: list[PendingChunk] = [
        f.info for rnd in plan.rounds for f in rnd.fetches if isinstance(f.info, PendingChunk)
    ]
    devices: set[torch.device] = set()  # CUDA devices copied to
    for rnd in plan.rounds:
        landing: list[tuple[int, torch.Tensor]] = []
        later: list[tuple[torch.Tensor, torch.Tensor]] = []  # (scratch, target) to copy after
        for src in sorted(rnd.incoming):
            for _place, target in sorted(rnd.incoming[src], key=lambda m: m[0]):
                if not _staged(target):
                    landing.append((src, target))
                else:
                    scratch = _scratch(target.shape, target.dtype, target.is_cuda)
                    landing.append((src, scratch))
                    later.append((scratch, target))
        outgoing: list[tuple[int, torch.Tensor]] = []

        def sends(
            rnd: Round = rnd,
            outgoing: list[tuple[int, torch.Tensor]] = outgoing,
            settle: list[PendingChunk] = unsettled,
        ) -> Any:
            try:
                outgoing += _read_and_part(
                    comm.rank, executor, rnd.fetches, problems, settle, devices
                )
            except Exception as e:  # noqa: BLE001 - never a message short: the others wait
                problems.append(e)
                outgoing[:] = _stand_ins(comm.rank, rnd.fetches)
            return outgoing

        comm.send_recv(landing, sends)
        unsettled = []
        for scratch, target in later:
            target.copy_(scratch, non_blocking=target.is_cuda)
            if target.is_cuda:
                devices.add(target.device)
        sent += sum(t.numel() * t.element_size() for _r, t in outgoing)
    for filled, twin in plan.copies:
        twin.copy_(filled)
    _settle(devices)
    return (problems[0] if problems else None), sent


def _to_device(fetch: Fetch) -> bool:
    """Whether one of `fetch`'s parts is this rank's own on a CUDA device."""
    return any(own is not None and own.is_cuda for _r, _box, own, _order in fetch.parts)


def _stand_ins(rank: int, fetches: list[Fetch]) -> list[tuple[int, torch.Tensor]]:
    """Zeros in place of every part this rank sends, in order: what it sends when making
    its messages failed (the verdict then raises that on every rank)."""
    parts = [(r, place, common, f.dtype) for f in fetches for r, common, _own, place in f.parts]
    parts = [p for p in parts if p[0] != rank]
    parts.sort(key=lambda m: (m[0], m[1]))
    sizes = [c.numel * d.itemsize for _r, _p, c, d in parts]
    zeros = torch.zeros(max(sizes, default=0), dtype=torch.uint8)  # one buffer: memory is short
    return [
        (r, zeros[:n].view(dtype).view(common.sizes))
        for (r, _place, common, dtype), n in zip(parts, sizes)
    ]


def _read_and_part(
    rank: int,
    executor: ReadExecutor,
    fetches: list[Fetch],
    problems: list[BaseException],
    settle: list[PendingChunk],
    devices: set[torch.device],
) -> list[tuple[int, torch.Tensor]]:
    """`fetches` read, this rank's parts copied into its targets (a CUDA target's from
    pinned host memory, queued on its device's current stream: `devices` gains it),
    and the others' parts to send, by rank then `Order` (as each receiver expects them)."""
    buffers = [
        f.into if f.into is not None else _scratch(f.region.sizes, f.dtype, _to_device(f))
        for f in fetches
    ]
    reads = [
        ChunkRead(
            f.key,
            f.info,
            f.chunk_sizes,
            f.dtype,
            tuple(a - o for a, o in zip(f.region.offsets, f.chunk_offsets)),
            f.region.sizes,
            buf,
        )
        for f, buf in zip(fetches, buffers)
    ]
    try:
        executor.run(reads, settle)
    except Exception as e:  # noqa: BLE001 - raised on every rank by the verdict
        problems.append(e)
    outgoing: list[tuple[int, Order, torch.Tensor]] = []
    for f, buf in zip(fetches, buffers):
        for r, common, own, place in f.parts:
            part = buf[common.relative_to(f.region).slices()]
            if r != rank:
                outgoing.append((r, place, part.contiguous()))
            elif own is not None and f.into is None:
                own.copy_(part, non_blocking=own.is_cuda)
                if own.is_cuda:
                    devices.add(own.device)
    outgoing.sort(key=lambda m: (m[0], m[1]))
    return [(r, t) for r, _place, t in outgoing]


# -----------------------------------------------------------------------------
# The records, read once: on an object store every rank of a load would list the
# folder and GET `shardwise.json`, the tail of `.metadata` and its index sections
# (4 requests a rank: 4,096 at W = 1,024). Instead rank 0 lists and reads them,
# the index whole where it is at most `SHARED_INDEX` bytes (each rank of a load
# reads most of it: every key it holds), and broadcasts what it read, `SharedReads`
# (two `broadcast`s: its size, then its bytes); every rank then reads the records
# from those bytes, checking them as it would the store's, and the store for
# anything else. Per rank: the records' bytes R received (R ≈ the index, O(N)
# for N tensors), no request; rank 0: the requests of one rank's read, then R
# sent. Where rank 0 fails to read them it says so in the first broadcast and
# raises its problem at the load's first verdict, on every rank.
# -----------------------------------------------------------------------------

SHARED_INDEX = 64 << 20  # an index up to this many bytes is read whole by rank 0, sent to all

SHARED_BYTES = 128 << 20  # records past this many bytes are read by every rank itself

_FAILED, _SHARED, _EACH = 0, 1, 2  # what rank 0's first broadcast says


def shares_records(folder: Folder, broadcast: bool | None, world: int) -> bool:
    """Whether one rank reads the records for all: on an object store (every read a
    request), with other ranks, unless `read_once=False`. The same on every rank: the
    folder's identity and `read_once` are agreed at the call's edge (`api.load`)."""
    return broadcast is not False and world > 1 and isinstance(folder, FsspecFolder)


def records(folder: Folder, comm: Communicator) -> StoredView | None:
    """The checkpoint's records, read by rank 0 and sent to every rank (above); None
    where rank 0 failed to read them (it raises that, whatever it is; the load's first
    verdict raises it on every rank). Records of more than `SHARED_BYTES` (a stock
    `.metadata` of a huge model) are read by every rank itself, as without this: their
    bytes held twice on every rank cost more than the requests. Collective over `comm`
    (one `broadcast`, two when shared); where `shares_records`."""
    assert isinstance(folder, FsspecFolder)
    header = torch.zeros(2, dtype=torch.int64)  # [what rank 0 says, the bytes that follow]
    if comm.rank != 0:
        comm.broadcast(header, 0)
        said, size = header.tolist()
        if said == _FAILED:
            return None
        if said == _SHARED:
            data = torch.empty(size, dtype=torch.uint8)
            comm.broadcast(data, 0)
            reads = SharedReads.decode(data.numpy().data)
            del data
            folder.know(reads)
        return StoredView.read(folder, comm.rank)
    folder.record()
    try:
        view = StoredView.read(folder, comm.rank)
        index = view.manifest.index if view.manifest is not None else None
        size = None if index is None or view.listing is None else view.listing.get(index.file)
        recorded = folder.recording.nbytes if folder.recording is not None else 0
        if size is not None and size <= min(SHARED_INDEX, SHARED_BYTES - recorded):
            assert index is not None
            folder.open(index.file).pread(size, 0)  # recorded, for every rank's sections
        reads = folder.recorded()
        payload = reads.encode() if reads.nbytes <= SHARED_BYTES else bytearray()
    except BaseException:
        folder.recorded()  # recording stops
        comm.broadcast(header, 0)  # _FAILED: the others wait for the verdict
        raise
    header[:] = torch.tensor([_SHARED if payload else _EACH, len(payload)])
    comm.broadcast(header, 0)
    if payload:
        comm.broadcast(torch.frombuffer(payload, dtype=torch.uint8), 0)
        folder.know(reads)  # its own later reads of them too (the index sections)
    return view


@contextlib.contextmanager
def records_shared(folder: Folder) -> Iterator[None]:
    """Within: what `records` sent may serve reads of `folder`; after, only the store
    (a folder object outlives its load: a later load must list and read afresh)."""
    try:
        yield
    finally:
        if isinstance(folder, FsspecFolder):
            folder.know(None)


# -----------------------------------------------------------------------------
# Read once under stock `dcp.load` with `Reader`: there DCP's planner decides what each
# rank reads (its `ReadItem`s) and no global layout is at hand; but DCP's coordinator
# sees every rank's plan (`StorageReader.prepare_global_plan`) before it scatters them,
# so the route is worked out there and travels in each rank's plan (`storage_data`):
# no exchange beyond DCP's own.
#
# Each rank's `Reader` says in its local plan what the coordinator must check (`Ask`:
# DCP's rank for it, its rank in and the size of the group the Reader sends over,
# whether it verifies, whether reading once pays by the rule above). Where every plan
# agrees, the coordinator groups the tensor items by stored chunk; a chunk that k > 1
# ranks read from gets one reader (`_readers`, among the ranks needing exactly the same
# chunks, in storage order: a file is then one request), which reads the bounds of all
# their boxes (a region of the chunk, verified as any read), keeps its own items and
# sends each other rank its items' boxes. Messages go in rounds, each rank's scratch
# and sends in a round within `BATCH` plus a chunk (`_route_rounds`); each sender ends
# its round's messages to a rank with a status byte, so nothing a failed read sent is
# committed. DCP's read step is local to each rank, so the ranks first agree through
# the process group's store that all of them reached it (`arrived`), else each reads
# its own items.
#
# Cost: the coordinator O(I log I) for the I items of all plans (DCP's central planning
# already gathers and walks them all: its design, not this one's); each rank O(its
# items and the boxes it sends), its route scattered with its plan. Bytes read from
# storage: each shared chunk's region once; sent by its reader: the others' boxes.
# -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Ask:
    """What a rank's `Reader` puts in its local plan for the coordinator to check."""

    rank: int  # DCP's rank for this plan (`set_up_storage_reader(rank=)`)
    group_rank: int  # this rank in the group the Reader sends over
    world: int  # that group's size
    verify: bool
    pays: bool  # reading once pays here (`may_pay`), or is forced
    checkpoint: str  # which checkpoint it reads: its save id, else its path


class Part(NamedTuple):
    """An item's box in a fetched region, and the rank it is for."""

    rank: int
    item: ReadItem
    box: Block  # in the stored chunk's coordinates


class Incoming(NamedTuple):
    """An item a rank receives: in which round, from which reader, of what stored dtype."""

    round: int
    src: int
    item: ReadItem
    dtype: torch.dtype


@dataclass
class ItemFetch:
    """A region of a stored chunk (in the chunk's coordinates) one rank reads, and each
    item's box in it: (rank, its item, the box), in send order."""

    index: MetadataIndex  # the stored chunk
    region: Block
    dtype: torch.dtype  # the stored dtype
    parts: list[Part]


@dataclass
class ItemRoute:
    """One rank's part of read once under `dcp.load`, each entry with its round: the
    regions it reads for others, and the items it receives, from whom (in each reader's
    send order) and of what stored dtype."""

    fetches: list[tuple[int, ItemFetch]] = field(default_factory=list)
    incoming: list[Incoming] = field(default_factory=list)
    token: str = ""  # this load's, the same on every rank (`arrived`)
    world: int = 0  # the ranks taking part

    def bytes_sent(self, rank: int) -> int:
        """The bytes `rank` sends on this route (the boxes of others it reads)."""
        return sum(
            b.numel * f.dtype.itemsize
            for _rnd, f in self.fetches
            for r, _it, b in f.parts
            if r != rank
        )

    def covered(self, rank: int) -> set[ReadItem]:
        """The items this route fills on `rank`: it reads the others alone."""
        out = {item for _rnd, _src, item, _dtype in self.incoming}
        out.update(it for _rnd, f in self.fetches for r, it, _b in f.parts if r == rank)
        return out


def routed_plans(
    plans: list[LoadPlan],
    place: Callable[[MetadataIndex], tuple[str, int]],
    dtype: Callable[[str], torch.dtype],
    batch: int | None = None,
) -> list[LoadPlan]:
    """Each plan with its `ItemRoute` as its `storage_data` where every plan's `Ask` agrees
    (more than one rank, each plan's DCP rank its group rank in a group of that many,
    one checkpoint and verify setting, reading once paying on each); else the plans with no
    `storage_data` of ours. `place(index)`: where a stored chunk's record is (file,
    offset); `dtype(fqn)`: a tensor's stored dtype."""
    asks = [p.storage_data for p in plans]
    ours = [isinstance(a, Ask) for a in asks]
    agreed = (
        len(plans) > 1
        and all(ours)
        and all(a.rank == i == a.group_rank and a.world == len(plans) for i, a in enumerate(asks))
        and all(a.pays for a in asks)
        and len({(a.verify, a.checkpoint) for a in asks}) == 1
    )
    if not agreed:
        return [dataclasses.replace(p, storage_data=None) if o else p for p, o in zip(plans, ours)]
    routes = item_routes([p.items for p in plans], place, dtype, batch)
    token = uuid.uuid4().hex
    for r in routes:
        r.token, r.world = token, len(plans)
    return [dataclasses.replace(p, storage_data=r) for p, r in zip(plans, routes)]


def item_routes(
    items: list[list[ReadItem]],
    place: Callable[[MetadataIndex], tuple[str, int]],
    dtype: Callable[[str], torch.dtype],
    batch: int | None = None,
) -> list[ItemRoute]:
    """Every rank's `ItemRoute` for the tensor items each rank's plan lists (above)."""
    limit = BATCH if batch is None else batch
    needs: dict[MetadataIndex, list[tuple[int, ReadItem]]] = defaultdict(list)
    for rank, mine in enumerate(items):
        for item in dict.fromkeys(mine):  # an item listed twice is filled once
            if item.type == LoadItemType.TENSOR:
                needs[item.storage_index].append((rank, item))
    shared: list[_Shared] = []
    for index, users in needs.items():
        members = tuple(sorted({r for r, _ in users}))
        if len(members) > 1:
            kind = dtype(index.fqn)
            region = _bounds([_box(it) for _r, it in users])
            shared.append(_Shared(place(index), index, members, users, region, kind))
    shared.sort(key=lambda c: (c.place, c.index.fqn, tuple(c.index.offset or ())))
    groups: dict[tuple[int, ...], list[_Shared]] = defaultdict(list)  # in storage order
    for c in shared:
        groups[c.members].append(c)
    for members, chunks in groups.items():
        sizes = [c.region.numel * c.dtype.itemsize for c in chunks]
        picked = _readers(members, sizes, [c.place[0] for c in chunks])
        for c, reader in zip(chunks, picked, strict=True):
            c.reader = reader
    routes = [ItemRoute() for _ in items]
    for c, rnd in zip(shared, _route_rounds(shared, limit)):
        fetch = ItemFetch(c.index, c.region, c.dtype, [])
        for r, item in sorted(c.users, key=lambda u: u[0]):  # stable: each rank's in order
            fetch.parts.append(Part(r, item, _box(item)))
            if r != c.reader:
                routes[r].incoming.append(Incoming(rnd, c.reader, item, c.dtype))
        routes[c.reader].fetches.append((rnd, fetch))
    return routes


@dataclass
class _Shared:
    """A stored chunk several ranks' items read from."""

    place: tuple[str, int]
    index: MetadataIndex
    members: tuple[int, ...]
    users: list[tuple[int, ReadItem]]
    region: Block  # the bounds of their boxes
    dtype: torch.dtype
    reader: int = -1


def _box(item: ReadItem) -> Block:
    """An item's box in its stored chunk's coordinates."""
    return Block(tuple(item.storage_offsets), tuple(item.lengths))


def _route_rounds(shared: list[_Shared], limit: int) -> list[int]:
    """Each shared chunk's round. A rank's rounds grow in storage order, a new one when
    its bytes in the current one (a reader's region, a receiver's boxes) would pass
    `limit`; a chunk's round is the latest its ranks are in, so they all meet there
    (and each rank's rounds only grow: no rank waits on a round another has passed).
    O(chunks × k)."""
    current: dict[int, int] = defaultdict(int)  # rank -> its round
    held: dict[int, int] = defaultdict(int)  # rank -> its bytes in that round
    out = []
    for c in shared:
        cost: dict[int, int] = defaultdict(int)
        cost[c.reader] += c.region.numel * c.dtype.itemsize
        for r, item in c.users:
            if r != c.reader:
                cost[r] += math.prod(item.lengths) * c.dtype.itemsize
        rnd = max(current[r] for r in cost)
        for r in cost:
            if current[r] < rnd:
                current[r], held[r] = rnd, 0
        if any(held[r] and held[r] + n > limit for r, n in cost.items()):
            rnd += 1
            for r in cost:
                current[r], held[r] = rnd, 0
        for r, n in cost.items():
            held[r] += n
        out.append(rnd)
    return out


ARRIVAL_S = 10.0  # how long ranks of a route wait for each other to reach it (`arrived`)


def arrived(store: Any, route: ItemRoute, timeout: float | None = None) -> bool:
    """Whether every rank of `route` reached it, agreed through `store` (the process
    group's key-value store): the exchange runs only then. DCP's read step is local to
    each rank: a rank failing before `Reader.read_data` (a subclass that raises first,
    a planner's `finish_plan`) goes straight to DCP's last gather, where the others
    would never meet it inside the exchange. Each rank counts itself in (`add`); the
    last one sets the route's state to "go", and a rank that waited `timeout` seconds
    (`ARRIVAL_S`) sets it to "late" instead, whichever is first (`compare_set`): so
    every rank sees the same state, and with "late" each reads its own items, as
    without a route (the failed rank's error then reaches every rank through DCP's
    gather, as stock). Once every rank has read the state, the last deletes the keys.
    Per rank: four store requests; the store: O(W)."""
    wait = ARRIVAL_S if timeout is None else timeout
    keys = [f"shardwise/read-once/{route.token}/{k}" for k in ("arrived", "state", "seen")]
    if store.add(keys[0], 1) == route.world:
        said = bytes(store.compare_set(keys[1], "", "go"))
    else:
        try:
            store.wait([keys[1]], timedelta(seconds=wait))
            said = bytes(store.get(keys[1]))
        except (RuntimeError, dist.DistError):  # timed out (DistStoreError): late, unless set
            said = bytes(store.compare_set(keys[1], "", "late"))
    if store.add(keys[2], 1) == route.world:  # every rank has read the state: gone
        for key in keys:
            store.delete_key(key)
    return said == b"go"


def run_item_route(
    comm: Communicator,
    executor: ReadExecutor,
    route: ItemRoute,
    chunk_read: Callable[[MetadataIndex, Block], ChunkRead],
    resolve: Callable[[ReadItem], torch.Tensor],
    commit: Callable[[ReadItem, torch.Tensor], None],
    wanted: set[ReadItem] | frozenset[ReadItem],
) -> BaseException | None:
    """`route`'s rounds in order: this rank's receives posted (straight into its targets
    where they take the stored bytes as they are, else into scratch), then its fetches
    read (verified) and their boxes sent or kept. `chunk_read(index, region)`: the
    `ChunkRead` of a region of a stored chunk (its target is set here); `resolve` and
    `commit`: DCP's planner's `resolve_tensor` / `commit_tensor`; `wanted`: the items of
    this rank's final plan (`finish_plan` may drop some: their bytes are received into
    scratch and dropped). Every message is sent whatever this rank found (zeros for what
    it could not make), each sender's boxes in a round followed by one status byte (1:
    all it read was read and verified), so no rank waits on another and none commits
    bytes a failed read sent; items are committed once their round's messages are all
    done (a reader's own target is sent from before it is committed), and none once a
    problem is found. Returns the first problem (the caller raises it: DCP's read step
    then fails on every rank)."""
    problems: list[BaseException] = []
    rank = comm.rank
    resolved: dict[ReadItem, torch.Tensor | None] = {}
    devices: set[torch.device] = set()  # CUDA devices copied to

    def target(item: ReadItem) -> torch.Tensor | None:
        if item not in wanted:
            return None
        if item not in resolved:
            resolved[item] = _resolved(resolve, item, problems)
        return resolved[item]

    for rnd in sorted({r for r, _ in route.fetches} | {m.round for m in route.incoming}):
        landing: list[tuple[int, torch.Tensor]] = []
        later: list[tuple[torch.Tensor, ReadItem, torch.dtype]] = []  # (scratch, item, dtype)
        done: list[tuple[ReadItem, torch.Tensor]] = []  # filled: committed after the round
        for _rnd, src, item, kind in (m for m in route.incoming if m.round == rnd):
            into = target(item)
            if into is not None and _takes(into, kind):
                landing.append((src, _flat_bytes(into)))
                done.append((item, into))
            else:
                nbytes = math.prod(item.lengths) * kind.itemsize
                scratch = _scratch(nbytes, torch.uint8, into is not None and into.is_cuda)
                landing.append((src, scratch))
                later.append((scratch, item, kind))
        senders = sorted({m.src for m in route.incoming if m.round == rnd})
        statuses = [(src, torch.zeros(1, dtype=torch.uint8)) for src in senders]
        landing += statuses  # after each sender's boxes: its last message of the round
        fetches = [f for r, f in route.fetches if r == rnd]

        def sends(
            fetches: list[ItemFetch] = fetches, done: list[Any] = done
        ) -> list[tuple[int, torch.Tensor]]:
            try:
                out = _fetch_and_part(
                    rank, executor, fetches, chunk_read, target, problems, done, devices
                )
            except Exception as e:  # noqa: BLE001 - never a message short: the others wait
                problems.append(e)
                out = _zeros_for(rank, fetches)
            ok = torch.tensor([0 if problems else 1], dtype=torch.uint8)
            return out + [(r, ok) for r in sorted({r for r, _t in out})]

        comm.send_recv(landing, sends)
        failed = [src for src, status in statuses if not status.item()]
        if failed:
            problems.append(
                CorruptCheckpointError(
                    f"rank(s) {failed} could not read stored bytes this rank loads "
                    "(their error is raised there)"
                )
            )
        for scratch, item, kind in later:
            into = target(item)
            if into is None or problems:
                continue
            try:
                into.copy_(scratch.view(kind).view(tuple(item.lengths)), non_blocking=into.is_cuda)
                if into.is_cuda:
                    devices.add(into.device)
                done.append((item, into))
            except Exception as e:  # noqa: BLE001 - raised once every round ran
                problems.append(e)
        _settle(devices)  # a planner's commit may read the target on another stream
        devices.clear()
        for item, into in done:
            if problems:
                break
            try:
                commit(item, into)
            except Exception as e:  # noqa: BLE001 - raised once every round ran
                problems.append(e)
    return problems[0] if problems else None


def _resolved(
    resolve: Callable[[ReadItem], torch.Tensor], item: ReadItem, problems: list[BaseException]
) -> torch.Tensor | None:
    """The planner's target for `item`, or None (its problem noted)."""
    try:
        into = resolve(item).detach()
    except Exception as e:  # noqa: BLE001 - raised once every round ran
        problems.append(e)
        return None
    if tuple(into.shape) != tuple(item.lengths):
        problems.append(
            LayoutError(
                f"'{item.dest_index.fqn}': the planner resolved a target of shape "
                f"{tuple(into.shape)} for a read of {tuple(item.lengths)}"
            )
        )
        return None
    return into


def _takes(target: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether `target` takes stored bytes of `dtype` straight into its memory."""
    return _plain_host(target, dtype) and target.is_contiguous()


def _flat_bytes(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's memory as flat bytes (a view)."""
    return t.reshape(-1).view(torch.uint8)


def _fetch_and_part(
    rank: int,
    executor: ReadExecutor,
    fetches: list[ItemFetch],
    chunk_read: Callable[[MetadataIndex, Block], ChunkRead],
    target: Callable[[ReadItem], torch.Tensor | None],
    problems: list[BaseException],
    done: list[tuple[ReadItem, torch.Tensor]],
    devices: set[torch.device],
) -> list[tuple[int, torch.Tensor]]:
    """`fetches` read (into this rank's target where the region is exactly its one item
    and the target takes the bytes as they are, else into scratch: pinned where one of
    its items goes on to a CUDA target, the copy queued on the device's current stream
    and `devices` gaining it), this rank's items filled (added to `done`, committed by
    the caller once the round's messages are done), the others' boxes to send, by rank
    in send order."""
    reads, buffers, owned = [], [], []
    for f in fetches:
        mine = [(it, b) for r, it, b in f.parts if r == rank]
        into = None
        if len(mine) == 1 and mine[0][1] == f.region:
            into = target(mine[0][0])
            into = into if into is not None and _takes(into, f.dtype) else None
        bound = [target(it) for it, _b in mine]
        to_device = any(t is not None and t.is_cuda for t in bound)
        buf = into if into is not None else _scratch(f.region.sizes, f.dtype, to_device)
        reads.append(dataclasses.replace(chunk_read(f.index, f.region), target=buf, done=None))
        buffers.append(buf)
        owned.append(into)
    try:
        executor.run(reads)
    except Exception as e:  # noqa: BLE001 - raised once every round ran
        problems.append(e)
    outgoing: list[tuple[int, torch.Tensor]] = []
    for f, buf, into in zip(fetches, buffers, owned):
        for r, item, box in f.parts:
            part = buf[box.relative_to(f.region).slices()]
            if r != rank:
                outgoing.append((r, _flat_bytes(part.contiguous())))
                continue
            mine_into = into if into is not None else target(item)
            if problems or mine_into is None:
                continue
            try:
                if into is None:
                    mine_into.copy_(part, non_blocking=mine_into.is_cuda)
                    if mine_into.is_cuda:
                        devices.add(mine_into.device)
                done.append((item, mine_into))
            except Exception as e:  # noqa: BLE001 - raised once every round ran
                problems.append(e)
    outgoing.sort(key=lambda m: m[0])  # stable: each rank's boxes in send order
    return outgoing


def _zeros_for(rank: int, fetches: list[ItemFetch]) -> list[tuple[int, torch.Tensor]]:
    """Zeros in place of every box this rank sends, in order: what it sends when making
    its messages failed (its problem then fails the load on every rank)."""
    sizes = [(r, b.numel * f.dtype.itemsize) for f in fetches for r, _it, b in f.parts if r != rank]
    sizes.sort(key=lambda m: m[0])
    zeros = torch.zeros(max((n for _r, n in sizes), default=0), dtype=torch.uint8)
    return [(r, zeros[:n]) for r, n in sizes]
