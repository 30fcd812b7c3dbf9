"""`reshard`: rewrite a checkpoint offline into the per-rank files of another layout.

A job of M ranks then reads one contiguous file per rank. Chunks are written
through `io.write`, its records built by `SaveRecords` and committed as a
save's are.
"""

from __future__ import annotations

import difflib
import math
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint.metadata import StorageMeta

from ...errors import (
    CheckpointExistsError,
    CheckpointMismatchError,
    InvalidArgumentError,
    LayoutError,
)
from ...layout import Block, Layout
from ...storage import open_folder
from ..engine import SaveRecords, first_hole, region
from ..format import TensorEntry, dtype_name
from ..io import DataFile, Lease, commit, data_file_name, in_the_way, index_file_name, new_token
from .opening import KEYS_SHOWN, OpenCheckpoint, open_checkpoint

__all__ = ["reshard"]


def reshard(
    path: str | os.PathLike,
    out: str | os.PathLike,
    world_size: int,
    *,
    dim: int = 0,
    layouts: Mapping[str, Layout] | None = None,
    overwrite: bool = False,
    storage_options: dict[str, Any] | None = None,
    wait: bool | float = False,
    progress: Callable[[int], None] | None = None,
) -> Path | str:
    """Rewrite a checkpoint into the per-rank files of another layout, offline.

    Each tensor is split as `layouts[key]` when given, else chunked along `dim`
    (or replicated when it has no such dimension: a bias or a scalar beside
    matrices chunked along `dim=1`) over `world_size` ranks;
    rank r's blocks all go to one file `__r_0.sw<token>.distcp`, so a job of
    `world_size` ranks reads one contiguous file per rank. Memory holds one
    block at a time. The result is a shardwise checkpoint (stock-readable).
    `path` and `out` may be fsspec URLs, `storage_options` their backend's options.
    It holds `out`'s save lease while it writes, as a save does (`CheckpointBusyError`
    while another save of `out` runs; `wait` as for `swc.save`). Every layout must
    cover its tensor, as a save requires (`LayoutError` otherwise, before the lease
    is taken): a hole would drop those elements from the new checkpoint. Also
    refused before the lease: a `world_size` that is no int of at least 1
    (`InvalidArgumentError`), and a key of `layouts` that is no tensor of the
    checkpoint (`CheckpointMismatchError` naming each, and a typo's likely target),
    and a `dim` that is negative or that no tensor chunked by `dim` has
    (`InvalidArgumentError` naming the tensor with the most dimensions): it would
    replicate every tensor, all of it in rank 0's file.
    `progress(n)` is called with the bytes of each block as it is written (they
    add up to the tensors' bytes), as `verify`'s is.
    """
    # all checked before the lease: a refusal leaves `out` (maybe `path` itself) untouched
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise InvalidArgumentError(
            f"world_size must be an int of at least 1, got {world_size!r}: a checkpoint for "
            "no ranks holds nothing, not even its objects"
        )
    ckpt = open_checkpoint(path, storage_options=storage_options)
    folder = open_folder(out, storage_options)
    _check_layout_keys(layouts or {}, ckpt.tensor_keys(), path)
    _check_dim(dim, ckpt, layouts or {}, path)
    plan = {}
    for key in ckpt.tensor_keys():
        shape = tuple(ckpt.tensor_metadata(key).size)
        layout = (layouts or {}).get(key)
        if layout is None:
            layout = (
                Layout.chunked(shape, dim, world_size)
                if len(shape) > dim
                else Layout.replicated(shape, world_size)
            )
        if layout.global_shape != shape or layout.world_size != world_size:
            raise LayoutError(
                f"layout for '{key}' is {layout}, not {world_size} ranks over shape {shape}"
            )
        if not layout.is_fully_covered:
            raise LayoutError(_hole_message(key, layout))
        plan[key] = layout
    # one save of a path at a time (the lease makes the folder); the check for a
    # checkpoint in the way is made once it is held, as a save makes it
    with Lease(folder).acquire(wait) as lease:
        existing = in_the_way(folder)
        if existing and not overwrite:
            raise CheckpointExistsError(existing)
        token = new_token()
        records = SaveRecords(
            world_size, StorageMeta(checkpoint_id=folder.checkpoint_id, save_id=token), None
        )
        written: set[tuple[str, Block]] = set()
        names = [data_file_name(f"__{rank}_", 0, token) for rank in range(world_size)]
        for rank, name in enumerate(names):
            with DataFile(folder, name) as file:
                if rank == 0:  # objects are copied verbatim, never unpickled
                    for key in ckpt.object_keys():
                        records.objects[key] = file.write_object(
                            ckpt.object_bytes(key)
                        ).object_entry()
                for key, layout in plan.items():
                    md = ckpt.tensor_metadata(key)
                    entry = records.tensors.setdefault(
                        key, TensorEntry(dtype_name(md.properties.dtype), tuple(md.size))
                    )
                    for block in layout.blocks_of(rank):
                        if block.is_empty() or (key, block) in written:
                            continue  # replicas are stored once
                        written.add((key, block))
                        data = ckpt.read(key, block)
                        chunk = file.write_tensor(data)
                        entry.chunks.append(chunk.chunk_entry(block.offsets, block.sizes))
                        if progress:
                            progress(data.nbytes)
                file.finish()
        index_name = index_file_name(names, 0, token)
        metadata, manifest, index = records.records(index_name)
        folder.write_new(index_name, index)
        commit(folder, metadata, manifest, {*names, index_name}, lease=lease)
    return folder.checkpoint_id


def _check_layout_keys(
    layouts: Mapping[str, Layout], tensors: list[str], path: str | os.PathLike
) -> None:
    """`CheckpointMismatchError` naming every key of `layouts` that is no tensor of the
    checkpoint (a typo would leave the real key chunked by default, its layout unused)."""
    held = set(tensors)
    unknown = sorted(k for k in layouts if k not in held)
    if not unknown:
        return
    named = []
    for key in unknown:
        near = difflib.get_close_matches(str(key), tensors, n=1)
        named.append(f"{key!r}" + (f" (did you mean {near[0]!r}?)" if near else ""))
    shown = ", ".join(repr(k) for k in tensors[:KEYS_SHOWN])
    more = f", ... ({len(tensors)} in all)" if len(tensors) > KEYS_SHOWN else ""
    raise CheckpointMismatchError(
        f"layouts names {len(unknown)} key(s) that are no tensor of {path}: "
        f"{', '.join(named)}; its tensors are {shown or 'none'}{more}"
    )


def _check_dim(
    dim: int, ckpt: OpenCheckpoint, layouts: Mapping[str, Layout], path: str | os.PathLike
) -> None:
    """Refuse a `dim` to chunk along that is negative, or (other than the default 0)
    beyond the dimensions of every tensor it would chunk: each would be replicated,
    the whole checkpoint landing in rank 0's file, which is never what was asked."""
    if isinstance(dim, bool) or not isinstance(dim, int) or dim < 0:
        raise InvalidArgumentError(
            f"dim must be an int of at least 0 (a dimension to chunk along), got {dim!r}"
        )
    shapes = {
        k: tuple(ckpt.tensor_metadata(k).size) for k in ckpt.tensor_keys() if k not in layouts
    }
    if dim == 0 or not shapes or any(len(s) > dim for s in shapes.values()):
        return
    key, shape = max(shapes.items(), key=lambda item: len(item[1]))
    raise InvalidArgumentError(
        f"dim={dim} is no dimension of any tensor of {path}: the one with the most, "
        f"'{key}', has ndim {len(shape)} (shape {shape}); every tensor would be "
        f"replicated, all in rank 0's file. Chunk along a dim below {max(len(shape), 1)}, "
        "or give layouts"
    )


def _hole_message(key: str, layout: Layout) -> str:
    """The refusal of a layout with holes (`allow_holes=True`), worded as a save's,
    naming the first uncovered region. The layout has counted its coverage when it
    was built (`Layout.is_fully_covered`); `first_hole` only names the region."""
    shape = layout.global_shape
    solid = [(b.offsets, b.sizes) for b in layout.distinct_blocks if not b.is_empty()]
    covered = sum(math.prod(sizes) for _offsets, sizes in solid)
    return (
        f"'{key}': elements {region(first_hole(solid, shape))} are held by no rank (the "
        f"layout's blocks cover {covered} of its {math.prod(shape)} elements); every element "
        "must be saved: give the layout blocks that cover the tensor"
    )
