"""`load` and `read_tensor`: filling sharded state in place from any checkpoint, any layout."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ...comm.agreement import Agreement
from ...errors import InvalidArgumentError
from ...layout import Block
from ...storage import Folder
from ..clients.megatron_returned import load_targets
from ..engine.adapters import adapted_for_load
from ..engine.loading import load_state
from ..format.gc_pause import gc_paused
from ..format.manifest import Manifest
from ..io.host_slabs import staging_bytes as budget_of
from ..offline.opening import open_checkpoint
from .edge import _is_stateful, _user_state, agree_route, agreement, open_target


@dataclass(frozen=True)
class LoadInfo:
    """What `load` returns: where the checkpoint is (a `Path`, or the URL), how long
    the load took, the bytes this rank read from data files, and the manifest it
    followed (None for a stock DCP checkpoint, whose `.metadata` it followed)."""

    path: Path | str
    seconds: float
    bytes_read: int
    manifest: Manifest | None


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
    staging_bytes: int | None = None,
    broadcast_replicated: bool | None = None,
) -> LoadInfo:
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
    checkpoint), left as they are (`shardwise.checkpoint.megatron.read_common_state`).
    `path` may be an fsspec URL, `storage_options` its backend's options (as for `save`).
    A checkpoint is untrusted input: non-tensor values unpickle only as far as
    `torch.load(weights_only=True)` allows (plus `allow_object_globals`); anything
    else raises `UnsafeMetadataError` on every rank, before it runs.
    `trust_objects=True` unpickles them with plain `pickle` (only for checkpoints
    you trust). A stored tensor against a non-tensor target, or the reverse, is a
    `CheckpointMismatchError`, as with `dcp.load`. `extension_registry` (DCP's
    `ExtensionRegistry`, as `FileSystemReader`'s `_extension_registry`) decodes
    records written through custom stream extensions.
    CUDA targets are filled through at most `staging_bytes` of pinned host memory
    per rank (as `save`), reads overlapping the copies to the device on a side
    stream; when `load` returns, the copies are done.
    Values every rank loads whole (plain tensors, replicated DTensors and
    ShardedTensors, on the CPU) can be read by one rank each and broadcast to
    the others, so their bytes leave the storage once instead of once per rank:
    `broadcast_replicated=None` does so when reading from an object store or
    when the ranks span several hosts (a shared file system), `True` always,
    `False` never. It applies only when every rank loads the same such values.
    Returns a `LoadInfo` (its `bytes_read` says what this rank read).

    Collective: three fixed-size `all_reduce` per rank, whatever the number of
    tensors or the kind of checkpoint (shardwise, stock DCP, per-rank records): the
    edge's one exchange (`agree_route`: the folder opens everywhere, the Megatron
    route, the adapted values), then `loading`'s targets-fit check and read verdict;
    four when the state holds a `Stateful` (one more after its `load_state_dict()`);
    and when replicated values are broadcast, one `broadcast` per batch of them.
    """
    started = time.perf_counter()
    folder, problem = open_target(path, storage_options)
    try:
        budget = budget_of(staging_bytes)
    except InvalidArgumentError as e:  # raised on every rank by `agree_route`
        budget, problem = 0, problem or e
    # Stateful values as their state dicts first (as dcp.load does), so that what they
    # hold is adapted too; filled back through load_state_dict after.
    statefuls = {k: v for k, v in state_dict.items() if _is_stateful(v)}
    plain, user_problem = _user_state(state_dict) if statefuls else (state_dict, None)
    where = folder.identity if folder is not None else repr(path)
    call = agreement(
        process_group,
        (
            "load path, strict, cast_dtype, trust_objects and broadcast_replicated",
            (where, strict, cast_dtype, trust_objects, broadcast_replicated),
        ),
    )
    # the one exchange at the edge: raises either problem everywhere, one route for all
    by_key = agree_route(plain, megatron, call, problem or user_problem, tuple(sorted(statefuls)))
    assert folder is not None  # else `agree_route` raised its problem on every rank
    problem = None

    def read(targets: dict[str, Any]) -> tuple[int, Manifest | None]:
        return _load_adapted(
            targets,
            folder,
            call,
            strict,
            verify,
            cast_dtype,
            trust_objects,
            (extension_registry, budget, broadcast_replicated),
        )

    if by_key:
        # by Megatron key, as sharded_state_dict() nests it; megatron=True: rest left as is
        targets, finishers = load_targets(plain, process_group, megatron)
        done = read(targets)
        for finish in finishers:
            finish()
    else:
        # other libraries' values as ShardedTensors (agreed on by `agree_route`)
        with adapted_for_load(plain, process_group, agreed=True) as adapted:
            done = read(plain)
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
        call.defer(problem)
        call.verdict()
    return LoadInfo(folder.checkpoint_id, time.perf_counter() - started, *done)


def _load_adapted(
    state_dict: dict[str, Any],
    path: Folder,
    call: Agreement,
    strict: bool,
    verify: bool,
    cast_dtype: bool,
    trust_objects: bool,
    reading: tuple[Any, int, bool | None],
) -> tuple[int, Manifest | None]:
    """The engine's load; `reading`: (extension registry, staging budget, broadcast)."""
    extension_registry, budget, broadcast = reading
    with gc_paused():
        return load_state(
            state_dict,
            path,
            call,
            strict=strict,
            verify=verify,
            cast_dtype=cast_dtype,
            trust_objects=trust_objects,
            extension_registry=extension_registry,
            staging_bytes=budget,
            broadcast=broadcast,
        )


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
