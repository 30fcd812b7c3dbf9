"""`Writer` and `Reader`: the engine under stock `dcp.save` / `dcp.load`, as a DCP
`StorageWriter` and `StorageReader`.

Both are thin translators over a `Folder`: the writer turns DCP's write items
into the one chunk writer's records and commits shardwise records beside
`.metadata`; the reader reads shardwise and stock checkpoints with ranged,
verified reads through the read executor.
"""

from __future__ import annotations

import dataclasses
import io
import os
import weakref
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.filesystem import (
    SerializationFormat,
    _split_by_size_and_type,
    _StorageInfo,
    _StoragePrefix,
    _StorageWriterTransforms,
    _write_item,
)
from torch.distributed.checkpoint.metadata import (
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlan,
    SavePlanner,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from ..comm.communicator import ProcessGroupCommunicator, default_store, object_group
from ..errors import InvalidArgumentError, ShardMismatchError, UsageError
from ..layout import Block
from ..storage import Folder, open_folder, served_url
from .engine import (
    Ask,
    ItemRoute,
    SaveRecords,
    arrived,
    holes_in_plans,
    item_reads,
    kind_disagreements,
    may_pay,
    read_records,
    routed_plans,
    run_item_route,
)
from .format import (
    Manifest,
    RecordNames,
    TensorEntry,
    check_metadata,
    check_name,
    dtype_name,
)
from .io import (
    ChunkRead,
    DataFile,
    Lease,
    PendingChunk,
    ReadExecutor,
    Written,
    commit,
    data_file_name,
    failpoint,
    in_the_way,
    new_token,
)

__all__ = ["FolderBacked", "ItemResult", "Reader", "Writer", "records_of", "write_file"]


# -----------------------------------------------------------------------------
# `Writer` and `Reader`: the engine under stock `dcp.save` / `dcp.load`, as a
# DCP `StorageWriter` / `StorageReader`.
# -----------------------------------------------------------------------------


# -----------------------------------------------------------------------------
# What `Writer` and `Reader` share on top of stock's file-system classes: a `Folder`.
#
# Stock `FileSystemWriter`/`FileSystemReader` keep `self.path` as a `Path`,
# which mangles a URL (`s3://b/k` becomes `s3:/b/k`); these keep the folder
# (local or fsspec) beside it, and `self.path` as stock's `Path` or the URL.
# -----------------------------------------------------------------------------


class FolderBacked:
    """Mixed in before stock's writer or reader class (which `super()` reaches)."""

    folder: Folder
    path: Any
    storage_options: dict[str, Any] | None

    def _use(self, folder: Folder) -> None:
        self.folder = folder
        self.path = folder.checkpoint_id

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        super().reset(None)  # type: ignore[misc]
        if checkpoint_id:
            self._use(open_folder(checkpoint_id, self.storage_options))

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        """Local paths and URLs an installed backend serves (stock's file-system classes
        refuse every URL; an unknown scheme is declined, so DCP tries its next class)."""
        return served_url(checkpoint_id) or super().validate_checkpoint_id(checkpoint_id)  # type: ignore[misc]


# -----------------------------------------------------------------------------
# `Writer`'s translation between DCP's write items and the one chunk writer.
#
# Each item is resolved by DCP's planner and stored by `io.write.DataFile`
# (a tensor as its `torch.save` record, an object as its bytes, or, with stream
# extensions, the record stock's own item writer encodes); its `WriteResult`
# carries stock's `_StorageInfo` and where it went. `records_of` turns DCP's
# global metadata and those results into the save's records (`SaveRecords`).
# -----------------------------------------------------------------------------


@dataclass
class ItemResult:
    """A stock `_StorageInfo` plus what the manifest needs; unwrapped in `finish`."""

    stock: _StorageInfo
    written: Written


def write_file(
    folder: Folder,
    name: str,
    items: list[WriteItem],
    planner: SavePlanner,
    serialization_id: str,
    transforms: _StorageWriterTransforms,
    sync: bool,
) -> list[WriteResult]:
    """`items` into the new file `name` (`DataFile`), then fsync when `sync`."""
    transformed = bool(transforms.extensions)
    results = []
    with DataFile(folder, name) as out:
        for item in items:
            data = planner.resolve_data(item)
            descriptors = None
            if transformed:
                written, descriptors = _write_transformed(out, item, data, transforms)
            elif item.type == WriteItemType.BYTE_IO:
                written = out.write_object(cast(io.BytesIO, data).getbuffer())
            else:
                written = out.write_tensor(cast(torch.Tensor, data), serialization_id)
            stock = _StorageInfo(name, written.offset, written.length, descriptors)
            results.append(WriteResult(item.index, written.length, ItemResult(stock, written)))
        out.finish(sync)
    return results


def _write_transformed(
    out: DataFile, item: WriteItem, data: Any, transforms: _StorageWriterTransforms
) -> tuple[Written, list[str] | None]:
    """One item encoded by stock's item writer through the stream transforms, then
    stored as one record: where it went and its transform descriptors."""
    if item.type != WriteItemType.BYTE_IO:
        data = cast(torch.Tensor, data).detach().cpu()
    encoded = io.BytesIO()
    stock = _write_item(transforms, encoded, data, item, out.name, SerializationFormat.TORCH_SAVE)
    descriptors = cast(_StorageInfo, stock.storage_data).transform_descriptors
    return out.write_archive(encoded.getbuffer()), list(descriptors) if descriptors else None


def records_of(
    metadata: Metadata,
    stored: dict[MetadataIndex, ItemResult],
    world_size: int,
    storage_meta: StorageMeta | None,
) -> SaveRecords:
    """The records of DCP's global `metadata`, each item where `write_file` put it."""
    records = SaveRecords(world_size, storage_meta or StorageMeta(), metadata.planner_data)
    for fqn, md in metadata.state_dict_metadata.items():
        if isinstance(md, TensorStorageMetadata):
            entry = records.tensors[fqn] = TensorEntry(
                dtype_name(md.properties.dtype),
                tuple(md.size),
                requires_grad=bool(md.properties.requires_grad),
            )
            for chunk in md.chunks:
                r = stored[MetadataIndex(fqn, chunk.offsets)]
                entry.chunks.append(
                    r.written.chunk_entry(
                        tuple(chunk.offsets), tuple(chunk.sizes), _descriptors(r.stock)
                    )
                )
        else:
            r = stored[MetadataIndex(fqn)]
            records.objects[fqn] = r.written.object_entry(_descriptors(r.stock))
    return records


def _descriptors(info: _StorageInfo) -> list[str] | None:
    return list(info.transform_descriptors) if info.transform_descriptors else None


# -----------------------------------------------------------------------------
# `Writer`: the DCP `StorageWriter` of shardwise checkpoints, kept apart from reading.
#
# Stock `FileSystemWriter` planning, constructor and `.metadata`, and data
# files in its format, so stock `dcp.load` reads the result. Every rank writes
# its items under fresh token-named files (`__0_0.sw<token>.distcp`) through
# `io.write`, then fsyncs them; the coordinator then commits (`commit.py`):
# `.metadata`, `shardwise.json`, the marker, each renamed into place, and
# collects the files of the checkpoint it replaced. Other files in the folder
# are never touched. The coordinator (every rank, without collectives) holds the
# path's lease (`lease.py`) from the global plan, before any data is written, to
# the end of the commit.
#
# Call order (DCP's): reset -> set_up_storage_writer -> prepare plans
# (collective) -> write_data on every rank -> finish on the coordinator.
# -----------------------------------------------------------------------------


class Writer(FolderBacked, FileSystemWriter):
    """A DCP `StorageWriter` producing a shardwise checkpoint in the folder `path`.

    A drop-in for `FileSystemWriter`, with its constructor: `overwrite=True`
    (the default, as stock) replaces a checkpoint already in the folder;
    `False` raises `UsageError("Checkpoint already exists ...")` (a
    `RuntimeError`, as stock's) when the folder holds one. Either way, files
    in the folder that no checkpoint wrote are left alone. `thread_count`
    writes that many files per rank in parallel; `single_file_per_rank=False`
    writes a file per item;
    `sync_files=False` skips fsync (then a crash may lose the new checkpoint,
    as with stock); `_extensions` (e.g. ZStandard) transform each item's
    stream as stock does, and such items are read back whole.
    `serialization_format` must be `TORCH_SAVE` (what stock's own reader reads).
    `path` may be an fsspec URL (as with stock `FsspecWriter`); `storage_options`
    go to its backend. Another save of the same path in flight (it holds the
    path's lease) fails this one with `CheckpointBusyError`, unless `wait` (True,
    or seconds) says to wait for it.
    """

    def __init__(
        self,
        path: str | os.PathLike | Folder,
        single_file_per_rank: bool = True,
        sync_files: bool = True,
        thread_count: int = 1,
        per_thread_copy_ahead: int = 10_000_000,
        cache_staged_state_dict: bool = False,
        overwrite: bool = True,
        _extensions: Sequence[Any] | None = None,
        serialization_format: SerializationFormat = SerializationFormat.TORCH_SAVE,
        *,
        storage_options: dict[str, Any] | None = None,
        wait: bool | float = False,
    ) -> None:
        if serialization_format != SerializationFormat.TORCH_SAVE:
            raise InvalidArgumentError(
                f"serialization_format={serialization_format} is not supported by "
                "shardwise.checkpoint.Writer: stock FileSystemReader reads only TORCH_SAVE "
                "records; for safetensors files use "
                "torch.distributed.checkpoint.HuggingFaceStorageWriter or "
                "shardwise.checkpoint.convert"
            )
        folder = open_folder(path, storage_options)
        super().__init__(
            folder.checkpoint_id,
            single_file_per_rank=single_file_per_rank,
            sync_files=sync_files,
            thread_count=thread_count,
            per_thread_copy_ahead=per_thread_copy_ahead,
            cache_staged_state_dict=cache_staged_state_dict,
            overwrite=overwrite,
            _extensions=_extensions,
            serialization_format=serialization_format,
        )
        self.storage_options = storage_options
        self._use(folder)
        self._token = new_token()
        self._index_name = ""  # set by `write_data`
        self.wait = wait
        # the lease this writer holds, released by `finish`, by the next save's set-up
        # (a save that failed on another rank never reaches `finish`) or when the
        # writer is freed
        self._lease: list[Lease] = []
        weakref.finalize(self, _release, self._lease)

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        _release(self._lease)  # an earlier save that failed before `finish`
        super().set_up_storage_writer(is_coordinator, *args, **kwargs)
        # A fresh token on every rank for every save, whatever DCP resets or caches:
        # data files never reuse a name, so no committed file is ever reopened.
        self._token = new_token()

    def _records(self) -> RecordNames:
        return RecordNames(
            self.rank if not self.use_collectives and self.rank is not None else None
        )

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        # Replicas that disagree: DCP's planner kept one item per (key, offsets) of them,
        # so only what each rank held before (`prepare_local_plan`) shows it.
        kinds = [p.storage_data.of if isinstance(p.storage_data, _Kinds) else {} for p in plans]
        plans = [
            dataclasses.replace(p, storage_data=None) if isinstance(p.storage_data, _Kinds) else p
            for p in plans
        ]
        # Holes would read back as memory no chunk filled: refused even in one process,
        # where stock DCP's own check (across ranks only) lets them through.
        # Per-rank records (use_collectives=False) each hold only their rank's part.
        problems = kind_disagreements(kinds) + holes_in_plans(plans) if self.use_collectives else []
        if problems:
            raise ShardMismatchError(f"cannot save to {self.folder}: " + "; ".join(problems))
        plans = super().prepare_global_plan(plans)
        self._take_lease()
        return plans

    def release_lease(self) -> None:
        """Give back the path's lease if this writer still holds it: `finish` does, but
        a save that failed on another rank never gets there (the next save's set-up,
        or freeing the writer, would release it too)."""
        _release(self._lease)

    def _take_lease(self) -> None:
        """The lease of this writer's record scope, before any rank writes data (DCP
        scatters the plan after this): a busy path fails every rank."""
        _release(self._lease)
        lease = Lease(self.folder, self._records().rank, save_id=self.save_id)
        lease.acquire(self.wait)
        self._lease.append(lease)
        existing = in_the_way(self.folder, self._records())  # committed while this one waited
        if not self.overwrite and existing:
            _release(self._lease)
            raise UsageError(f"Checkpoint already exists and self.overwrite=False: {existing}")

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        # The folder is created in write_data: a save refused in planning leaves no folder.
        existing = in_the_way(self.folder, self._records())
        if not self.overwrite and existing:
            raise UsageError(f"Checkpoint already exists and self.overwrite=False: {existing}")
        if self.rank is not None and not self.use_collectives:
            plan = dataclasses.replace(plan, storage_data=_StoragePrefix(f"__{self.rank}_"))
        elif self.use_collectives:
            plan = dataclasses.replace(plan, storage_data=_Kinds(_kinds_of(plan)))
        return plan

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        """Write this rank's items into fresh token-named files (one per bucket of
        `thread_count`, or one per item), in parallel threads when there are several."""
        failpoint("before-write")
        self.folder.make()
        token = self._token
        if self.single_file_per_rank:
            buckets = _split_by_size_and_type(max(1, self.thread_count), list(plan.items))
        else:
            buckets = [[item] for item in plan.items]
        jobs = [
            (data_file_name(plan.storage_data.prefix, k, token), items)
            for k, items in enumerate(buckets)
        ]
        # past this rank's data files: where its index goes if it is the one to commit
        self._index_name = data_file_name(plan.storage_data.prefix, len(jobs), token)
        serialization_id = self.save_id.replace("-", "")[:40].ljust(40, "0")  # torch.save's field

        def write(name: str, items: list[WriteItem]) -> list[WriteResult]:
            return write_file(
                self.folder,
                name,
                items,
                planner,
                serialization_id,
                self.transforms,
                self.sync_files,
            )

        if self.thread_count > 1 and len(jobs) > 1:
            with ThreadPoolExecutor(
                self.thread_count, thread_name_prefix="shardwise-write"
            ) as pool:
                parts = list(pool.map(lambda job: write(*job), jobs))
        else:
            parts = [write(name, items) for name, items in jobs]
        fut: Future[list[WriteResult]] = Future()
        fut.set_result([r for part in parts for r in part])
        return fut

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Build `.metadata` and the manifest (`SaveRecords`), then commit them
        (coordinator, or every rank on its own without collectives)."""
        stored: dict[MetadataIndex, ItemResult] = {}
        for rank_results in results:
            stored.update({r.index: r.storage_data for r in rank_results})
        records = records_of(metadata, stored, len(results), self.storage_meta())
        keep = {r.stock.relative_path for r in stored.values()}
        index_name = self._index_name
        metadata_bytes, manifest, index = records.records(index_name)
        try:
            self.folder.write_new(index_name, index, sync=self.sync_files)
            commit(
                self.folder,
                metadata_bytes,
                manifest,
                keep | {index_name},
                self._records(),
                sync=self.sync_files,
                lease=self._lease[0] if self._lease else None,
            )
        finally:
            _release(self._lease)


@dataclass(frozen=True)
class _Kinds:
    """A rank's local plan's values as (dtype name, global shape) by key ((None, None):
    an object), carried to the coordinator in the plan's `storage_data`, where
    `FileSystemWriter.prepare_global_plan` puts its file prefix. DCP's planner keeps one
    write item per (key, offsets) of those several ranks hold (`dedup_save_plans`),
    whatever their shapes or dtypes: replicas that disagree (the DP copies of a TP-sharded
    weight built otherwise on one DP row) would lose all but one copy unseen. DCP's
    coordinator gathers every rank's plan anyway; this adds one pair per key to it."""

    of: dict[str, tuple[str | None, tuple[int, ...] | None]]


def _kinds_of(plan: SavePlan) -> dict[str, tuple[str | None, tuple[int, ...] | None]]:
    kinds: dict[str, tuple[str | None, tuple[int, ...] | None]] = {}
    for item in plan.items:
        data = item.tensor_data
        if data is None:
            kinds[item.index.fqn] = (None, None)
        elif item.index.fqn not in kinds:
            kinds[item.index.fqn] = (dtype_name(data.properties.dtype), tuple(data.size))
    return kinds


def _release(held: list[Lease]) -> None:
    """Give back the lease a writer holds, if any."""
    while held:
        held.pop().release()


# -----------------------------------------------------------------------------
# `Reader`: the DCP `StorageReader` for shardwise and stock checkpoints, with ranged reads.
#
# It reads `shardwise.json` (never unpickling `.metadata`), or a stock
# `.metadata` through an unpickler that admits only DCP's classes. Every byte
# range it reads comes from the `Metadata` it was set up with
# (`set_up_storage_reader`): a reset reader keeps nothing of the previous
# checkpoint. It reads only the byte ranges of each stored chunk that the load
# targets need (`format.checksums`), widened to the checksum tiles (or, in older
# checkpoints, pages) that cover them, and verifies those.
#
# Call order (DCP's): reset -> read_metadata -> set_up_storage_reader ->
# prepare plans (collective) -> read_data on every rank. The records are found
# and checked by `engine.stored.read_records`, as for `swc.load`; `read_data` only
# translates DCP's `ReadItem`s into the one read executor's requests
# (`item_reads`): what is read, prefetched and verified is `io.read`'s.
# -----------------------------------------------------------------------------


class Reader(FolderBacked, FileSystemReader):
    """A DCP `StorageReader` for shardwise and stock checkpoints with ranged reads.

    A drop-in for `FileSystemReader` (same constructor, `_extension_registry`
    included). `bytes_read` counts every byte this reader read from data
    files. `verify=False` skips checksum verification (and the widening to
    whole tiles or pages it needs). Stored objects are vetted with PyTorch's
    `weights_only` unpickler before DCP's planner (which unpickles with
    `weights_only=False`) sees them: a refused global raises `UnsafeMetadataError`
    unless `trust_objects=True` (`shardwise.checkpoint.format.pickles`). Per-rank
    checkpoints (saved with `use_collectives=False`) are read through
    `read_metadata(rank=...)`, as stock. `path` may be an fsspec URL (as with
    stock `FsspecReader`); `storage_options` go to its backend.
    """

    def __init__(
        self,
        path: str | os.PathLike | Folder,
        _extension_registry: Any = None,
        *,
        verify: bool = True,
        storage_options: dict[str, Any] | None = None,
        trust_objects: bool = False,
        read_once: bool | str | None = "auto",
        process_group: Any = None,
    ) -> None:
        folder = open_folder(path, storage_options)
        super().__init__(folder.checkpoint_id, _extension_registry)
        self.storage_options = storage_options
        self._use(folder)
        self.verify = verify
        self.trust_objects = trust_objects
        if not (read_once in ("auto", None) or isinstance(read_once, bool)):
            raise InvalidArgumentError(f"read_once={read_once!r}: expected 'auto', True or False")
        self.read_once: bool | None = read_once if isinstance(read_once, bool) else None
        self.process_group = process_group
        self.bytes_read = 0
        self.bytes_sent = 0  # to other ranks, read once for them
        self.manifest: Manifest | None = None
        self._set_up_for: str | os.PathLike | None = None
        self._checked: Metadata | None = None  # the metadata whose records were checked
        self._rank: int | None = None  # DCP's rank for this reader, with collectives

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        super().reset(checkpoint_id)
        self.manifest = None
        self._set_up_for = None
        self._checked = None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        self.manifest, self.storage_data, self._set_up_for = None, {}, None
        # the checksums writers keep in data files are fetched by the rank that reads
        # each chunk, with its bytes (`PendingChunk`), not by every rank for every file
        self.manifest, metadata = read_records(
            self.folder, kwargs.get("rank"), whole=True, settled=False
        )
        if self.manifest is not None:
            metadata = self.manifest.to_metadata()
            storage = metadata.storage_data
            for (key, offsets), unsettled in self.manifest.unsettled.items():
                dtype = self.manifest.tensors[key].dtype
                storage[MetadataIndex(key, offsets)] = PendingChunk.planned(
                    unsettled, dtype, self.manifest.page_size
                )
        assert metadata is not None
        storage_meta = getattr(metadata, "storage_meta", None)  # absent from old pickles
        if storage_meta is None:
            storage_meta = metadata.storage_meta = StorageMeta()
        storage_meta.load_id = self.load_id
        self._checked = metadata
        return metadata

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        if metadata is not self._checked:  # not what read_metadata read and checked
            check_metadata(metadata, self.folder, f"metadata given for {self.folder}", holes=True)
            self._checked = metadata
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)
        self._set_up_for = self.path
        collective = kwargs.get("use_collectives", True)
        self._rank = kwargs.get("rank") if collective else None

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        """`plan`, with what the coordinator checks before it routes reads once
        (`engine.Ask`) where this rank can take part."""
        plan = super().prepare_local_plan(plan)
        ask = self._ask()
        return plan if ask is None or plan.storage_data is not None else _with(plan, ask)

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        """On the coordinator: each rank's plan with its part in reading each stored
        byte once (`engine.routed_plans`), where every rank can take part."""
        plans = super().prepare_global_plan(plans)
        metadata = self._checked
        if metadata is None:
            return plans
        return routed_plans(plans, self._place, self._stored_dtype)

    def _ask(self) -> Ask | None:
        if self.read_once is False or self._rank is None:
            return None
        if not (dist.is_available() and dist.is_initialized()) or default_store() is None:
            return None
        group_rank = dist.get_rank(self.process_group)
        if group_rank < 0:  # not a member of the group it would send over
            return None
        pays = may_pay(True if self.read_once else None, self.folder)
        world = dist.get_world_size(self.process_group)
        meta = getattr(self._checked, "storage_meta", None)
        save_id = getattr(meta, "save_id", None) or (
            self.manifest.storage_meta.get("save_id") if self.manifest is not None else None
        )
        which = f"save {save_id}" if save_id else f"path {self.path}"
        return Ask(self._rank, group_rank, world, self.verify, pays, which)

    def _place(self, index: MetadataIndex) -> tuple[str, int]:
        info = self.storage_data[index]
        return str(info.relative_path), int(info.offset)

    def _stored_dtype(self, fqn: str) -> torch.dtype:
        assert self._checked is not None
        md = self._checked.state_dict_metadata[fqn]
        assert isinstance(md, TensorStorageMetadata)
        return md.properties.dtype

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """DCP's plan, as the read executor's requests (`item_reads`), run at once; with
        a route (`engine.ItemRoute`), the items it covers read once for every
        rank needing them and the rest alone. A rank with a route takes part in all of
        it whatever it finds, so no rank waits on another; what it found is raised after."""
        route = plan.storage_data
        route = route if isinstance(route, ItemRoute) else None
        problem: BaseException | None = None
        executor = ReadExecutor(
            self.folder, verify=self.verify, registry=self.transforms.extension_registry
        )
        try:
            try:
                self._check_plan(plan)
            except Exception as e:  # noqa: BLE001 - raised once the route ran
                if route is None:
                    raise
                problem = e
            items = plan.items
            if route is not None and arrived(default_store(), route):
                found = self._run_route(route, plan, planner, executor, problem is not None)
                problem = problem or found
                covered = route.covered(dist.get_rank(self.process_group))
                items = [item for item in items if item not in covered]
            if problem is not None:
                raise problem
            assert self._checked is not None
            reads = item_reads(
                items,
                self._checked,
                self.storage_data,
                planner,
                self.folder,
                trust_objects=self.trust_objects,
            )
            executor.run(reads)
        finally:
            self.bytes_read += executor.bytes_read
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    def _check_plan(self, plan: LoadPlan) -> None:
        if self._set_up_for is None or self._set_up_for != self.path or self._checked is None:
            raise UsageError(  # a RuntimeError, as stock's would be
                f"Reader for {self.path}: read_data before set_up_storage_reader with this "
                "checkpoint's metadata (DCP calls reset -> read_metadata -> "
                "set_up_storage_reader first)"
            )
        for name, req in {
            self.storage_data[req.storage_index].relative_path: req for req in plan.items
        }.items():  # checked with the records; again here, where it is opened
            check_name(
                self.folder,
                req.storage_index.fqn,
                name,
                str(self.folder),
                shardwise=self.manifest is not None,
            )

    def _run_route(
        self,
        route: ItemRoute,
        plan: LoadPlan,
        planner: LoadPlanner,
        executor: ReadExecutor,
        failed: bool,
    ) -> BaseException | None:
        """This rank's part of the route; with `failed` (this rank cannot read), its
        messages still sent and received, nothing read or filled."""
        comm = ProcessGroupCommunicator(self.process_group)
        object_group(self.process_group)  # CPU messages on a device-only group: every rank

        def chunk_read(index: MetadataIndex, region: Block) -> ChunkRead:
            if failed or self._checked is None:
                raise UsageError(f"Reader for {self.path}: cannot read for other ranks")
            item = ReadItem(
                LoadItemType.TENSOR,
                index,
                torch.Size(region.offsets),
                index,
                torch.Size(region.offsets),
                torch.Size(region.sizes),
            )
            (read,) = item_reads(
                [item], self._checked, self.storage_data, planner, self.folder, trust_objects=False
            )
            assert isinstance(read, ChunkRead)
            return read

        def resolve(item: ReadItem) -> torch.Tensor:
            if failed:
                raise UsageError(f"Reader for {self.path}: cannot fill targets")
            return planner.resolve_tensor(item)

        found = run_item_route(
            comm, executor, route, chunk_read, resolve, planner.commit_tensor, set(plan.items)
        )
        self.bytes_sent += route.bytes_sent(comm.rank)
        return found


def _with(plan: LoadPlan, data: Any) -> LoadPlan:
    return dataclasses.replace(plan, storage_data=data)
