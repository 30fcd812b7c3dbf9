"""Megatron-Core state dicts in `swc.save` / `swc.load`, as Megatron's training
loop hands them to `dist_checkpointing.save` / `.load`.

Model and optimizer `sharded_state_dict()`s, virtual pipeline chunks, factories,
the distributed optimizer's buckets, ShardedObjects and common state: saved as
Megatron saves them (its files: `megatron_format`), loaded in place as Megatron
loads them. A state dict holding any of them is routed through this client (its
keys agreed across ranks, ShardedObjects saved once from their main replica).
"""

from __future__ import annotations

import io
from collections.abc import Callable, Mapping, MutableMapping
from typing import Any

import torch
import torch.distributed as dist

from ...comm.agreement import exchange, require_same
from ...errors import (
    CheckpointMismatchError,
    CorruptCheckpointError,
    InvalidArgumentError,
    InvalidTypeError,
    LayoutError,
    ShardMismatchError,
)
from ...interop.megatron import (
    block_data,
    is_main_replica,
    is_mapping_class,
    is_mcore_object,
    is_mcore_value,
    pieces_of,
    pieces_problem,
    to_shardwise,
)
from ...tensor import ShardedTensor
from ..engine import (
    LocalPieces,
    Piece,
    Route,
    Serialized,
    Targets,
    ValueAdapter,
    adapter_of,
    is_plain_tensor,
    register_route,
    register_value_adapter,
    route_of,
)
from .megatron_format import COMMON_STATE_KEY

__all__ = [
    "MEGATRON",
    "Found",
    "find",
    "load_targets",
    "megatron_route",
    "prepare_save",
    "save_targets",
]


# -----------------------------------------------------------------------------
# Megatron-Core values, one at a time: the value adapter.
#
# Registered on import, it describes a Megatron value standing alone under a state
# dict key (its DCP key), as any client's value is. A state dict holding Megatron
# values goes by Megatron key instead (the route below), so the adapter serves
# direct conversions; the conversions themselves are `shardwise.interop.megatron`'s.
# -----------------------------------------------------------------------------


Finish = Callable[[], None]


def _for_save(value: Any) -> ShardedTensor:
    return to_shardwise(value, replicas=False)


def _for_load(value: Any) -> tuple[ShardedTensor, Any]:
    """A target over the pieces' own data (allocated where Megatron left it None);
    a strided piece is loaded into a contiguous copy and copied back by `finish`."""
    pieces = _ready(pieces_of(value))
    target = to_shardwise(pieces, replicas=True)
    return target, _copy_back(pieces, target._shards)


def _ready(pieces: list[Any]) -> list[Any]:
    """`pieces` ready to load into: data allocated where Megatron left it None; a piece
    that may load only its overlap with a stored shape (Megatron's
    `allow_shape_mismatch`) zeroed first, as Megatron zeroes it: what the checkpoint
    does not hold reads as zeros."""
    for p in pieces:
        if p.data is None and pieces_problem([p]) is None:
            p.init_data("cpu", init_fn=torch.zeros if p.allow_shape_mismatch else torch.empty)
        elif p.data is not None and p.allow_shape_mismatch:
            p.data.detach().zero_()
    return pieces


def _copy_back(pieces: list[Any], loaded: list[torch.Tensor]) -> Finish | None:
    """The `finish` copying into each strided piece the contiguous copy it was loaded
    through (`block_data`; `loaded` in the pieces' order), None when none is strided."""
    strided = [
        (p, t)
        for p, t in zip(pieces, loaded)
        if p.data is not None and t.data_ptr() != p.data.data_ptr()
    ]
    if not strided:
        return None

    def finish() -> None:
        for p, t in strided:
            p.data.copy_(t.view(p.data.shape))

    return finish


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


def _key_value(key: str, pieces: list[Any]) -> tuple[LocalPieces | None, Any]:
    """This rank's pieces of `key` as one `LocalPieces` (every replica), or the problem
    that makes them unusable (raised on every rank by the caller's next exchange)."""
    problem = pieces_problem(pieces)
    if problem is None and any(p.data is None for p in pieces):
        problem = ShardMismatchError(f"key '{key}': a piece has no data (call init_data)")
    if problem is not None:
        return None, problem
    first = pieces[0]
    boxes = [
        Piece(
            block_data(p),
            tuple(p.global_offset),
            (1,) * p.prepend_axis_num + tuple(p.local_shape),
        )
        for p in pieces
    ]
    return LocalPieces(key, tuple(first.global_shape), first.dtype, boxes), None


_NONE = object()  # "no common part here" in `_walk`


class Found:
    """What one walk of a state dict finds, split as Megatron's own save and load
    preprocessing split it (`apply_factories`, `extract_nonpersistent`,
    `extract_sharded_base`): sharded values by where they are stored, and the rest.

    `pieces`: Megatron key -> this rank's pieces, from every entry that holds one
    (stacked layers, virtual pipeline chunks, optimizer state: one key's pieces sit
    in several entries). `objects`: ShardedObject unique key -> this rank's, in
    state-dict order. `tensors`: dotted path -> a tensor stored under its path (a
    shardwise ShardedTensor; a tensor subclass DCP or an in-place client describes,
    such as torch's legacy ShardedTensor Megatron makes for stacked layers;
    `io.BytesIO`). `factories`: (factory, what it built) for the merges after a
    load. `leaves`: (container, key, dotted path) of every common value. `common`:
    the common part, nested as Megatron's `extract_matching_values` nests it: what
    Megatron's common state object holds."""

    def __init__(self) -> None:
        self.pieces: dict[str, list[Any]] = {}
        self.objects: dict[str, list[Any]] = {}
        self.tensors: dict[str, Any] = {}
        self.factories: list[tuple[Any, Any]] = []
        self.leaves: list[tuple[Any, Any, str]] = []
        self.common: Any = {}


def find(state_dict: Mapping[str, Any]) -> Found:
    """`Found` of `state_dict` (dicts and lists walked; tuples are leaves, as for
    Megatron). Factories are built here, never in the caller's containers."""
    found = Found()
    common = _walk(state_dict, found, "")
    found.common = {} if common is _NONE else common
    return found


def _walk(value: Any, found: Found, path: str) -> Any:
    """The common part of the container `value` (`_NONE`: none), recording its
    sharded values in `found`. As Megatron's split: a container is in the common
    part when some common value is inside it, or when it is empty."""
    if isinstance(value, Mapping):
        common: Any = {}
        for key, v in value.items():
            part = _entry(value, key, v, found, f"{path}{key}")
            if part is not _NONE:
                common[key] = part
    else:
        common = []
        for i, v in enumerate(value):
            part = _entry(value, i, v, found, f"{path}{i}")
            if part is not _NONE:
                common.append(part)
    return common if common or not value else _NONE


def _entry(container: Any, key: Any, value: Any, found: Found, path: str) -> Any:
    """One entry of a container: recorded in `found` if sharded; its common part."""
    if isinstance(value, (Mapping, list)):
        return _walk(value, found, path + ".")
    if is_mapping_class(value, "ShardedTensorFactory"):
        built = value.build()  # Megatron's `apply_factories`, on a value of our own
        found.factories.append((value, built))
        return _entry({}, key, built, found, path)  # what it built, in its place
    if is_mcore_value(value):
        for piece in pieces_of(value):
            found.pieces.setdefault(piece.key, []).append(piece)
        return _NONE
    if is_mcore_object(value):
        found.objects.setdefault(value.unique_key, []).append(value)
        return _NONE
    if is_mapping_class(value, "LocalNonpersistentObject"):
        return _NONE  # never stored, left as it is by a load (Megatron's own rule)
    if _stored_by_path(value):
        if path in found.tensors:
            raise InvalidArgumentError(f"two values of the state dict have the path '{path}'")
        found.tensors[path] = value
        return _NONE
    if isinstance(value, tuple) and _holds_sharded(value):
        raise InvalidTypeError(
            f"'{path}' is a tuple holding Megatron or shardwise sharded values: Megatron keeps "
            f"tuples whole, in its common state; put them in a list or a dict"
        )
    found.leaves.append((container, key, path))
    return value


def _stored_by_path(value: Any) -> bool:
    """A tensor the engine stores under its own path: a shardwise ShardedTensor, a
    tensor subclass (DCP's own chunks, or an in-place client's), raw bytes. A plain
    tensor is common state, as Megatron keeps it."""
    if isinstance(value, ShardedTensor) or isinstance(value, io.BytesIO):
        return True
    if isinstance(value, torch.Tensor) and not is_plain_tensor(value):
        adapter = adapter_of(value)
        if adapter is not None and adapter.pieces is None:  # converted, collectively
            raise InvalidTypeError(
                f"a {type(value).__name__} ({adapter.name}) beside Megatron-Core values: save it "
                f"in a separate call, or as a shardwise ShardedTensor"
            )
        return True
    return False


def _holds_sharded(value: Any) -> bool:
    """A container with a sharded value somewhere inside (tuples too)."""
    values = value.values() if isinstance(value, Mapping) else value
    for v in values:
        if isinstance(v, (list, tuple, Mapping)):
            if _holds_sharded(v):
                return True
        elif not _split_leaf(v):
            return True
    return False


def prepare_save(state_dict: Mapping[str, Any], group: Any = None) -> dict[str, Any]:
    """The flat state dict a save on the Megatron route stores, as Megatron's
    `dist_checkpointing.save` stores it. Collective.

    This rank's pieces of each Megatron key as one value described in place
    (`LocalPieces`: a block held by several replicas is written once, by whichever
    holder has written least, as Megatron's fully parallel save spreads them),
    factories as they build, ShardedObjects under their unique key (main replicas
    only: a key no rank holds as `replica_id` 0 raises `ShardMismatchError` on every
    rank), other tensors under their dotted path, and everything else in Megatron's
    common state object (rank 0's, as Megatron keeps it). Per rank: one all-gather of
    its ShardedObject keys (O(objects held) bytes; it also raises a problem with any
    rank's pieces on every rank), nothing per tensor: the engine's save checks and
    plans the keys with its own exchanges, whose per-rank cost does not grow with the
    world size.
    """
    found = find(state_dict)
    objects = _main_objects(found)
    flat: dict[str, Any] = dict(found.tensors)
    problem = None
    for key, pieces in found.pieces.items():
        value, trouble = _key_value(key, pieces)
        problem = problem or trouble or _clash(key, flat)
        flat[key] = value
    _check_objects(objects, group, problem)
    for key, values in objects.items():  # ShardedObjects: this rank's, as Megatron stores them
        if values:  # Megatron writes main replicas only (`_check_objects` saw one somewhere)
            _refuse_clash(key, flat)
            flat[key] = _serialized(values)
    if _rank(group) == 0:  # rank 0's, as Megatron keeps (replica_id: rank)
        _refuse_clash(COMMON_STATE_KEY, flat)
        flat[COMMON_STATE_KEY] = _serialized([found.common])
    return flat


def _main_objects(found: Found) -> dict[str, list[Any]]:
    """This rank's ShardedObjects by unique key: the data of its main replicas (none
    where it holds only other replicas)."""
    return {
        key: [o.data for o in held if is_main_replica(o.replica_id)]
        for key, held in found.objects.items()
    }


def _check_objects(
    objects: Mapping[str, list[Any]], group: Any, problem: BaseException | None
) -> None:
    """Raise, on every rank, `problem` (this rank's, with its pieces) or a ShardedObject
    key no rank holds as main replica: which keys each rank holds, and whether as main
    replica, are all-gathered (O(objects held) bytes per rank)."""
    held = {k: bool(values) for k, values in objects.items()}
    if not (dist.is_available() and dist.is_initialized()):
        if problem is not None:
            raise problem
        _refuse_unsaved_objects([held])
        return
    _refuse_unsaved_objects(exchange(problem, held, group))


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


def _refuse_clash(key: str, flat: Mapping[str, Any], what: str = "a Megatron key") -> None:
    problem = _clash(key, flat, what)
    if problem is not None:
        raise problem


def _clash(key: str, flat: Mapping[str, Any], what: str = "a Megatron key") -> BaseException | None:
    if key not in flat:
        return None
    return InvalidArgumentError(
        f"key '{key}' is both {what} and a sharded (Megatron or shardwise) value's path; rename one"
    )


def _serialized(values: list[Any]) -> Serialized:
    """`values` as Megatron-Core stores an object (`torch.save` of a list), stored as is."""
    buffer = io.BytesIO()
    torch.save(values, buffer)
    return Serialized(buffer.getvalue())


# -----------------------------------------------------------------------------
# Megatron-Core state dicts as `sharded_state_dict()` returns them, in `swc.save`/`swc.load`.
#
# Megatron's nesting differs per rank by design: a replicated value sits on every
# rank under its `replica_id`, the pieces of one key sit in several entries (stacked
# layers, virtual pipeline chunks, optimizer state), optimizer state comes in lists
# of buckets keyed by int and dtype, and `ShardedObject`s are keyed by their shard.
# Matching values by dict path, as the value adapters do, would refuse that; so when
# any rank holds a Megatron value (or `megatron=True`), `save` and `load` go by
# Megatron key, storing what Megatron's `dist_checkpointing.save` stores:
#
# - tensors under their Megatron key (each block once, from any of its replicas),
#   factories as they build;
# - ShardedObjects under their unique key;
# - every other value in Megatron's common state object, and (in a local folder)
#   Megatron's `metadata.json`, so `dist_checkpointing.load` opens the checkpoint.
#
# A load fills the state in place: pieces' `data` (the model's own parameters, which
# `sharded_state_dict()` holds), factories' `data` with their merge, ShardedObjects'
# `data`, and the stored common state merged into the caller's dict as
# `dist_checkpointing.load` merges it into what it returns (a checkpoint without one,
# saved plainly, fills common values by their dotted path instead).
# -----------------------------------------------------------------------------


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


def save_targets(state_dict: Mapping[str, Any], group: Any) -> dict[str, Any]:
    """The flat state dict DCP saves (see above). Collective."""
    return prepare_save(state_dict, group)


class _Unread:
    """The common state's target before the load: nothing stored there yet."""

    def __repr__(self) -> str:
        return "<Megatron common state, not read>"


def load_targets(state_dict: Mapping[str, Any], group: Any) -> Targets:
    """The flat targets DCP fills and what to run after it, in Megatron's order: copies
    into strided pieces, factories' merges, ShardedObjects' `data`, then the common
    state (stored common values at their paths, keys the caller lacks added). Nothing
    collective: each rank's pieces of a key are one target described in place
    (`LocalPieces`); a problem with them is `Targets.problem`, raised on every rank
    by the load's first exchange."""
    found = find(state_dict)
    flat: dict[str, Any] = dict(found.tensors)
    finishers: list[Finish] = []
    problem = None
    mismatch = set()
    for key, pieces in found.pieces.items():
        value, trouble = _key_value(key, _ready(pieces))
        problem = problem or trouble or _clash(key, flat)
        flat[key] = value
        if any(p.allow_shape_mismatch for p in pieces):
            mismatch.add(key)
        finish = None if value is None else _copy_back(pieces, [b.tensor for b in value.pieces])
        if finish is not None:
            finishers.append(finish)
    for factory, built in found.factories:
        finishers.append(_factory_merge(factory, built))
    for key, held in found.objects.items():
        problem = problem or _clash(key, flat, "a ShardedObject's unique key")
        flat[key] = None
        finishers.append(_object_filler(flat, key, held))
    problem = problem or _clash(COMMON_STATE_KEY, flat, "Megatron's common state key")
    flat[COMMON_STATE_KEY] = unread = _Unread()
    optional: dict[str, str | None] = {COMMON_STATE_KEY: None}
    for container, key, path in found.leaves:  # read by path where it has no common state
        problem = problem or _clash(path, flat, "a common value's path")
        flat[path] = container[key]
        optional[path] = COMMON_STATE_KEY
    finishers.append(_common_filler(flat, unread, state_dict, found.leaves))
    return Targets(flat, finishers, frozenset(mismatch), optional, problem)


def _factory_merge(factory: Any, built: Any) -> Finish:
    """Megatron's `apply_factory_merges` for one factory: its `merge_fn` of what it built,
    as loaded, into the factory's `data` (in place where it has the merged shape, so a
    parameter the factory was made from holds it)."""

    def finish() -> None:
        merged = factory.merge_fn(_loaded(built))
        data = factory.data
        if (
            isinstance(data, torch.Tensor)
            and isinstance(merged, torch.Tensor)
            and data.shape == merged.shape
            and data.dtype == merged.dtype
        ):
            if data.data_ptr() != merged.data_ptr():
                data.detach().copy_(merged)
        else:
            factory.data = merged

    return finish


def _loaded(value: Any) -> Any:
    """What a factory built, as `dist_checkpointing.load` returns it: values' `data`."""
    if isinstance(value, Mapping):
        return {k: _loaded(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_loaded(v) for v in value]
    if is_mcore_value(value) or is_mcore_object(value):
        return value.data
    return value


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


def _common_filler(
    flat: dict[str, Any], unread: _Unread, state_dict: Any, leaves: list[tuple[Any, Any, str]]
) -> Finish:
    """Fill the common values: from the stored common state when there is one (merged as
    Megatron merges it), else from their dotted paths."""

    def finish() -> None:
        stored = flat[COMMON_STATE_KEY]
        if stored is unread:
            for container, key, path in leaves:
                container[key] = flat[path]
            return
        if not isinstance(stored, list) or not stored:  # Megatron stores [common state]
            raise CorruptCheckpointError(
                f"object '{COMMON_STATE_KEY}' holds {type(stored).__name__}, not Megatron's "
                f"[common state]"
            )
        _merge(state_dict, stored[0], COMMON_STATE_KEY)

    return finish


def _merge(into: Any, stored: Any, where: str) -> None:
    """Megatron's `dict_utils.merge` of a stored common state into the caller's state,
    in place: keys the caller lacks are added, common values replaced; a sharded value
    is never replaced (the checkpoint's common state would have to hold its path)."""
    if isinstance(stored, Mapping) and isinstance(into, MutableMapping):
        pairs: list[tuple[Any, Any]] = list(stored.items())
    elif isinstance(stored, list) and isinstance(into, list) and len(into) == len(stored):
        pairs = list(enumerate(stored))
    else:
        raise CheckpointMismatchError(
            f"{where}: the checkpoint's common state holds a {type(stored).__name__} where "
            f"the state dict holds a {type(into).__name__}"
        )
    for key, value in pairs:
        if isinstance(into, MutableMapping) and key not in into:
            into[key] = value
            continue
        mine = into[key]
        if isinstance(mine, (Mapping, list)) and isinstance(value, (Mapping, list)):
            _merge(mine, value, f"{where}.{key}")
        elif _split_leaf(mine):
            into[key] = value
        else:
            raise CheckpointMismatchError(
                f"{where}.{key}: the checkpoint's common state holds a value where the state "
                f"dict holds a sharded {type(mine).__name__}"
            )


def _split_leaf(value: Any) -> bool:
    """A value Megatron keeps in its common state (neither sharded nor nonpersistent)."""
    return not (
        isinstance(value, (ShardedTensor, io.BytesIO))
        or (isinstance(value, torch.Tensor) and not is_plain_tensor(value))
        or is_mcore_value(value)
        or is_mcore_object(value)
        or is_mapping_class(value, "ShardedTensorFactory")
        or is_mapping_class(value, "LocalNonpersistentObject")
    )


# A state dict holding any Megatron value goes by Megatron key (`save_targets`,
# `load_targets`): chosen by class at the API edge, like an adapter.
register_route(
    Route(
        MEGATRON,
        (
            f"{_MAPPING}.ShardedTensor",
            f"{_MAPPING}.ShardedObject",
            f"{_MAPPING}.ShardedTensorFactory",
            f"{_WRAPPERS}.CheckpointableShardedTensor",
            f"{_WRAPPERS}.LocalShardsContainer",
        ),
        save_targets,
        load_targets,
    )
)
