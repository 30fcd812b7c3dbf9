"""Read a stock DCP `.metadata` without letting its pickle run anything.

Stock DCP pickles its `Metadata` dataclasses. A checkpoint from elsewhere can
carry any pickle, and `pickle.load` would run whatever `__reduce__` it names.
This unpickler admits only the globals stock DCP legitimately writes there
(its metadata dataclasses, `torch.Size`, dtypes, layouts, memory-format
encodings, `pathlib` paths as values) and refuses everything else.
"""

from __future__ import annotations

import pickle
from typing import IO, Any

import torch

__all__ = ["UnsafeMetadataError", "load_metadata"]

_ALLOWED = {
    ("torch.distributed.checkpoint.metadata", name)
    for name in (
        "Metadata",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "MetadataIndex",
        "StorageMeta",
        "_MEM_FORMAT_ENCODING",
    )
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("collections", "OrderedDict"),
    ("pathlib", "Path"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib", "WindowsPath"),
    ("pathlib", "PureWindowsPath"),
}


class UnsafeMetadataError(pickle.UnpicklingError):
    """The metadata pickle names a global that stock DCP never writes."""


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.layout)):
            return getattr(torch, name)
        raise UnsafeMetadataError(
            f"refused global {module}.{name} in the checkpoint metadata: stock DCP never "
            f"stores it, so this file may be malicious"
        )

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafeMetadataError("refused a persistent id in the checkpoint metadata")


def load_metadata(stream: IO[bytes]) -> Any:
    """Unpickle DCP `Metadata` from `stream`, admitting only DCP's own classes."""
    return _MetadataUnpickler(stream).load()
