"""Pickles in a checkpoint, unpickled safely unless the caller trusts it.

Stock DCP's `.metadata` read without letting its pickle run anything (only
DCP's metadata classes and plain containers are built, each checked to be the
dataclass with every field of its type), and the non-tensor
values of a checkpoint unpickled through an allow-list (`allow_object_globals`).
"""

from __future__ import annotations

import _compat_pickle
import dataclasses
import io
import pathlib
import pickle
import re
import sys
from collections import OrderedDict
from collections.abc import Callable
from enum import Enum
from typing import IO, Any

import torch
from torch.distributed.checkpoint import filesystem, metadata, planner

from ...errors import CorruptCheckpointError, UnsafeMetadataError

__all__ = [
    "EXTRA",
    "FIELDS",
    "allow_object_globals",
    "check_objects",
    "load_metadata",
    "load_object",
    "vetted_stream",
]


# -----------------------------------------------------------------------------
# DCP's metadata dataclasses as a `.metadata` pickle must build them: every field, of its type.
#
# The safe unpickler (`format.pickles`) admits DCP's classes by name, but a pickle
# builds an instance by filling its `__dict__` with whatever the stream holds,
# without calling `__init__`: one flipped bit in a field's name (`chunks` read
# as `chunkr`) leaves a `TensorStorageMetadata` without `chunks`, and a reader
# fails far from the file with an `AttributeError`; a flipped type (a `str`
# where DCP keeps an `int`) fails later still, or reads wrong. `check_objects`
# walks everything the unpickler built and holds each instance of an admitted
# dataclass to the fields torch 2.13 declares for it (`FIELDS`, tested against
# `dataclasses.fields`): none missing, none unknown, each of its type. A field
# an older PyTorch did not write yet (`StorageMeta.modules`) takes its default,
# as stock's own reader would; Megatron-Core's extra attributes (`EXTRA`) are
# known too. Anything else is a `CorruptCheckpointError` naming the file, the
# class and the field. Nothing is built from the file beyond what the unpickler
# built: the walk costs one visit per object, once.
# -----------------------------------------------------------------------------

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


# -----------------------------------------------------------------------------
# Read a stock DCP `.metadata` without letting its pickle run anything.
#
# Stock DCP pickles its `Metadata` dataclass, and writers put more in it: the
# planner's `format.entries`, the storage's `storage_data`, `storage_meta`, and
# Megatron-Core adds `all_local_plans` (every rank's `SavePlan`) and
# `mcore_data`. A checkpoint from elsewhere can carry any pickle, and
# `pickle.load` would run whatever `__reduce__` it names.
#
# This unpickler admits a fixed set of globals, each a class or a lookup that
# runs no code of the pickle's choosing however it is called: DCP's metadata and
# planner dataclasses and enums, Megatron-Core's `MCoreSavePlan`, `torch.Size`,
# dtypes, layouts, memory formats, `pathlib` paths, `OrderedDict`, and the
# builtins that protocol 2 names for sets, slices, complex numbers and bytes.
# Everything else (any function or method, `getattr`, dotted names such as
# `pathlib.Path.touch`) is refused before it is looked up.
#
# One more route to mischief stays open in any unpickler built on `find_class`:
# a BUILD opcode aimed at a shared object (an admitted class or an enum
# member) would set attributes on it for the whole process. No legitimate
# pickle does that, so `load_metadata` checks those objects afterwards and
# undoes any change before refusing the file.
#
# What the admitted classes are built with is the stream's choice too (a pickle
# fills an instance's attributes, it never calls `__init__`), so every instance
# is then held to its class's fields and their types (`format.pickles`).
# -----------------------------------------------------------------------------

_DCP_CLASSES = (
    metadata.Metadata,
    metadata.TensorStorageMetadata,
    metadata.BytesStorageMetadata,
    metadata.ChunkStorageMetadata,
    metadata.TensorProperties,
    metadata.MetadataIndex,
    metadata.StorageMeta,
    metadata._MEM_FORMAT_ENCODING,
    planner.SavePlan,
    planner.LoadPlan,
    planner.WriteItem,
    planner.ReadItem,
    planner.WriteItemType,
    planner.LoadItemType,
    planner.TensorWriteData,
    planner.BytesIOWriteData,
    filesystem._StorageInfo,
    filesystem._StoragePrefix,
)

_PATHS = (
    pathlib.PurePath,
    pathlib.PurePosixPath,
    pathlib.PureWindowsPath,
    pathlib.Path,
    pathlib.PosixPath,
    pathlib.WindowsPath,
)

_LAYOUTS = {str(v): v for v in vars(torch).values() if isinstance(v, torch.layout)}

_MEGATRON_PLAN = ("megatron.core.dist_checkpointing.strategies.torch", "MCoreSavePlan")


def _layout(name: str) -> torch.layout:
    """What `torch.serialization._get_layout` returns, from a fixed table."""
    if name not in _LAYOUTS:
        raise UnsafeMetadataError(f"unknown layout {name!r} in the checkpoint metadata")
    return _LAYOUTS[name]


def _latin1(text: str, encoding: str) -> bytes:
    """`_codecs.encode` as protocol 2 uses it for bytes: latin-1 only."""
    if not isinstance(text, str) or encoding not in ("latin1", "latin-1"):
        raise UnsafeMetadataError("refused a call of _codecs.encode in the checkpoint metadata")
    return text.encode("latin-1")


_ADMITTED: dict[tuple[str, str], Any] = {
    **{(c.__module__, c.__qualname__): c for c in _DCP_CLASSES + _PATHS},
    **{
        ("pathlib", c.__name__): c for c in _PATHS
    },  # the name pickles use wherever pathlib defines them
    ("torch", "Size"): torch.Size,
    ("torch.serialization", "_get_layout"): _layout,
    ("collections", "OrderedDict"): OrderedDict,
    ("builtins", "set"): set,
    ("builtins", "frozenset"): frozenset,
    ("builtins", "slice"): slice,
    ("builtins", "complex"): complex,
    ("_codecs", "encode"): _latin1,
}


def _megatron_save_plan() -> type:
    """Megatron-Core's `SavePlan` subclass when Megatron is loaded, else `SavePlan`
    itself (its extra `mcore_data` field then lands in the instance's `__dict__`)."""
    module = sys.modules.get(_MEGATRON_PLAN[0])
    found = getattr(module, _MEGATRON_PLAN[1], None)
    return (
        found
        if isinstance(found, type) and issubclass(found, planner.SavePlan)
        else planner.SavePlan
    )


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        # Protocol 2 spells some modules the Python 2 way (`__builtin__`).
        module, name = _compat_pickle.NAME_MAPPING.get(
            (module, name), (_compat_pickle.IMPORT_MAPPING.get(module, module), name)
        )
        if (module, name) in _ADMITTED:
            return _ADMITTED[(module, name)]
        if (module, name) == _MEGATRON_PLAN:
            return _megatron_save_plan()
        if module == "torch" and isinstance(
            value := getattr(torch, name, None), (torch.dtype, torch.layout, torch.memory_format)
        ):
            return value
        raise UnsafeMetadataError(
            f"refused global {module}.{name} in the checkpoint metadata: DCP writers never "
            f"store it, so this file may be malicious"
        )

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafeMetadataError("refused a persistent id in the checkpoint metadata")


def _shared_objects() -> list[Any]:
    """What a pickle could reach and alter for everyone: the admitted classes written in
    Python (builtin types refuse new attributes) and the members of admitted enums."""
    classes = list(dict.fromkeys((*_DCP_CLASSES, *_PATHS, _megatron_save_plan())))
    return classes + [m for c in classes if issubclass(c, Enum) for m in c]


def _undo_changes(before: list[tuple[Any, dict[str, Any]]]) -> list[str]:
    """Restore each object's attributes as they were; the names of those that changed."""
    changed = []
    for obj, attrs in before:
        now = dict(vars(obj))
        if now.keys() == attrs.keys() and all(now[k] is v for k, v in attrs.items()):
            continue
        changed.append(getattr(obj, "__qualname__", None) or repr(obj))
        for key in now.keys() - attrs.keys():
            delattr(obj, key) if isinstance(obj, type) else vars(obj).pop(key)
        for key, value in attrs.items():
            if now.get(key) is not value:
                setattr(obj, key, value) if isinstance(obj, type) else vars(obj).__setitem__(
                    key, value
                )
    return changed


def load_metadata(stream: IO[bytes], source: str = "the checkpoint metadata") -> Any:
    """Unpickle DCP `Metadata` from `stream`, admitting only the classes DCP writers store.

    Raises `UnsafeMetadataError` (a `ShardwiseError` and a `pickle.UnpicklingError`)
    naming the refused global, or the shared class it tried to alter, when the
    pickle steps outside; `CorruptCheckpointError` naming `source` (the file) when an
    instance of DCP's classes lacks a field, holds one DCP's class has not, or one of
    another type (`format.pickles.check_objects`).
    """
    before = [(obj, dict(vars(obj))) for obj in _shared_objects()]
    try:
        loaded = _MetadataUnpickler(stream).load()
    except UnsafeMetadataError:
        raise
    except Exception as e:  # noqa: BLE001 - whatever a damaged or crafted pickle makes an
        # admitted class raise (TypeError, EOFError, RecursionError, ...) is one refusal
        raise UnsafeMetadataError(
            f"unreadable checkpoint metadata: {type(e).__name__}: {e} "
            "(damaged, or crafted: refused)"
        ) from e
    finally:
        changed = _undo_changes(before)
    if changed:
        raise UnsafeMetadataError(
            f"refused the checkpoint metadata: its pickle alters {', '.join(changed)}, "
            f"which no DCP writer does (changes undone)"
        )
    check_objects(loaded, source)
    return loaded


# -----------------------------------------------------------------------------
# Unpickling the non-tensor values of a checkpoint: safe unless the caller trusts it.
#
# A checkpoint is untrusted input, and a pickle can name any callable
# (`os.system`) for the loader to run. So by default every stored object is
# read with PyTorch's `weights_only` unpickler (`torch.load(weights_only=True)`):
# ints, floats, strings, bytes, `None`, containers (dict, list, tuple, set,
# OrderedDict), tensors, dtypes, `torch.Size`, and so optimizer `param_groups`
# and the like; plus `io.BytesIO`, DCP's idiom for raw bytes in a state dict
# (PyTorch's own DCP tests store them), which holds bytes and runs nothing: it is
# added to PyTorch's allowlist on first use. Every other global is refused before
# it is looked up, so nothing in the file runs. Two ways to admit more:
#
# * `allow_object_globals(cls, ...)`: allowlist classes (or functions) you
#   trust, process-wide (PyTorch's `torch.serialization.add_safe_globals`, which
#   `torch.serialization.safe_globals(...)` scopes to a `with` block);
# * `trust_objects=True` on `swc.load` / `Reader`: plain `pickle` for that
#   load, running whatever the file names. Only for checkpoints you trust.
#
# DCP's own load planner unpickles object bytes with `weights_only=False`; the
# `Reader` therefore decodes them here first and hands the planner a fresh
# serialization of the vetted value (`vetted_stream`), never the file's bytes.
# -----------------------------------------------------------------------------

_GLOBAL = re.compile(r"GLOBAL ([\w.]+)")

_DETAIL = re.compile(r"WeightsUnpickler error: ([^\n]*(?:\n\n[^\n]+)?)")

_HOW = (
    "non-tensor values load with torch.load(weights_only=True) rules by default; if you "
    "trust this checkpoint, pass trust_objects=True (swc.load / Reader), or allowlist the "
    "class with shardwise.checkpoint.allow_object_globals(...)"
)


def allow_object_globals(*globals_: Any) -> None:
    """Admit these classes or functions when unpickling checkpoint objects, in every
    later load of this process (`torch.serialization.add_safe_globals`). Entries may
    also be `(obj, "module.name")` pairs, as PyTorch accepts."""
    torch.serialization.add_safe_globals(list(globals_))


def load_object(data: bytes | memoryview, key: str, where: str, *, trust: bool) -> Any:
    """The value stored as `data` (`torch.save` bytes) for object `key` of `where`.

    Untrusted (the default), only what `torch.load(weights_only=True)` admits loads;
    anything else raises `UnsafeMetadataError` naming the key and the refused global,
    before the global is looked up. Bytes that are no `torch.save` stream raise
    `CorruptCheckpointError`."""
    stream = io.BytesIO(data)
    if trust:
        return torch.load(stream, weights_only=False)
    _admit_bytes_io()
    try:
        return torch.load(stream, weights_only=True)
    except pickle.UnpicklingError as e:
        raise UnsafeMetadataError(_refusal(key, where, str(e))) from None
    except Exception as e:  # noqa: BLE001 - any other decoding failure means damaged bytes
        raise CorruptCheckpointError(
            f"object '{key}' in {where}: cannot decode ({type(e).__name__}: {e})"
        ) from e


def vetted_stream(data: bytes | memoryview, key: str, where: str, *, trust: bool) -> io.BytesIO:
    """What to hand DCP's planner (`load_bytes`, which unpickles with `weights_only=False`):
    the file's bytes when trusted, else a fresh `torch.save` of the value `load_object`
    admitted, so the planner never unpickles anything the file chose."""
    if trust:
        return io.BytesIO(data)
    value = load_object(data, key, where, trust=False)
    out = io.BytesIO()
    torch.save(value, out)
    out.seek(0)
    return out


def _admit_bytes_io() -> None:
    """`io.BytesIO` in PyTorch's weights-only allowlist (again, if someone cleared it)."""
    if io.BytesIO not in torch.serialization.get_safe_globals():
        torch.serialization.add_safe_globals([io.BytesIO])


def _refusal(key: str, where: str, message: str) -> str:
    """One line naming the key and what the weights-only unpickler refused."""
    found = _GLOBAL.search(message)
    if found:
        what = f"refused global {found.group(1)}"
    else:
        detail = _DETAIL.search(message)
        reason = " ".join(detail.group(1).split()) if detail else "not a weights-only pickle"
        what = f"refused ({reason})"
    return f"object '{key}' in {where}: {what}, nothing was run; {_HOW}"
