"""DCP's metadata dataclasses as a `.metadata` pickle must build them: every field, of its type.

The safe unpickler (`safe_pickle`) admits DCP's classes by name, but a pickle
builds an instance by filling its `__dict__` with whatever the stream holds,
without calling `__init__`: one flipped bit in a field's name (`chunks` read
as `chunkr`) leaves a `TensorStorageMetadata` without `chunks`, and a reader
fails far from the file with an `AttributeError`; a flipped type (a `str`
where DCP keeps an `int`) fails later still, or reads wrong. `check_objects`
walks everything the unpickler built and holds each instance of an admitted
dataclass to the fields torch 2.13 declares for it (`FIELDS`, tested against
`dataclasses.fields`): none missing, none unknown, each of its type. A field
an older PyTorch did not write yet (`StorageMeta.modules`) takes its default,
as stock's own reader would; Megatron-Core's extra attributes (`EXTRA`) are
known too. Anything else is a `CorruptCheckpointError` naming the file, the
class and the field. Nothing is built from the file beyond what the unpickler
built: the walk costs one visit per object, once.
"""

from __future__ import annotations

import dataclasses
import pathlib
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch
from torch.distributed.checkpoint import filesystem, metadata, planner

from ...errors import CorruptCheckpointError

__all__ = ["EXTRA", "FIELDS", "check_objects"]

Check = Callable[[Any], bool]  # whether a value is of a field's type
# Checks whose values hold no instance to check further: the walk stops there.
_FLAT: set[Check] = set()


def _flat(check: Check) -> Check:
    _FLAT.add(check)
    return check


def _any(value: Any) -> bool:
    return True


@_flat
def _str(value: Any) -> bool:
    return type(value) is str


@_flat
def _int(value: Any) -> bool:
    return type(value) is int


@_flat
def _bool(value: Any) -> bool:
    return type(value) is bool


@_flat
def _ints(value: Any) -> bool:
    """A `torch.Size` (its constructor takes ints only), or a tuple or list of ints."""
    return type(value) is torch.Size or (
        isinstance(value, (tuple, list)) and all(type(v) is int for v in value)
    )


@_flat
def _strs(value: Any) -> bool:
    return isinstance(value, (list, tuple)) and all(type(v) is str for v in value)


def _optional(check: Check) -> Check:
    def optional(value: Any) -> bool:
        return value is None or check(value)

    return _flat(optional) if check in _FLAT else optional


def _holds_instances(kind: type | tuple[type, ...]) -> bool:
    return any(dataclasses.is_dataclass(k) for k in (kind if isinstance(kind, tuple) else (kind,)))


def _is(kind: type | tuple[type, ...]) -> Check:
    def check(value: Any) -> bool:
        return isinstance(value, kind)

    return check if _holds_instances(kind) else _flat(check)


def _list_of(kind: type | tuple[type, ...]) -> Check:
    def check(value: Any) -> bool:
        return type(value) is list and all(isinstance(v, kind) for v in value)

    return check if _holds_instances(kind) else _flat(check)


_STORED = (metadata.TensorStorageMetadata, metadata.BytesStorageMetadata)


def _state(value: Any) -> bool:
    """`Metadata.state_dict_metadata`: key to the metadata of its stored value."""
    return type(value) in (dict, OrderedDict) and all(
        type(k) is str and isinstance(v, _STORED) for k, v in value.items()
    )


# The fields of each admitted dataclass, as torch 2.13 declares them, with their types.
FIELDS: dict[type, dict[str, Check]] = {
    metadata.Metadata: {
        "state_dict_metadata": _state,
        "planner_data": _any,
        "storage_data": _any,
        "storage_meta": _optional(_is(metadata.StorageMeta)),
        "version": _optional(_str),
    },
    metadata.TensorStorageMetadata: {
        "properties": _is(metadata.TensorProperties),
        "size": _ints,
        "chunks": _list_of(metadata.ChunkStorageMetadata),
    },
    metadata.BytesStorageMetadata: {},
    metadata.ChunkStorageMetadata: {"offsets": _ints, "sizes": _ints},
    metadata.TensorProperties: {
        "dtype": _is(torch.dtype),
        "layout": _is(torch.layout),
        "requires_grad": _bool,
        "memory_format": _is(torch.memory_format),
        "pin_memory": _bool,
    },
    metadata.MetadataIndex: {"fqn": _str, "offset": _optional(_ints), "index": _optional(_int)},
    metadata.StorageMeta: {
        "checkpoint_id": _optional(_is((str, pathlib.PurePath))),
        "save_id": _optional(_str),
        "load_id": _optional(_str),
        "modules": _list_of(str),
    },
    filesystem._StorageInfo: {
        "relative_path": _str,
        "offset": _int,
        "length": _int,
        "transform_descriptors": _optional(_strs),
    },
    filesystem._StoragePrefix: {"prefix": _str},
    planner.SavePlan: {
        "items": _list_of(planner.WriteItem),
        "storage_data": _any,
        "planner_data": _any,
        "usable": _bool,
    },
    planner.LoadPlan: {
        "items": _list_of(planner.ReadItem),
        "storage_data": _any,
        "planner_data": _any,
    },
    planner.WriteItem: {
        "index": _is(metadata.MetadataIndex),
        "type": _is(planner.WriteItemType),
        "bytes_io_data": _optional(_is(planner.BytesIOWriteData)),
        "tensor_data": _optional(_is(planner.TensorWriteData)),
    },
    planner.ReadItem: {
        "type": _is(planner.LoadItemType),
        "dest_index": _is(metadata.MetadataIndex),
        "dest_offsets": _ints,
        "storage_index": _is(metadata.MetadataIndex),
        "storage_offsets": _ints,
        "lengths": _ints,
    },
    planner.TensorWriteData: {
        "chunk": _is(metadata.ChunkStorageMetadata),
        "properties": _is(metadata.TensorProperties),
        "size": _ints,
    },
    planner.BytesIOWriteData: {"nbytes": _int},
}
# Attributes Megatron-Core adds to DCP's instances (`all_local_plans`: every rank's plan).
EXTRA: dict[type, dict[str, Check]] = {
    metadata.Metadata: {"all_local_plans": _list_of(planner.SavePlan), "mcore_data": _any},
    planner.SavePlan: {"mcore_data": _any},
}
_LEAVES = frozenset(
    {
        str,
        int,
        float,
        bool,
        bytes,
        complex,
        type(None),
        torch.dtype,
        torch.layout,
        torch.memory_format,
    }
)
_CONTAINERS = frozenset({list, tuple, set, frozenset, torch.Size})
_ABSENT = object()


class _Spec:
    """How an instance of one class is checked: the attribute names it may and must
    hold, each field's type, the defaults an older writer may have left out, and the
    fields whose values may hold more instances (the walk goes on into those only)."""

    def __init__(self, kind: type, cls: type) -> None:
        fields, extra = FIELDS[cls], dict(EXTRA.get(cls, {}))
        if kind is not cls and dataclasses.is_dataclass(kind):  # a subclass: its own fields too
            extra.update({f.name: _any for f in dataclasses.fields(kind) if f.name not in fields})
        declared = {f.name: f for f in dataclasses.fields(cls)}
        self.name = kind.__name__
        self.allowed = frozenset(fields) | frozenset(extra)
        self.required = frozenset(
            name
            for name, f in declared.items()
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        )
        self.checks = tuple((k, c) for k, c in {**fields, **extra}.items() if c is not _any)
        self.defaults = {
            name: f.default_factory
            for name, f in declared.items()
            if f.default_factory is not dataclasses.MISSING
        }
        self.deep = tuple(k for k, c in {**fields, **extra}.items() if c not in _FLAT)

    def problem(self, obj: Any) -> str | None:
        """What is wrong with `obj` (None: nothing); a default factory's field that an
        older writer left out is set (no class attribute holds its default)."""
        state = vars(obj)
        keys = state.keys()
        if not (self.required <= keys and keys <= self.allowed):
            missing, unknown = sorted(self.required - keys), sorted(keys - self.allowed)
            what = [f"has no field {', '.join(map(repr, missing))}"] if missing else []
            what += [f"holds {', '.join(map(repr, unknown))}, no field of DCP's"] if unknown else []
            return (
                f"a {self.name} that {' and '.join(what)} (damaged or crafted, or written by "
                "a newer PyTorch than this one): refused"
            )
        for name, factory in self.defaults.items():
            if name not in state:
                state[name] = factory()
        for name, check in self.checks:
            value = state.get(name, _ABSENT)  # absent: the class attribute, its default
            if value is not _ABSENT and not check(value):
                return (
                    f"a {self.name} whose field {name!r} holds a {type(value).__name__} "
                    f"({_short(value)}), not what DCP keeps there (damaged or crafted): refused"
                )
        return None


_SPECS: dict[type, _Spec | None] = {cls: _Spec(cls, cls) for cls in FIELDS}


def _spec(kind: type) -> _Spec | None:
    """The check of an instance of `kind`: an admitted dataclass, or a subclass of one
    (Megatron's `MCoreSavePlan`, when Megatron is loaded); None for anything else."""
    if kind not in _SPECS:
        cls = next((c for c in FIELDS if issubclass(kind, c)), None)
        _SPECS[kind] = None if cls is None else _Spec(kind, cls)
    return _SPECS[kind]


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def check_objects(root: Any, source: str) -> None:
    """Every instance of an admitted DCP dataclass reachable from `root` (what the safe
    unpickler returned) holds its class's fields, of their types; `source` names the
    file in the `CorruptCheckpointError` that refuses anything else."""
    seen: set[int] = set()  # containers and instances with deep fields: shared, or cycles
    stack = [root]
    while stack:
        obj = stack.pop()
        kind = type(obj)
        if kind in _LEAVES:
            continue
        spec = _SPECS[kind] if kind in _SPECS else _spec(kind)
        if spec is not None:
            problem = spec.problem(obj)
            if problem is not None:
                where = _path_to(root, obj)
                raise CorruptCheckpointError(f"{source}: {where}{': ' if where else ''}{problem}")
            if not spec.deep or id(obj) in seen:
                continue
            seen.add(id(obj))
            state = vars(obj)
            stack.extend(state[k] for k in spec.deep if k in state)
            continue
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if kind is dict or kind is OrderedDict:
            stack.extend(obj.keys())
            stack.extend(obj.values())
        elif kind in _CONTAINERS:
            stack.extend(obj)
        elif kind is slice:
            stack.extend((obj.start, obj.stop, obj.step))
        # anything else the unpickler admits holds nothing built from the file: enum
        # members (found by value), paths (strings), sets of them


def _label(key: Any) -> str:
    """A dict key as a message shows it: a state-dict key quoted, a `MetadataIndex` as its
    key and offset (`'w' at (0, 0)`)."""
    if isinstance(key, metadata.MetadataIndex):
        fqn, offset = vars(key).get("fqn"), vars(key).get("offset")
        if type(fqn) is str:
            return repr(fqn) if offset is None else f"{fqn!r} at {tuple(offset)}"
        return "a MetadataIndex"
    return _short(key)


def _path_to(root: Any, target: Any) -> str:
    """Where `target` sits in `root`, for the message that refuses it: fields and keys
    from the `Metadata` down (`state_dict_metadata['w'].chunks[0]`; '' for `root`).
    Walked only once something is refused."""
    seen: set[int] = set()
    stack: list[tuple[Any, str]] = [(root, "")]
    while stack:
        obj, path = stack.pop()
        if obj is target:
            return path
        if type(obj) in _LEAVES or id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, dict):
            for key, value in obj.items():
                stack.append((key, f"{path} key {_label(key)}".strip()))
                stack.append((value, f"{path}[{_label(key)}]"))
        elif isinstance(obj, (list, tuple)):
            stack.extend((v, f"{path}[{i}]") for i, v in enumerate(obj))
        elif isinstance(obj, (set, frozenset)):
            stack.extend((v, f"{path} (an element)".strip()) for v in obj)
        elif _spec(type(obj)) is not None:
            stack.extend((v, f"{path}.{k}" if path else k) for k, v in vars(obj).items())
    return ""
