"""Megatron-Core state dicts as `sharded_state_dict()` returns them, in plain `swc.save`/`swc.load`.

Megatron's nesting differs per rank by design: a replicated value sits on every
rank under its `replica_id`, the pieces of one key may sit in several dict
entries of one rank (stacked layers), and `ShardedObject`s are keyed by their
shard. Matching values by dict path, as the value adapters do, would refuse
that; so when any rank holds a Megatron value, `save` and `load` go by
Megatron key instead (`prepare_save` / `prepare_load`, as `megatron=True`
does). `megatron` then only decides the format of the rest:

- `megatron=True`: Megatron's common state object and `metadata.json`, so that
  Megatron's own `dist_checkpointing.load` opens the checkpoint; a load leaves
  non-tensor values as they are (`read_common_state` reads them).
- `megatron=False`: every other value under its dotted dict path, as any plain
  save stores it, and filled in place by a plain load.

Either way tensors are stored under their Megatron key (main replicas only) and
ShardedObjects under their unique key, as Megatron stores them; a load fills a
ShardedObject's `data` with the value stored under its unique key.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch.distributed as dist

from ...comm.agreement import exchange, require_same
from ...errors import CorruptCheckpointError, InvalidArgumentError
from ...interop.megatron import is_mcore_object, is_mcore_value
from .megatron import _NONE, _split, prepare_load, prepare_save

__all__ = ["holds_megatron", "load_targets", "megatron_route", "save_targets"]

Finish = Callable[[], None]


def holds_megatron(value: Any) -> bool:
    """Whether a Megatron ShardedTensor, wrapper or ShardedObject sits anywhere in `value`."""
    if is_mcore_value(value) or is_mcore_object(value):
        return True
    if isinstance(value, Mapping):
        return any(holds_megatron(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(holds_megatron(v) for v in value)
    return False


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
    mine = (megatron or holds_megatron(state_dict), statefuls)
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
