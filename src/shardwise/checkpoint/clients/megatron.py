"""Megatron-Core values in `swc.save` / `swc.load`, and state dicts as
`sharded_state_dict()` returns them.

Megatron's sharded tensors and objects are described by their adapter like any
other client's values; a state dict that holds them is routed through this
client (its keys agreed across ranks, ShardedObjects saved once from their main
replica, common state written as Megatron writes it).
"""

from __future__ import annotations

import io
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from ...comm.agreement import exchange, require_same
from ...errors import CorruptCheckpointError, InvalidArgumentError, LayoutError, ShardMismatchError
from ...interop.megatron import (
    is_main_replica,
    is_mapping_class,
    is_mcore_object,
    is_mcore_piece,
    is_mcore_value,
    pieces_of,
    pieces_problem,
    to_shardwise,
)
from ...tensor import ShardedTensor
from ..engine import (
    Route,
    Serialized,
    ValueAdapter,
    register_route,
    register_value_adapter,
    route_of,
)
from .megatron_format import COMMON_STATE_KEY

__all__ = [
    "MEGATRON",
    "load_targets",
    "megatron_route",
    "prepare_load",
    "prepare_save",
    "save_targets",
]


# -----------------------------------------------------------------------------
# Megatron-Core values in `swc.save`/`swc.load`, and checkpoints Megatron opens.
#
# - A value adapter (registered on import) lets `swc.async_save` take Megatron's
#   objects directly (the DCP key is the state dict's key); `swc.save`/`swc.load`
#   take Megatron's values by Megatron key instead (`clients.megatron`).
# - `swc.save(..., megatron=True)` (`prepare_save`) stores what Megatron's
#   `dist_checkpointing.load` needs beside the DCP data: tensors under their
#   Megatron key, the common state object and ShardedObjects (its files:
#   `megatron_format`).
# - `swc.load(..., megatron=True)` (`prepare_load`) loads Megatron's own nesting
#   by Megatron key.
#
# The conversions themselves are `shardwise.interop.megatron`'s.
# -----------------------------------------------------------------------------


def _for_save(value: Any) -> ShardedTensor:
    return to_shardwise(value, replicas=False)


def _for_load(
    value: Any, global_shape: Sequence[int] | None = None, group: Any = None
) -> tuple[ShardedTensor, Any]:
    """A target over the pieces' own data (allocated where Megatron left it None);
    a strided piece is loaded into a contiguous copy and copied back by `finish`.
    `global_shape` is needed on a rank holding no piece of the key."""
    pieces = pieces_of(value)
    for p in pieces:
        if p.data is None and pieces_problem([p]) is None:
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
        key = pieces_of(value)[0].key if pieces_of(value) else "?"
        raise LayoutError(
            f"Megatron key '{key}': {e}. If its pieces sit in several state-dict entries (as in "
            f"Megatron's sharded_state_dict()), load with swc.load, which goes by Megatron key"
        ) from e


MEGATRON = "megatron-core"  # the route `megatron=True` takes
_MAPPING = "megatron.core.dist_checkpointing.mapping"
_WRAPPERS = "megatron.core.dist_checkpointing.strategies.checkpointable"

register_value_adapter(
    ValueAdapter(
        "megatron-core",
        (
            f"{_MAPPING}.ShardedTensor",
            f"{_WRAPPERS}.CheckpointableShardedTensor",
            f"{_WRAPPERS}.LocalShardsContainer",
        ),
        _for_save,
        _adapter_for_load,
        hint=(
            "for Megatron's own nesting (pieces of one key in several entries), use swc.save / "
            "swc.load, which go by Megatron key"
        ),
    )
)

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
    if isinstance(value, ShardedTensor) or is_mcore_value(value) or is_mcore_object(value):
        return value, _NONE
    if isinstance(value, list) and value and all(is_mcore_piece(v) for v in value):
        return value, _NONE
    if is_mapping_class(value, "LocalNonpersistentObject"):
        return _NONE, _NONE  # Megatron does not persist these either
    if is_mapping_class(value, "ShardedTensorFactory") or _holds_sharded(value):
        raise TypeError(
            f"a {type(value).__name__} holding Megatron sharded values: shardwise takes Megatron "
            f"ShardedTensors in dicts (or lists of pieces of one key); apply Megatron's "
            f"factories first (dist_checkpointing.mapping.apply_factories) and key other lists "
            f"by name"
        )
    return _NONE, value


def _holds_sharded(value: Any) -> bool:
    """A list or tuple with a sharded value somewhere inside (Megatron's own walk sees it)."""
    if not isinstance(value, (list, tuple)):
        return False
    return any(
        isinstance(v, ShardedTensor)
        or is_mcore_value(v)
        or is_mcore_object(v)
        or _holds_sharded(v)
        or (isinstance(v, Mapping) and _split(v)[0])
        for v in value
    )


def _sharded_entries(sharded: Any, prefix: str = "") -> dict[Any, Any]:
    """Flat DCP key -> value: shardwise tensors under their dotted path, Megatron
    pieces under their own key (grouped: pieces of one key make one entry), and
    ShardedObjects under their unique key (every replica: `_objects` picks)."""
    out: dict[Any, Any] = {}  # dotted path, or (kind, Megatron key) for grouped entries
    for k, v in sharded.items():
        path = f"{prefix}{k}"
        if isinstance(v, Mapping):
            out.update(_sharded_entries(v, path + "."))
        elif isinstance(v, ShardedTensor):
            out[path] = v
        elif is_mcore_object(v):
            out.setdefault(("object", v.unique_key), []).append(v)
        else:
            for piece in pieces_of(v):
                out.setdefault(("mcore", piece.key), []).append(piece)
    return out


def prepare_save(
    state_dict: Mapping[str, Any], group: Any = None, *, common_state: bool = True
) -> dict[str, Any]:
    """The flat state dict `swc.save(..., megatron=True)` saves. Collective.

    Sharded tensors under their Megatron key (Megatron pieces grouped by key,
    every rank taking part for every key, main replicas only), Megatron
    ShardedObjects under their unique key (main replicas only: a key no rank
    holds as `replica_id` 0 raises `ShardMismatchError` on every rank, as a
    tensor with a hole does), everything else in Megatron's common state
    object, each as `dist_checkpointing.save` writes it. `common_state=False`
    leaves the rest out (a plain save stores it by path). Per rank: one
    all-gather of its Megatron keys (with shapes) and ShardedObject keys, then
    `to_shardwise`'s checks, one per Megatron key.
    """
    sharded, common = _split(state_dict)
    entries = _sharded_entries(sharded)
    objects = _objects(entries)
    mcore, shapes = _mcore_keys(entries, group, objects)
    flat: dict[str, Any] = {k: v for k, v in entries.items() if not isinstance(k, tuple)}
    for key in sorted(shapes):  # the same order on every rank: one collective per key
        _refuse_clash(key, flat)
        flat[key] = to_shardwise(
            mcore.get(key, []), replicas=False, global_shape=shapes[key], group=group
        )
    for key, values in objects.items():  # ShardedObjects: this rank's, as Megatron stores them
        if values:  # Megatron writes main replicas only (`_mcore_keys` saw one somewhere)
            flat[key] = _serialized(values)
    if common_state and _rank(group) == 0:  # rank 0's, as Megatron keeps (replica_id: rank)
        flat[COMMON_STATE_KEY] = _serialized([common])
    return flat


def _objects(entries: dict[Any, Any]) -> dict[str, list[Any]]:
    """This rank's ShardedObjects by unique key: the data of its main replicas (none
    where it holds only other replicas)."""
    return {
        key[1]: [o.data for o in held if is_main_replica(o.replica_id)]
        for key, held in entries.items()
        if isinstance(key, tuple) and key[0] == "object"
    }


def _mcore_keys(
    entries: dict[Any, Any], group: Any, objects: Mapping[str, list[Any]] | None = None
) -> tuple[dict[str, list[Any]], dict[str, tuple[int, ...]]]:
    """This rank's Megatron pieces by key, and every rank's keys with their global
    shapes (one exchange), so a rank holding nothing of a key still takes part.

    A save passes this rank's `format.pickles` (`_objects`): which ShardedObject keys it
    holds, and whether as main replica, ride on the same exchange (O(objects held)
    more bytes per rank), so every rank refuses alike a key no rank saves."""
    mcore = {
        key[1]: pieces
        for key, pieces in entries.items()
        if isinstance(key, tuple) and key[0] == "mcore"
    }
    local = {k: tuple(p[0].global_shape) for k, p in mcore.items()}
    held = {k: bool(values) for k, values in (objects or {}).items()}
    distributed = dist.is_available() and dist.is_initialized()
    everyone = exchange(None, (local, held), group) if distributed else [(local, held)]
    _refuse_unsaved_objects([theirs for _, theirs in everyone])
    shapes: dict[str, tuple[int, ...]] = {}
    for theirs, _ in everyone:
        for k, shape in theirs.items():
            shapes.setdefault(k, shape)
    return mcore, shapes


def _refuse_unsaved_objects(held: list[dict[str, bool]]) -> None:
    """Raise, alike on every rank (they all see `held`, every rank's ShardedObject keys
    and whether it holds the main replica), if a key has no main replica anywhere:
    Megatron saves main replicas only, so it would be left out of the checkpoint (and
    an overwritten one's value lost), as a tensor without one is refused."""
    holders: dict[str, list[int]] = {}
    for rank, theirs in enumerate(held):
        for key in theirs:
            holders.setdefault(key, []).append(rank)
    unsaved = sorted(k for k, ranks in holders.items() if not any(held[r][k] for r in ranks))
    if unsaved:
        listed = "; ".join(
            f"'{k}' (held by rank{'s' if len(holders[k]) > 1 else ''} "
            f"{', '.join(map(str, holders[k]))}, none as replica_id 0)"
            for k in unsaved
        )
        raise ShardMismatchError(
            f"Megatron ShardedObject{'s' if len(unsaved) > 1 else ''} {listed}: no rank holds "
            f"the main replica, and only main replicas are saved; give one rank's copy "
            f"replica_id 0 (nothing was saved)"
        )


def _rank(group: Any) -> int:
    return dist.get_rank(group) if dist.is_available() and dist.is_initialized() else 0


def _refuse_clash(key: str, flat: Mapping[str, Any]) -> None:
    if key in flat:
        raise InvalidArgumentError(
            f"key '{key}' is both a shardwise tensor and a Megatron ShardedTensor key"
        )


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


def _serialized(values: list[Any]) -> Serialized:
    """`values` as Megatron-Core stores an object (`torch.save` of a list), stored as is."""
    buffer = io.BytesIO()
    torch.save(values, buffer)
    return Serialized(buffer.getvalue())


# -----------------------------------------------------------------------------
# Megatron-Core state dicts as `sharded_state_dict()` returns them, in plain `swc.save`/`swc.load`.
#
# Megatron's nesting differs per rank by design: a replicated value sits on every
# rank under its `replica_id`, the pieces of one key may sit in several dict
# entries of one rank (stacked layers), and `ShardedObject`s are keyed by their
# shard. Matching values by dict path, as the value adapters do, would refuse
# that; so when any rank holds a Megatron value, `save` and `load` go by
# Megatron key instead (`prepare_save` / `prepare_load`, as `megatron=True`
# does). `megatron` then only decides the format of the rest:
#
# - `megatron=True`: Megatron's common state object and `metadata.json`, so that
#   Megatron's own `dist_checkpointing.load` opens the checkpoint; a load leaves
#   non-tensor values as they are (`read_common_state` reads them).
# - `megatron=False`: every other value under its dotted dict path, as any plain
#   save stores it, and filled in place by a plain load.
#
# Either way tensors are stored under their Megatron key (main replicas only) and
# ShardedObjects under their unique key, as Megatron stores them; a load fills a
# ShardedObject's `data` with the value stored under its unique key.
# -----------------------------------------------------------------------------

Finish = Callable[[], None]


def megatron_route(
    state_dict: Any,
    megatron: bool,
    group: Any = None,
    problem: BaseException | None = None,
    statefuls: tuple[str, ...] = (),
) -> bool:
    """Whether this save or load goes by Megatron key: `megatron=True`, or a Megatron
    value on any rank. Collective (one small exchange, which also raises `problem`,
    this rank's own failure so far, on every rank): every rank takes the same route.
    On that route the ranks' top-level `Stateful` keys must agree, as elsewhere."""
    mine = (megatron or route_of(state_dict) is not None, statefuls)
    if not (dist.is_available() and dist.is_initialized()):
        if problem is not None:
            raise problem
        return mine[0]
    everyone = exchange(problem, mine, group)
    route = any(r for r, _ in everyone)
    if route:
        require_same(
            [s for _, s in everyone],
            "their Stateful values",
            shown=str,
            verb="hold",
            fix="every rank must pass the same Stateful keys",
        )
    return route


def _common_leaves(value: Mapping[str, Any], prefix: str = "") -> list[tuple[Any, Any, str]]:
    """(container, key, dotted path) of every value that is neither sharded nor
    nonpersistent: what Megatron puts in its common state."""
    out: list[tuple[Any, Any, str]] = []
    for key, v in value.items():
        path = f"{prefix}{key}"
        if isinstance(v, Mapping):
            out.extend(_common_leaves(v, path + "."))
        elif _split(v)[1] is not _NONE:
            out.append((value, key, path))
    return out


def _add(flat: dict[str, Any], key: str, value: Any, what: str) -> None:
    if key in flat:
        raise InvalidArgumentError(
            f"key '{key}' is both {what} and a sharded (Megatron or shardwise) key; rename one"
        )
    flat[key] = value


def save_targets(state_dict: Mapping[str, Any], group: Any, megatron: bool) -> dict[str, Any]:
    """The flat state dict DCP saves (see the module docstring). Collective."""
    if megatron:
        return prepare_save(state_dict, group)
    flat = prepare_save(state_dict, group, common_state=False)
    for container, key, path in _common_leaves(state_dict):
        _add(flat, path, container[key], "a non-sharded value's path")
    return flat


def load_targets(
    state_dict: Mapping[str, Any], group: Any, megatron: bool
) -> tuple[dict[str, Any], list[Finish]]:
    """The flat targets DCP fills, and what to run after it (copies into strided
    pieces, ShardedObjects' `data`, non-sharded values). Collective."""
    flat, finishers = prepare_load(state_dict, group)
    objects: dict[str, list[Any]] = {}
    _returned_objects(state_dict, objects)
    for key, held in objects.items():
        _add(flat, key, None, "a ShardedObject's unique key")
        finishers.append(_object_filler(flat, key, held))
    if not megatron:
        for container, key, path in _common_leaves(state_dict):
            _add(flat, path, container[key], "a non-sharded value's path")
            finishers.append(_value_filler(flat, path, container, key))
    return flat, finishers


def _returned_objects(value: Any, out: dict[str, list[Any]]) -> None:
    """This rank's ShardedObjects by unique key, every replica, in state-dict order."""
    if is_mcore_object(value):
        out.setdefault(value.unique_key, []).append(value)
    elif isinstance(value, Mapping):
        for v in value.values():
            _returned_objects(v, out)


def _object_filler(flat: dict[str, Any], key: str, held: list[Any]) -> Finish:
    def finish() -> None:
        # stored as Megatron stores it: the saving rank's values of that key, in order
        stored = flat[key]
        values = stored if isinstance(stored, list) else [stored]
        if not values:
            raise CorruptCheckpointError(
                f"Megatron ShardedObject '{key}': the checkpoint stores an empty list, not "
                f"the saving rank's values of that key (one at least)"
            )
        for i, obj in enumerate(held):
            obj.data = values[min(i, len(values) - 1)]

    return finish


def _value_filler(flat: dict[str, Any], path: str, container: Any, key: Any) -> Finish:
    def finish() -> None:
        container[key] = flat[path]

    return finish


# A state dict holding any Megatron value goes by Megatron key (`save_targets`,
# `load_targets`): chosen by class at the API edge, like an adapter.
register_route(
    Route(
        MEGATRON,
        (
            f"{_MAPPING}.ShardedTensor",
            f"{_MAPPING}.ShardedObject",
            f"{_WRAPPERS}.CheckpointableShardedTensor",
            f"{_WRAPPERS}.LocalShardsContainer",
        ),
        save_targets,
        load_targets,
    )
)
