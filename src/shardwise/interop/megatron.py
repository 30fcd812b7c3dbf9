"""Megatron-Core's sharded state dicts <-> shardwise, and its checkpoints both ways.

Megatron-Core describes each rank's piece of a global tensor with a
`dist_checkpointing.ShardedTensor` (key, local data, global shape and offset,
`replica_id`, `prepend_axis_num`: leading axes of size 1 the data lacks) and
hands them to DCP wrapped as `CheckpointableShardedTensor` (one piece) or
`LocalShardsContainer` (several pieces of one key on one rank).

- `to_shardwise(value)`: any of those (or a list of pieces of one key) as one
  shardwise `ShardedTensor` over the same storage. Collective: the global
  layout needs every rank's pieces (`shardwise.comm.from_local_shards`, which
  raises the same error on every rank).
- `to_megatron(state_dict)`: shardwise ShardedTensors as Megatron
  ShardedTensors over the same storage (one per local block, replicas numbered
  by rank), ready for `dist_checkpointing.save/load`.
- Importing this module registers a value adapter, so `swc.save`/`swc.load`
  take Megatron's objects directly (the DCP key is the state dict's key:
  key such dicts by the Megatron key, as Megatron's own DCP state dict does).
- `save_for_megatron(...)` (= `swc.save(..., megatron=True)`) writes what
  Megatron's `dist_checkpointing.load` needs beside the DCP data: the common
  state object and `metadata.json`. `read_common_state(path)` reads that
  common state back, from either writer, without unpickling code.

Megatron itself is imported only inside these functions.
"""

from __future__ import annotations

import io
import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from ..checkpoint.adapters import ValueAdapter, register_value_adapter
from ..comm.build import _from_local_shards
from ..errors import LayoutError, ShardMismatchError
from ..layout import Block, Layout
from ..tensor import ShardedTensor

__all__ = [
    "COMMON_STATE_KEY",
    "METADATA_JSON",
    "read_common_state",
    "save_for_megatron",
    "to_megatron",
    "to_shardwise",
]

# Megatron's `ShardedObject("common_state", ..., (1,), (0,)).unique_key`: its non-tensor state.
COMMON_STATE_KEY = "common_state/shard_0_1"
METADATA_JSON = "metadata.json"
_BACKEND = {"sharded_backend": "torch_dist", "sharded_backend_version": 1}
_MAPPING = "megatron.core.dist_checkpointing.mapping"


def _mapping() -> Any:
    import megatron.core.dist_checkpointing.mapping as mapping

    return mapping


def _checkpointable() -> Any:
    import megatron.core.dist_checkpointing.strategies.checkpointable as checkpointable

    return checkpointable


def _is_mcore_piece(value: Any) -> bool:
    return type(value).__module__ == _MAPPING and type(value).__name__ == "ShardedTensor"


def _is_mcore_object(value: Any) -> bool:
    return type(value).__module__ == _MAPPING and type(value).__name__ == "ShardedObject"


def _is_wrapper(value: Any) -> bool:
    return type(value).__name__ in ("CheckpointableShardedTensor", "LocalShardsContainer") and type(
        value
    ).__module__.startswith("megatron.core.dist_checkpointing")


def _pieces(value: Any) -> list[Any]:
    """The Megatron ShardedTensors a value stands for (a list for a container)."""
    if _is_mcore_piece(value):
        return [value]
    if _is_wrapper(value):
        if type(value).__name__ == "LocalShardsContainer":
            return [shard._sh_ten for shard in value._local_shards]
        return [value._sh_ten]
    if isinstance(value, (list, tuple)) and all(_is_mcore_piece(v) for v in value):
        return list(value)
    raise TypeError(
        f"expected a Megatron ShardedTensor, a list of them, a CheckpointableShardedTensor or a "
        f"LocalShardsContainer, got {type(value).__name__}"
    )


def _is_main(replica_id: Any) -> bool:
    """Megatron's `is_main_replica`: 0, or a tuple of zeros."""
    return replica_id == 0 if isinstance(replica_id, int) else all(r == 0 for r in replica_id)


def _piece_problem(pieces: list[Any]) -> BaseException | None:
    """What makes this rank's pieces unusable (checked before the collective)."""
    if not pieces:
        return None
    first = pieces[0]
    for p in pieces:
        if p.flattened_range is not None:
            return ShardMismatchError(f"key '{p.key}': flattened_range pieces are not supported")
        if (p.key, tuple(p.global_shape), p.dtype) != (
            first.key,
            tuple(first.global_shape),
            first.dtype,
        ):
            return ShardMismatchError(
                f"pieces of one value disagree: '{p.key}' {tuple(p.global_shape)} {p.dtype} vs "
                f"'{first.key}' {tuple(first.global_shape)} {first.dtype}"
            )
        if p.data is not None and (
            tuple(p.data.shape) != tuple(p.local_shape) or p.data.dtype != p.dtype
        ):
            return ShardMismatchError(
                f"key '{p.key}' at offset {tuple(p.global_offset)}: data {tuple(p.data.shape)} {p.data.dtype} "
                f"does not match local_shape {tuple(p.local_shape)} / dtype {p.dtype}"
            )
    return None


def _block_data(piece: Any) -> torch.Tensor:
    """The piece's data as a block of the global tensor: prepended axes as a view."""
    data = piece.data.detach()
    if not data.is_contiguous():
        data = data.contiguous()  # a copy, only where the data is strided
    return data.view((1,) * piece.prepend_axis_num + tuple(piece.local_shape))


def to_shardwise(
    value: Any,
    *,
    replicas: bool = True,
    global_shape: Sequence[int] | None = None,
    group: Any = None,
) -> ShardedTensor:
    """One shardwise ShardedTensor from this rank's Megatron pieces of one key. Collective.

    `value`: a Megatron ShardedTensor, a list of them (several pieces of one
    key; `[]` on a rank holding nothing, which then must pass `global_shape`),
    a `CheckpointableShardedTensor` or a `LocalShardsContainer`. The shards
    share the pieces' storage (a strided piece is copied). `replicas=False`
    keeps only main replicas (`replica_id` 0, the data owners: what a save
    writes); with `True` every replica is a block of its own rank (what a load
    fills). Problems on any rank raise on every rank.
    """
    pieces = _pieces(value)
    problem = _piece_problem(pieces)
    if problem is None and any(p.data is None for p in pieces):
        problem = ShardMismatchError(f"key '{pieces[0].key}': a piece has no data (call init_data)")
    kept = [p for p in pieces if replicas or _is_main(p.replica_id)] if problem is None else []
    shape = (
        tuple(global_shape)
        if global_shape is not None
        else (tuple(pieces[0].global_shape) if pieces else None)
    )
    shards = [_block_data(p) for p in kept]
    offsets = [tuple(p.global_offset) for p in kept]
    return _from_local_shards(shards, offsets, shape, group, problem)


def _regular_grid(layout: Layout) -> tuple[int, ...] | None:
    """Megatron's `axis_fragmentations` when the distinct blocks form an even grid."""
    blocks = layout.distinct_blocks
    sizes = {b.sizes for b in blocks}
    if len(sizes) != 1:
        return None
    size = sizes.pop()
    if any(s == 0 or n % s for s, n in zip(size, layout.global_shape)):
        return None
    grid = tuple(n // s for s, n in zip(size, layout.global_shape))
    return grid if math.prod(grid) == len(blocks) else None


def _replica_id(layout: Layout, block: Block, rank: int) -> int:
    """0 for the lowest rank holding `block`, 1 for the next, ... (only 0 is saved)."""
    holders = sorted(layout.ranks_holding(block))
    return holders.index(rank) if rank in holders else 0


def _pieces_of(key: str, st: ShardedTensor, prepend_axis_num: int) -> list[Any]:
    mapping = _mapping()
    layout = st.layout_spec
    grid = _regular_grid(layout)
    out = []
    for block, shard in zip(st.local_blocks, st.local_shards()):
        lead = tuple(shard.shape[:prepend_axis_num])
        if any(s != 1 for s in lead):
            raise ShardMismatchError(
                f"key '{key}', rank {st.rank}: block {block} has leading sizes {lead}, not 1, so "
                f"prepend_axis_num={prepend_axis_num} cannot drop them"
            )
        data = shard.view(tuple(shard.shape[prepend_axis_num:]))
        out.append(
            mapping.ShardedTensor(
                key,
                data,
                data.dtype,
                tuple(data.shape),
                tuple(layout.global_shape),
                tuple(block.offsets),
                grid,
                _replica_id(layout, block, st.rank),
                prepend_axis_num,
            )
        )
    return out


def to_megatron(
    state_dict: Mapping[str, ShardedTensor], *, prepend_axis_num: Mapping[str, int] | int = 0
) -> dict[str, Any]:
    """Megatron ShardedTensors over the same storage: key -> piece, or list of pieces.

    No communication. Each local block becomes one piece (keyed by its dict
    key), `replica_id` numbering the ranks that hold the same block, and
    `axis_fragmentations` set when the layout is an even grid (else None: uneven).
    A rank holding no block of a key gets no entry for it (Megatron would take an
    empty list for common state). `prepend_axis_num` (per key or for all) drops
    that many leading size-1 axes from the local data, as Megatron's layer stacking does.
    """
    out: dict[str, Any] = {}
    for key, st in state_dict.items():
        if not isinstance(st, ShardedTensor):
            raise TypeError(f"'{key}' is a {type(st).__name__}, not a shardwise ShardedTensor")
        n = prepend_axis_num if isinstance(prepend_axis_num, int) else prepend_axis_num.get(key, 0)
        pieces = _pieces_of(key, st, n)
        if pieces:
            out[key] = pieces[0] if len(pieces) == 1 else pieces
    return out


# -- the value adapter used by swc.save / swc.load ---------------------------------------


def _matches(value: Any) -> bool:
    return _is_mcore_piece(value) or _is_wrapper(value)


def _for_save(value: Any) -> ShardedTensor:
    return to_shardwise(value, replicas=False)


def _for_load(
    value: Any, global_shape: Sequence[int] | None = None, group: Any = None
) -> tuple[ShardedTensor, Any]:
    """A target over the pieces' own data (allocated where Megatron left it None);
    a strided piece is loaded into a contiguous copy and copied back by `finish`.
    `global_shape` is needed on a rank holding no piece of the key."""
    pieces = _pieces(value)
    for p in pieces:
        if p.data is None and _piece_problem([p]) is None:
            p.init_data("cpu", init_fn=torch.zeros if p.allow_shape_mismatch else torch.empty)
    strided = [p for p in pieces if p.data is not None and not p.data.is_contiguous()]
    if global_shape is None and pieces:
        global_shape = pieces[0].global_shape
    target = to_shardwise(pieces, replicas=True, global_shape=global_shape, group=group)
    if not strided:
        return target, None
    copies = {id(p): shard for p, shard in zip(pieces, target.local_shards())}

    def finish() -> None:
        for p in strided:
            p.data.copy_(copies[id(p)].view(tuple(p.local_shape)))

    return target, finish


def _adapter_for_load(value: Any) -> tuple[ShardedTensor, Any]:
    """`_for_load` of one state-dict value; a layout with holes usually means the
    pieces of one Megatron key sit in several entries (Megatron's own nesting)."""
    try:
        return _for_load(value)
    except LayoutError as e:  # raised alike on every rank, so re-raised alike
        if "hole" not in str(e):
            raise
        key = _pieces(value)[0].key if _pieces(value) else "?"
        raise LayoutError(
            f"Megatron key '{key}': {e}. If its pieces sit in several state-dict entries (as in "
            f"Megatron's sharded_state_dict()), pass megatron=True to load by Megatron key"
        ) from e


register_value_adapter(
    ValueAdapter(
        "megatron-core",
        _matches,
        _for_save,
        _adapter_for_load,
        hint="for Megatron's own nesting (pieces of one key in several entries), pass megatron=True",
    )
)


# -- checkpoints Megatron's dist_checkpointing.load opens --------------------------------


class _RawBytes(io.BytesIO):
    """Bytes stored as they are (Megatron stores its objects pre-serialized)."""


def save_planner() -> Any:
    """DCP's default save planner, except that `_RawBytes` objects are written as
    they are (as Megatron's `MCoreSavePlanner` writes its objects), not re-pickled."""
    from torch.distributed.checkpoint import DefaultSavePlanner

    class _MegatronSavePlanner(DefaultSavePlanner):
        def transform_object(self, write_item: Any, object: Any) -> Any:
            if isinstance(object, _RawBytes):
                return object
            return super().transform_object(write_item, object)

    return _MegatronSavePlanner(dedup_save_to_lowest_rank=False)


_NONE = object()  # "no part here" in _split's pairs


def _split(value: Any) -> tuple[Any, Any]:
    """(sharded part, common part) of a nested state dict, as Megatron splits it:
    tensors that are sharded (shardwise or Megatron) vs everything else."""
    if isinstance(value, Mapping):
        parts = {k: _split(v) for k, v in value.items()}
        return (
            {k: s for k, (s, _) in parts.items() if s is not _NONE},
            {k: c for k, (_, c) in parts.items() if c is not _NONE},
        )
    if isinstance(value, ShardedTensor) or _matches(value) or _is_mcore_object(value):
        return value, _NONE
    if isinstance(value, list) and value and all(_is_mcore_piece(v) for v in value):
        return value, _NONE
    if _is_mapping_class(value, "LocalNonpersistentObject"):
        return _NONE, _NONE  # Megatron does not persist these either
    if _is_mapping_class(value, "ShardedTensorFactory") or _holds_sharded(value):
        raise TypeError(
            f"a {type(value).__name__} holding Megatron sharded values: shardwise takes Megatron "
            f"ShardedTensors in dicts (or lists of pieces of one key); apply Megatron's "
            f"factories first (dist_checkpointing.mapping.apply_factories) and key other lists by name"
        )
    return _NONE, value


def _is_mapping_class(value: Any, name: str) -> bool:
    return type(value).__module__ == _MAPPING and type(value).__name__ == name


def _holds_sharded(value: Any) -> bool:
    """A list or tuple with a sharded value somewhere inside (Megatron's own walk sees it)."""
    if not isinstance(value, (list, tuple)):
        return False
    return any(
        isinstance(v, ShardedTensor)
        or _matches(v)
        or _is_mcore_object(v)
        or _holds_sharded(v)
        or (isinstance(v, Mapping) and _split(v)[0])
        for v in value
    )


def _sharded_entries(sharded: Any, prefix: str = "") -> dict[str, Any]:
    """Flat DCP key -> value: shardwise tensors under their dotted path, Megatron
    pieces under their own key (grouped: pieces of one key make one entry)."""
    out: dict[str, Any] = {}
    for k, v in sharded.items():
        path = f"{prefix}{k}"
        if isinstance(v, Mapping):
            out.update(_sharded_entries(v, path + "."))
        elif isinstance(v, ShardedTensor):
            out[path] = v
        elif _is_mcore_object(v):
            if _is_main(v.replica_id):  # Megatron writes main replicas only
                out.setdefault(("object", v.unique_key), []).append(v.data)
        else:
            for piece in _pieces(v):
                out.setdefault(("mcore", piece.key), []).append(piece)
    return out


def prepare_save(state_dict: Mapping[str, Any], group: Any = None) -> dict[str, Any]:
    """The flat state dict `swc.save(..., megatron=True)` hands to DCP. Collective.

    Sharded tensors under their Megatron key (Megatron pieces grouped by key,
    every rank taking part for every key, main replicas only), Megatron
    ShardedObjects under their unique key, everything else in Megatron's
    common state object, each as `dist_checkpointing.save` writes it.
    """
    sharded, common = _split(state_dict)
    entries = _sharded_entries(sharded)
    mcore, shapes = _mcore_keys(entries, group)
    flat: dict[str, Any] = {k: v for k, v in entries.items() if not isinstance(k, tuple)}
    for key in sorted(shapes):  # the same order on every rank: one collective per key
        _refuse_clash(key, flat)
        flat[key] = to_shardwise(
            mcore.get(key, []), replicas=False, global_shape=shapes[key], group=group
        )
    for key, values in entries.items():  # ShardedObjects: this rank's, as Megatron stores them
        if isinstance(key, tuple) and key[0] == "object":
            flat[key[1]] = _serialized(values)
    if _rank(group) == 0:  # rank 0's, as Megatron keeps (its replica_id is the rank)
        flat[COMMON_STATE_KEY] = _serialized([common])
    return flat


def _mcore_keys(
    entries: dict[Any, Any], group: Any
) -> tuple[dict[str, list[Any]], dict[str, tuple[int, ...]]]:
    """This rank's Megatron pieces by key, and every rank's keys with their global
    shapes (one exchange), so a rank holding nothing of a key still takes part."""
    import torch.distributed as dist

    from ..comm.agreement import exchange

    mcore = {
        key[1]: pieces
        for key, pieces in entries.items()
        if isinstance(key, tuple) and key[0] == "mcore"
    }
    local = {k: tuple(p[0].global_shape) for k, p in mcore.items()}
    distributed = dist.is_available() and dist.is_initialized()
    everyone = exchange(None, local, group) if distributed else [local]
    shapes: dict[str, tuple[int, ...]] = {}
    for theirs in everyone:
        for k, shape in theirs.items():
            shapes.setdefault(k, shape)
    return mcore, shapes


def _rank(group: Any) -> int:
    import torch.distributed as dist

    return dist.get_rank(group) if dist.is_available() and dist.is_initialized() else 0


def _refuse_clash(key: str, flat: Mapping[str, Any]) -> None:
    if key in flat:
        raise ValueError(f"key '{key}' is both a shardwise tensor and a Megatron ShardedTensor key")


def prepare_load(
    state_dict: Mapping[str, Any], group: Any = None
) -> tuple[dict[str, Any], list[Any]]:
    """The flat targets `swc.load(..., megatron=True)` hands to DCP, and the
    finishers to run after it. Collective.

    Megatron pieces anywhere in `state_dict` (nested as Megatron's
    `sharded_state_dict()` nests them) are grouped by their Megatron key, one
    target per key over the pieces' own storage; shardwise ShardedTensors stay
    under their dotted path. Other values (Megatron's common state, its
    ShardedObjects) are not filled: `read_common_state(path)` reads the former.
    """
    sharded, _ = _split(state_dict)
    entries = _sharded_entries(sharded)
    mcore, shapes = _mcore_keys(entries, group)
    flat: dict[str, Any] = {k: v for k, v in entries.items() if not isinstance(k, tuple)}
    finishers = []
    for key in sorted(shapes):  # the same order on every rank: one collective per key
        _refuse_clash(key, flat)
        flat[key], finish = _for_load(mcore.get(key, []), shapes[key], group)
        if finish is not None:
            finishers.append(finish)
    return flat, finishers


def _serialized(values: list[Any]) -> _RawBytes:
    buffer = _RawBytes()
    torch.save(values, buffer)
    buffer.seek(0)
    return buffer


def metadata_json_problem(path: Path) -> BaseException | None:
    """A `metadata.json` already in the folder that is not Megatron's torch_dist one,
    or a legacy `common.pt`, which both readers prefer to the new common state."""
    if (path / "common.pt").exists():
        return FileExistsError(
            f"{path / 'common.pt'} exists (a legacy Megatron common state): Megatron and "
            f"read_common_state would read it instead of this save's; move it away first"
        )
    existing = path / METADATA_JSON
    if not existing.exists():
        return None
    try:
        same = json.loads(existing.read_text()) == _BACKEND
    except (OSError, ValueError):
        same = False
    return (
        None
        if same
        else FileExistsError(
            f"{existing} exists and is not Megatron's torch_dist metadata: it would be overwritten"
        )
    )


def write_metadata_json(path: Path) -> None:
    """Megatron's `metadata.json` (what `verify_checkpoint` looks for), written durably."""
    from ..checkpoint.commit import write_durably

    if (path / METADATA_JSON).exists():
        return  # checked identical before the save
    path.mkdir(parents=True, exist_ok=True)
    write_durably(path / METADATA_JSON, json.dumps(_BACKEND).encode())


def save_for_megatron(state_dict: Mapping[str, Any], path: str | Path, **kwargs: Any) -> Any:
    """`swc.save(state_dict, path, megatron=True, **kwargs)`: a checkpoint that both
    `swc.load` and Megatron's `dist_checkpointing.load` open. Collective."""
    from ..checkpoint.api import save

    return save(state_dict, path, megatron=True, **kwargs)


def read_common_state(path: str | Path) -> Any:
    """Megatron's common (non-tensor) state of a checkpoint, read without running
    pickled code (`torch.load(weights_only=True)`, as Megatron itself does): from
    its common state object, or from a legacy `common.pt`."""
    from ..checkpoint.offline import open_checkpoint

    path = Path(path)
    if (path / "common.pt").exists():
        return torch.load(path / "common.pt", map_location="cpu", weights_only=True)
    data = open_checkpoint(path).object_bytes(COMMON_STATE_KEY)
    return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)[0]
