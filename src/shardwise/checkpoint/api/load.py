"""`load` and `read_tensor`: filling sharded state in place from any checkpoint, any layout."""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultLoadPlanner
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from ...errors import (
    CheckpointMismatchError,
    ShardwiseError,
)
from ...layout import Block
from ...storage import Folder
from ..clients.megatron_returned import load_targets, megatron_route
from ..dcp.reader import Reader
from ..engine.adapters import adapted_for_load
from ..engine.loading import load_state
from ..format.gc_pause import gc_paused
from ..io.commit import per_rank_records
from ..offline.opening import open_checkpoint
from .edge import (
    _agree,
    _comm,
    _distributed,
    _folder,
    _is_stateful,
    _state_dicts_of,
    _unwrap,
    _user_state,
)


def _mismatches(state_dict: dict[str, Any], metadata: Any, strict: bool, cast: bool) -> list[str]:
    flat, _ = flatten_state_dict(_state_dicts_of(state_dict))
    stored = metadata.state_dict_metadata
    problems = []
    for key, value in flat.items():
        md = stored.get(key)
        if md is None:
            if strict:
                problems.append(f"'{key}' is missing from the checkpoint")
            continue
        if isinstance(md, TensorStorageMetadata) and not _fills_as_tensor(value):
            # dcp.load refuses this too (strict or not): the value would stay as it was
            problems.append(
                f"'{key}' is a Python {type(value).__name__} here but a tensor in the checkpoint"
            )
        if isinstance(value, torch.Tensor):
            if not isinstance(md, TensorStorageMetadata):
                problems.append(f"'{key}' is a tensor here but a Python object in the checkpoint")
                continue
            if tuple(value.shape) != tuple(md.size):
                problems.append(
                    f"'{key}' shape {tuple(value.shape)} here, {tuple(md.size)} in the checkpoint"
                )
            if value.dtype != md.properties.dtype and not cast:
                problems.append(
                    f"'{key}' dtype {value.dtype} here, {md.properties.dtype} in the checkpoint"
                )
    # Keys stored but not asked for are fine, as with `dcp.load`: loading only the
    # model from a model + optimizer checkpoint is a partial state dict, not an error.
    return problems


def _fills_as_tensor(value: Any) -> bool:
    """A target DCP fills from stored chunks: a tensor or a `_Checkpointable`."""
    return isinstance(value, torch.Tensor) or hasattr(type(value), "__create_chunk_list__")


def load(
    state_dict: dict[str, Any],
    path: str | Path | Folder,
    *,
    strict: bool = True,
    verify: bool = True,
    cast_dtype: bool = False,
    process_group: Any = None,
    megatron: bool = False,
    storage_options: dict[str, Any] | None = None,
    trust_objects: bool = False,
    extension_registry: Any = None,
) -> Reader:
    """Fill `state_dict`'s tensors and objects in place from `path`. Collective.

    Targets may use any layout and world size: each rank reads only the byte
    ranges its targets need. `strict=True` requires every key of `state_dict`
    in the checkpoint (stored keys not asked for are fine, as with `dcp.load`).
    Key, shape and dtype problems are all listed at
    once, on every rank, before any target is modified. `cast_dtype=True`
    casts stored values to each target's dtype instead (as `dcp.load` does,
    e.g. an fp32 checkpoint into a bf16 model). `Stateful` values are filled
    through their `state_dict()` / `load_state_dict()`, as with `dcp.load`.
    Megatron-Core's `sharded_state_dict()` loads as it nests it: its pieces are
    found anywhere and loaded by their Megatron key (ShardedObjects' `data` by
    their unique key), the way Megatron and `swc.save` store them; other values
    by their dotted path, or, with `megatron=True` (a Megatron-format
    checkpoint), left as they are (`shardwise.checkpoint.clients.megatron.read_common_state`).
    `path` may be an fsspec URL, `storage_options` its backend's options (as for `save`).
    A checkpoint is untrusted input: non-tensor values unpickle only as far as
    `torch.load(weights_only=True)` allows (plus `allow_object_globals`); anything
    else raises `UnsafeMetadataError` on every rank, before it runs.
    `trust_objects=True` unpickles them with plain `pickle` (only for checkpoints
    you trust). A stored tensor against a non-tensor target, or the reverse, is a
    `CheckpointMismatchError`, as with `dcp.load`. `extension_registry` (DCP's
    `ExtensionRegistry`, as `FileSystemReader`'s `_extension_registry`) decodes
    records written through custom stream extensions.
    Returns the reader (its `bytes_read` says what this rank read).

    Collective: five small `all_gather_object` per rank, whatever the number of
    tensors (the folder opens everywhere, the Megatron route, the adapted values,
    then `loading`'s targets-fit check and read verdict), six when the state holds
    a `Stateful` (one more after its `load_state_dict()`). A checkpoint without
    `shardwise.json` (stock DCP) leaves after the targets-fit check: one more
    agreement, then `dcp.load`'s own three (`gather_object` + `scatter_object_list`
    to plan, `all_gather_object` to read).
    """
    path = _folder(path, storage_options, process_group)
    # Stateful values as their state dicts first (as dcp.load does), so that what they
    # hold is adapted too; filled back through load_state_dict after.
    statefuls = {k: v for k, v in state_dict.items() if _is_stateful(v)}
    plain, problem = _user_state(state_dict) if statefuls else (state_dict, None)
    # the exchange raises `problem` everywhere and makes every rank take the same route

    def read(targets: dict[str, Any]) -> Reader:
        return _load_adapted(
            targets,
            path,
            strict,
            verify,
            cast_dtype,
            process_group,
            trust_objects,
            extension_registry,
        )

    if megatron_route(plain, megatron, process_group, problem, tuple(sorted(statefuls))):
        # by Megatron key, as sharded_state_dict() nests it; megatron=True: rest left as is
        targets, finishers = load_targets(plain, process_group, megatron)
        reader = read(targets)
        for finish in finishers:
            finish()
    else:
        # other libraries' values as ShardedTensors; every rank agrees on the Stateful keys
        with adapted_for_load(plain, process_group, None, tuple(sorted(statefuls))) as adapted:
            reader = read(plain)
            adapted.finish()
    # As dcp.load ends: Stateful values load their state, every other top-level value
    # is assigned back (`state_dict[key] = ...`, which a dict subclass may observe).
    for key in sorted(state_dict):  # sorted: load_state_dict may be collective
        if key in statefuls:
            try:  # every rank still calls the others: they may be collective
                statefuls[key].load_state_dict(plain[key])
            except Exception as e:  # noqa: BLE001 - the caller's own code: raised on every rank
                problem = problem or e
        elif key in plain:
            state_dict[key] = plain[key]
    if statefuls:  # every rank has the same Stateful keys (agreed above): all get here
        _agree(problem, process_group)
    return reader


def _load_adapted(
    state_dict: dict[str, Any],
    path: Folder,
    strict: bool,
    verify: bool,
    cast_dtype: bool,
    process_group: Any,
    trust_objects: bool = False,
    extension_registry: Any = None,
) -> Reader:
    reader = Reader(path, extension_registry, verify=verify, trust_objects=trust_objects)
    arguments = (
        "load path, strict, cast_dtype and trust_objects",
        (path.identity, strict, cast_dtype, trust_objects),
    )
    with gc_paused():
        read = load_state(
            state_dict,
            path,
            _comm(process_group),
            arguments,
            strict=strict,
            verify=verify,
            cast_dtype=cast_dtype,
            trust_objects=trust_objects,
        )
    if read is not None:
        reader.bytes_read, reader.manifest = read
        return reader
    return _load_through_dcp(reader, state_dict, path, strict, cast_dtype, process_group)


def _load_through_dcp(
    reader: Reader,
    state_dict: dict[str, Any],
    path: Folder,
    strict: bool,
    cast_dtype: bool,
    process_group: Any,
) -> Reader:
    """Stock checkpoints, per-rank records, transformed chunks: `dcp.load` with `Reader`."""
    problem: BaseException | None = None
    try:
        try:
            metadata = reader.read_metadata()
        except FileNotFoundError:
            if not per_rank_records(path):
                raise
            # saved with use_collectives=False: each rank reads its own records, as dcp.load does
            metadata = reader.read_metadata(
                rank=dist.get_rank(process_group) if _distributed(process_group) else 0
            )
        found = _mismatches(state_dict, metadata, strict, cast_dtype)
        if found:
            problem = CheckpointMismatchError(f"{path}: " + "; ".join(found))
    except (ShardwiseError, OSError, ValueError, pickle.UnpicklingError) as e:
        problem = e
    _agree(
        problem,
        process_group,
        (path.identity, strict, cast_dtype, reader.trust_objects),
        "load path, strict, cast_dtype and trust_objects",
    )
    try:
        dcp.load(
            state_dict,
            storage_reader=reader,
            planner=DefaultLoadPlanner(allow_partial_load=not strict),
            process_group=process_group,
        )
    except CheckpointException as e:
        raise _unwrap(e) from e
    return reader


def read_tensor(
    path: str | Path,
    fqn: str,
    region: Block | None = None,
    *,
    storage_options: dict[str, Any] | None = None,
    extension_registry: Any = None,
) -> torch.Tensor:
    """Read tensor `fqn` (or only `region` of it, in global coordinates) offline.

    One process, no process group; reads only the bytes of the region (ranged
    GETs when `path` is a URL). `extension_registry` as for `load`.
    """
    ckpt = open_checkpoint(
        path, storage_options=storage_options, extension_registry=extension_registry
    )
    return ckpt.read(fqn, region)
