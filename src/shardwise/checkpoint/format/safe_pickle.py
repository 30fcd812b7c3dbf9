"""Read a stock DCP `.metadata` without letting its pickle run anything.

Stock DCP pickles its `Metadata` dataclass, and writers put more in it: the
planner's `planner_data`, the storage's `storage_data`, `storage_meta`, and
Megatron-Core adds `all_local_plans` (every rank's `SavePlan`) and
`mcore_data`. A checkpoint from elsewhere can carry any pickle, and
`pickle.load` would run whatever `__reduce__` it names.

This unpickler admits a fixed set of globals, each a class or a lookup that
runs no code of the pickle's choosing however it is called: DCP's metadata and
planner dataclasses and enums, Megatron-Core's `MCoreSavePlan`, `torch.Size`,
dtypes, layouts, memory formats, `pathlib` paths, `OrderedDict`, and the
builtins that protocol 2 names for sets, slices, complex numbers and bytes.
Everything else (any function or method, `getattr`, dotted names such as
`pathlib.Path.touch`) is refused before it is looked up.

One more route to mischief stays open in any unpickler built on `find_class`:
a BUILD opcode aimed at a shared object (an admitted class or an enum
member) would set attributes on it for the whole process. No legitimate
pickle does that, so `load_metadata` checks those objects afterwards and
undoes any change before refusing the file.

What the admitted classes are built with is the stream's choice too (a pickle
fills an instance's attributes, it never calls `__init__`), so every instance
is then held to its class's fields and their types (`metadata_fields`).
"""

from __future__ import annotations

import _compat_pickle
import pathlib
import pickle
import sys
from collections import OrderedDict
from enum import Enum
from typing import IO, Any

import torch
from torch.distributed.checkpoint import filesystem, metadata, planner

from ...errors import UnsafeMetadataError
from .metadata_fields import check_objects

__all__ = ["load_metadata"]

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
    another type (`metadata_fields.check_objects`).
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
