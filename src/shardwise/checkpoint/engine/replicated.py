"""Values every rank loads whole: read by one rank and broadcast to the others.

A replicated value (a plain tensor, a `Replicate` DTensor, a ShardedTensor every
rank holds whole) is loaded whole by every rank. Read by all of them, its bytes
leave the storage W times: on an object store W requests and W × its bytes,
on a file system shared by several hosts W × its bytes over that system's
network (pytorch/pytorch#193909). So when every rank of a load names the same
such values, each is read by one rank and broadcast to the others.

Deciding costs no exchange: each rank lists the values it would share (key,
byte size, where the checkpoint stores it: `placed`) and hashes that list with
the checkpoint's save id and whether it verifies, and hashes its host; the
load's first verdict carries both (`words`: one `all_reduce` it makes anyway). Equal hashes on every
rank mean every rank loads the same values whole; only then, and only where it
pays (`wanted`), is anything broadcast. Every rank then computes the same
schedule alone (`schedule`): the values in storage order cut into consecutive
runs of about S / W bytes, one per reader, so a reader's values lie side by
side in one or two files and its reads merge into a few ranges (an object
store: a few ranged GETs, not one per value); each reader's values go out in
batches of at most `BATCH` bytes (a larger value alone), one `broadcast` per
batch, straight from and into the targets when a batch is one value.

Per rank, for R shared values of S bytes: O(R log R) to schedule (the sections
of those R values read, as the rank would read them to load them itself); about
S / W bytes read from storage (plus at most one value: values stay whole),
S less its own share received, one broadcast per batch (at least one per
reader with work, at most min(R, W) + S / `BATCH` of them).

Only CPU targets of the stored dtype with plain contiguous bytes take part: a
device target reads its own bytes (its broadcast would belong on the device's
own backend). A rank that is sent a value still checks its stored rows with the
rows it reads (`loading._plan`), as if it read them: a crafted index cannot pass
one rank's checks by splitting its rows between readers.
"""

from __future__ import annotations

import itertools
import socket
from collections import defaultdict
from typing import Any, NamedTuple

import torch

from ...comm.agreement import digest
from ...comm.communicator import Communicator
from ...errors import InvalidArgumentError
from ...storage import Folder
from ..format.chunk_table import ChunkTable
from .inventory import pieces_of
from .stored_view import StoredView

__all__ = ["BATCH", "Batch", "Value", "candidates", "placed", "schedule", "send", "wanted", "words"]

BATCH = 64 << 20  # bytes a rank packs and receives per broadcast of several values
_PLAIN = (torch.Tensor, torch.nn.Parameter)


class Value(NamedTuple):
    """A value to share: its key, byte size, and where its bytes start in storage."""

    key: str
    nbytes: int
    file: str
    offset: int


class Batch(NamedTuple):
    """Values one reader sends in one broadcast, in this order."""

    reader: int
    keys: tuple[str, ...]
    nbytes: int


def candidates(flat: dict[str, Any], view: StoredView) -> dict[str, torch.Tensor]:
    """The targets this rank loads whole that a broadcast can fill: a shardwise
    checkpoint's tensor, one piece that is the whole of it, on the CPU, contiguous,
    of the stored dtype (a cast or a device target reads its own bytes)."""
    found: dict[str, torch.Tensor] = {}
    if view.manifest is None:
        return found
    for key, value in flat.items():
        stored = view.tensor(key) if isinstance(value, torch.Tensor) else None
        if stored is None:
            continue
        pieces = pieces_of(value)
        if pieces is None or len(pieces) != 1:
            continue
        tensor, offsets, sizes = pieces[0]
        if (
            type(tensor) in _PLAIN
            and sizes == stored[0]
            and not any(offsets)
            and tensor.dtype == stored[1]
            and tensor.device.type == "cpu"
            and tensor.layout == torch.strided  # not mkldnn or sparse: bytes to view
            and tensor.is_contiguous()
            and not (tensor.is_conj() or tensor.is_neg())  # lazy views: no plain bytes
            and tensor.numel() > 0
        ):
            found[key] = tensor
    return found


def placed(view: StoredView, shared: dict[str, torch.Tensor]) -> list[Value]:
    """The `shared` values with where the checkpoint stores them (their first chunk),
    in storage order. Their rows' byte ranges are checked where the load plans
    (`loading._plan`, on every rank, read or sent): here the places only order the
    values, so the sections are taken without that check's listing of the folder."""
    values = []
    keys = sorted(shared)
    for key, stored in itertools.islice(view.stored_chunks(keys, []), len(keys)):
        t = shared[key]
        where = _first(stored.sectioned.table, t) if stored.sectioned is not None else None
        if where is None:  # no index, or rows to refuse: as a load takes them
            infos = [
                view.storage(key, c[2]) for c in stored.covering((0,) * t.dim(), tuple(t.shape))
            ]
            where = min((i.relative_path, i.offset) for i in infos)
        values.append(Value(key, t.numel() * t.element_size(), *where))
    return sorted(values, key=lambda v: (v.file, v.offset, v.key))


def _first(table: ChunkTable, t: torch.Tensor) -> tuple[str, int] | None:
    """Where the first of `t`'s stored rows starts, read off its index rows: no
    checksum of theirs fetched (one read per value, 10,000 of them at 4 KiB each,
    cost more than reading the values), None when a row holds an impossible value."""
    rows = table.overlapping((0,) * t.dim(), tuple(t.shape))
    places = [table.place(i) for i in rows]
    return None if not places or None in places else min(places)  # type: ignore[type-var]


def words(values: list[Value], view: StoredView | None, verify: bool) -> list[int]:
    """What the load's first verdict carries for this: [hash, -hash] of the values
    to share and whether they are verified (the maximum of both is each other's
    negation only when every rank's is the same: a rank that verifies is never sent
    bytes another read unverified), then [host, -host] likewise (one host or several)."""
    save_id = view.manifest.storage_meta.get("save_id") if view and view.manifest else None
    mine, host = digest((save_id, verify, values)), digest(_host())
    return [mine, -mine, host, -host]


def _host() -> str:
    """This machine's kernel: its boot id, which containers on one host share (and
    with it the page cache that makes reading cheap there), else its host name."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:  # not Linux
        return socket.gethostname()


def wanted(agreed: list[int], values: list[Value], broadcast: bool | None, folder: Folder) -> bool:
    """Whether to broadcast, from the verdict's maxima of every rank's `words`: every
    rank shares the same values, and `broadcast` says so or, when None, the bytes
    come from an object store or the ranks span several hosts."""
    if not values or agreed[0] != -agreed[1] or broadcast is False:
        return False
    return broadcast is True or folder.wants_prefetch or agreed[2] != -agreed[3]


def schedule(values: list[Value], world: int, batch: int | None = None) -> list[Batch]:
    """Who reads which value and the broadcasts that send them, the same on every
    rank given the same `values` (in storage order): min(R, W) readers spread over
    the ranks, reader j taking the values whose middle byte falls in the j-th of
    equal slices of all S bytes (consecutive values, about S / readers bytes each);
    each reader's values in batches of at most `batch` bytes (`BATCH`), a larger
    value alone."""
    limit = BATCH if batch is None else batch
    total = sum(v.nbytes for v in values)
    readers = min(len(values), world)
    owned: dict[int, list[Value]] = defaultdict(list)
    at = 0
    for v in values:
        slot = min(readers - 1, (2 * at + v.nbytes) * readers // (2 * total))
        owned[slot * world // readers].append(v)
        at += v.nbytes
    batches: list[Batch] = []
    for reader in sorted(owned):
        keys: list[str] = []
        size = 0
        for v in owned[reader]:
            if keys and size + v.nbytes > limit:
                batches.append(Batch(reader, tuple(keys), size))
                keys, size = [], 0
            keys.append(v.key)
            size += v.nbytes
        batches.append(Batch(reader, tuple(keys), size))
    return batches


def send(
    comm: Communicator, batches: list[Batch], targets: dict[str, torch.Tensor]
) -> BaseException | None:
    """Run `batches`: each reader's targets (already read) into every other rank's;
    the first problem, for the load's verdict. Every rank calls every broadcast,
    whatever its reads found or its targets allow: a reader that failed sends what
    it holds, a target that cannot take bytes takes them in scratch, and the
    verdict raises the problem everywhere."""
    rank, problem = comm.rank, None
    for reader, keys, nbytes in batches:
        try:
            views = [_bytes(targets[key]) for key in keys]
        except RuntimeError as e:  # never a skipped broadcast: the others would wait
            problem = problem or InvalidArgumentError(f"cannot fill {keys}: {e}")
            comm.broadcast(torch.zeros(nbytes, dtype=torch.uint8), reader)
            continue
        if len(views) == 1:
            comm.broadcast(views[0], reader)
            continue
        flat = torch.empty(nbytes, dtype=torch.uint8)
        if rank == reader:
            torch.cat(views, out=flat)
        comm.broadcast(flat, reader)
        if rank != reader:
            at = 0
            for view in views:
                view.copy_(flat[at : at + view.numel()])
                at += view.numel()
    return problem


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's memory as flat bytes (a view: writes land in `t`)."""
    return t.detach().reshape(-1).view(torch.uint8)
