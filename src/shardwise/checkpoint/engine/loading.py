"""The collective load engine behind `swc.load`, for every checkpoint it can read.

Two exchanges here per load, whatever the number of tensors, ranks or the kind
of checkpoint, each one fixed-size `all_reduce` (`Agreement.verdict`): one to
agree that the targets fit the checkpoint (every problem listed, on every rank,
before any target is touched), one after reading so that corruption found by one
rank is raised on all. `swc.load` makes one before them (`api.edge.agree_route`:
the folder opens on every rank, the Megatron route, the adapted values) and,
when the state holds a `Stateful`, one after its `load_state_dict()`: three per
rank, four with a `Stateful`. Pinned by tests/checkpoint/api/test_collective_counts.py.
Values every rank loads whole may instead be read by one rank each and broadcast
(`replicated`): the first verdict carries that decision, and each broadcast is
one more collective, made only then.

In between each rank plans and reads alone — there is nothing to coordinate. It
reads the checkpoint's records once (`StoredView`: `shardwise.json`, or DCP's
`.metadata` for stock checkpoints, stale manifests and per-rank records), matches
its targets' pieces against the stored chunks and hands the reads to the one
`ReadExecutor` (`io.read_executor`): whole chunks straight into the targets'
memory, parts of chunks by byte runs, transformed chunks whole through the
extension registry; a piece in many small chunks (a reshard: a column band of
every row chunk) as arrays (`GatherRead`, `format.row_boxes`). Values only DCP's
planner knows how to fill (a `_Checkpointable` that is no tensor, an unknown
tensor subclass) are planned by DCP's `DefaultLoadPlanner`, locally, into the
same executor (`item_reads`).
"""

from __future__ import annotations

import os
import pickle
from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.checkpoint import _version
from torch.distributed.checkpoint._extension import ExtensionRegistry
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.filesystem import _StorageInfo

from ...comm.agreement import Agreement
from ...errors import CheckpointMismatchError, ShardwiseError
from ...storage import Folder, open_folder
from ..format.manifest import Manifest
from ..format.objects import load_object
from ..format.row_batches import batch_boxes
from ..format.row_boxes import Boxes, dense
from ..io.part_gather import words_of
from ..io.read_executor import ReadExecutor
from ..io.read_requests import ChunkRead, GatherRead, RecordRead
from .inventory import Piece, pieces_of
from .item_reads import planned_reads
from .overlaps import fetched
from .replicated import Batch, Value, candidates, placed, schedule, send, wanted, words
from .stored_view import Covering, StoredBox, StoredView
from .whole_rows import WholeRows

__all__ = ["load_state", "mismatches"]


def load_state(
    state_dict: dict[str, Any],
    path: Folder | str | os.PathLike,
    agreement: Agreement,
    *,
    strict: bool,
    verify: bool,
    cast_dtype: bool,
    trust_objects: bool = False,
    extension_registry: ExtensionRegistry | None = None,
    staging_bytes: int | None = None,
    broadcast: bool | None = None,
) -> tuple[int, Manifest | None]:
    """Fill `state_dict` (values already adapted) from the checkpoint at `path`.
    Collective. Returns the bytes this rank read and the manifest it followed (None:
    it followed DCP's `.metadata`). Objects unpickle by `objects.load_object`'s rules
    (`trust_objects`); `extension_registry` decodes stream extensions. `broadcast`:
    whether values every rank loads whole are read once and broadcast (`replicated`;
    None: where that pays)."""
    folder = open_folder(path)
    flat, mappings = _flatten(state_dict)
    problem: BaseException | None = None
    view: StoredView | None = None
    shared: dict[str, torch.Tensor] = {}
    values: list[Value] = []
    try:
        view = StoredView.read(folder, agreement.rank)
        found = mismatches(flat, view, strict, cast_dtype)
        if found:
            problem = CheckpointMismatchError(f"{folder}: " + "; ".join(found))
        elif broadcast is not False and agreement.world_size > 1:
            shared = candidates(flat, view)
            values = placed(view, shared)
    except (ShardwiseError, OSError, ValueError, pickle.UnpicklingError) as e:
        problem = e
    agreement.defer(problem)
    agreed = agreement.agree(words(values, view, verify))  # the targets-fit verdict
    assert view is not None
    batches: list[Batch] = []
    sent: set[str] = set()  # values another rank reads and sends this one
    if wanted(agreed, values, broadcast, folder):
        batches = schedule(values, agreement.world_size)
        sent = {k for b in batches if b.reader != agreement.rank for k in b.keys}
    objects: dict[str, Any] = {}
    executor = ReadExecutor(
        folder, verify=verify, registry=extension_registry, staging_bytes=staging_bytes
    )
    problem = None
    try:
        reads, whole = _plan(flat, view, objects, trust_objects, sent, verify)
        # whole chunks a batch of requests at a time, the first with the rest: a small
        # load is one run (on an object store, one window of prefetches)
        wholes = whole.reads(view.manifest.page_size) if whole and view.manifest else iter(())
        executor.run([*reads, *next(wholes, [])])
        del reads
        for requests in wholes:
            executor.run(requests)
    except Exception as e:  # noqa: BLE001 - raised on every rank by the exchange below
        problem = e
    agreement.defer(problem)
    agreement.defer(send(agreement.comm, batches, shared))  # whatever it read
    agreement.verdict()
    for key, value in objects.items():
        set_element(state_dict, mappings.get(key, (key,)), value)
    return executor.bytes_read, view.manifest


def _flatten(state_dict: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """DCP's `flatten_state_dict`, but a state dict that is flat already (string keys, no
    mapping or list values: what DCP would copy as it is) is used as it is, its keys
    their own paths: no copy of 100,000 entries and their paths."""
    flat = all(type(k) is str and not isinstance(v, (Mapping, list)) for k, v in state_dict.items())
    if flat and _version._derived_version != "2_3":
        return state_dict, {}
    return flatten_state_dict(state_dict)


def _plan(
    flat: dict[str, Any],
    view: StoredView,
    objects: dict[str, Any],
    trust: bool,
    sent: set[str],
    verify: bool,
) -> tuple[list[ChunkRead | RecordRead | GatherRead], WholeRows | None]:
    """This rank's reads: objects (unpickled into `objects`), the stored chunks its
    pieces overlap (from a version 4 index: only its tensors' sections, only the rows
    it reads), and DCP's own plan for values only DCP knows how to fill. The values
    in `sent` are not read (another rank sends them) but their rows are checked with
    the rest, as if read: a row that claims another's bytes is refused on every rank
    that loads it, read or sent. A piece in small chunks of a version 4 index is
    planned as arrays (`GatherRead`): verifying, each chunk is read whole (it is one
    checksum tile); not verifying, each part's bytes from first to last, where a
    ranged read would read them so too. Pieces that are whole stored chunks are planned
    as arrays (`whole_rows`), and read after the rest, a batch of requests at a time."""
    reads: list[ChunkRead | RecordRead | GatherRead] = []
    by_dcp: dict[str, Any] = {}
    held: dict[str, list[Piece]] = {}
    stored_objects = []
    for key, value in flat.items():
        if not isinstance(value, torch.Tensor) and view.is_object(key):
            info = view.object_info(key)
            reads.append(RecordRead(key, info, _keep(objects, key, view, info, trust)))
            stored_objects.append(key)
            continue
        if view.tensor(key) is None:
            continue
        pieces = pieces_of(value) if isinstance(value, torch.Tensor) else None
        if pieces is None:  # a `_Checkpointable` or an unknown tensor subclass
            by_dcp[key] = value
            continue
        pieces = [p for p in pieces if p.tensor.numel()]
        if pieces:
            held[key] = pieces
    together: list[tuple[str, Covering, Piece, list[int]]] = []  # planned at once: `batch_boxes`
    sections = view.sections(list(held), stored_objects)
    whole = None
    if sections.fetch is not None and view.manifest is not None:  # a version 4 index
        whole = WholeRows(held, sent, view.manifest.version, sections.spans, sections.fetch)
        sections.take = whole.take
    for key, stored, overlaps in fetched(iter(sections), held, whole):
        if key in sent:
            for piece, rows in zip(held[key], overlaps):
                stored.covering(piece.offsets, piece.sizes, rows)  # checked, not read
            continue
        dtype = view.tensor(key)[1]  # type: ignore[index]  # a stored tensor
        for piece, rows in zip(held[key], overlaps):
            sectioned = stored.sectioned
            if piece.tensor.dtype != dtype:
                rows = None
            elif rows is not None and len(rows) > 1 and sectioned.table.array is not None:  # type: ignore[union-attr]
                together.append((key, stored, piece, rows))  # parts to gather
                continue
            reads += _reads(key, view, stored.covering(piece.offsets, piece.sizes, rows), piece)
    batch = batch_boxes([(s.sectioned, p.offsets, p.sizes, r) for _k, s, p, r in together])  # type: ignore[misc]
    for (key, stored, piece, _rows), boxes in zip(together, batch, strict=True):
        found = stored.parts(piece.offsets, piece.sizes) if boxes is None else boxes
        # not verifying, a part reads its bytes from first to last: when its runs would be
        # read together anyway (`row_boxes.dense`)
        if isinstance(found, Boxes) and (verify or dense(found, piece.tensor.element_size())):
            words = words_of(piece.tensor)
            if words is not None:
                reads.append(GatherRead(key, *words, piece.sizes, found))
                continue
        if isinstance(found, Boxes):  # box by box after all
            found = stored.covering(piece.offsets, piece.sizes)
        reads += _reads(key, view, found, piece)
    sections.check()  # every row's and object's byte range, before any read
    if by_dcp:
        reads += planned_reads(by_dcp, view.metadata(), view.folder, trust_objects=trust)
    return reads, whole


def _reads(
    key: str, view: StoredView, chunks: list[StoredBox], piece: Piece
) -> list[ChunkRead | RecordRead]:
    """`piece` read from the stored `chunks` that overlap it: one whole chunk straight
    into it, else the part of each chunk it takes."""
    dtype = view.tensor(key)[1]  # type: ignore[index]  # a stored tensor
    if len(chunks) == 1 and chunks[0][:2] == (piece.offsets, piece.sizes):
        chunk = chunks[0]
        zero = (0,) * len(piece.offsets)
        info = view.storage(key, chunk[2])
        return [_read(key, chunk, info, dtype, zero, chunk[1], piece.tensor)]
    target = piece.tensor
    reads: list[ChunkRead | RecordRead] = []
    for chunk in chunks:
        offsets, sizes, _info = chunk
        lo = [max(a, b) for a, b in zip(piece.offsets, offsets)]
        hi = [min(a + n, b + m) for a, n, b, m in zip(piece.offsets, piece.sizes, offsets, sizes)]
        if any(h <= lo_ for lo_, h in zip(lo, hi)):
            continue
        lengths = tuple(h - lo_ for lo_, h in zip(lo, hi))
        in_chunk = tuple(a - o for a, o in zip(lo, offsets))
        dest = target[tuple(slice(a - o, a - o + n) for a, o, n in zip(lo, piece.offsets, lengths))]
        info = view.storage(key, chunk[2])
        reads.append(_read(key, chunk, info, dtype, in_chunk, lengths, dest))
    return reads


def _read(
    key: str,
    chunk: StoredBox,
    info: _StorageInfo,
    dtype: torch.dtype,
    offsets: tuple[int, ...],
    lengths: tuple[int, ...],
    dest: torch.Tensor,
) -> ChunkRead:
    return ChunkRead(key, info, chunk[1], dtype, offsets, lengths, dest.detach())


def _keep(objects: dict[str, Any], key: str, view: StoredView, info: Any, trust: bool) -> Any:
    where = view.folder.where(info.relative_path)

    def keep(data: bytes) -> None:
        objects[key] = load_object(data, key, where, trust=trust)

    return keep


def mismatches(flat: dict[str, Any], view: StoredView, strict: bool, cast: bool) -> list[str]:
    """Every key, kind, shape and dtype problem of `flat`'s targets against the
    checkpoint. A tensor against an object (either way) is a problem even when not
    strict, as `dcp.load` refuses it: nothing would be loaded, silently. Keys stored
    but not asked for are fine, as with `dcp.load` (a partial state dict)."""
    problems = []
    for key, value in flat.items():
        stored = view.tensor(key)
        if stored is None:
            if view.is_object(key):
                if isinstance(value, torch.Tensor):
                    problems.append(
                        f"'{key}' is a tensor here but a Python object in the checkpoint"
                    )
            elif strict:
                problems.append(f"'{key}' is missing from the checkpoint")
            continue
        if not isinstance(value, torch.Tensor):
            if not hasattr(type(value), "__create_chunk_list__"):  # a DCP `_Checkpointable`
                problems.append(
                    f"'{key}' is a Python {type(value).__name__} here but a tensor in the "
                    "checkpoint"
                )
            continue
        here, (there, dtype) = tuple(value.shape), stored
        if here != there:
            problems.append(f"'{key}' shape {here} here, {there} in the checkpoint")
        if value.dtype != dtype and not cast:
            problems.append(f"'{key}' dtype {value.dtype} here, {dtype} in the checkpoint")
    return problems
