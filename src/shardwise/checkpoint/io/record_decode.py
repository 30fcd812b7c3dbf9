"""Whole records turned back into values: stream extensions undone (bounded), tensors unpickled.

A chunk stored through DCP's stream extensions (e.g. zstd) or as a strided
`torch.save` record cannot be read by byte ranges: the read executor reads its
record whole and decodes it here. Undoing extensions is bounded, so a crafted
record cannot expand without limit (a decompression bomb).
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from typing import Any

import torch
from torch.distributed.checkpoint._extension import ExtensionRegistry, StreamTransformExtension

from ...errors import CorruptCheckpointError, UnsupportedStorageError

__all__ = ["CONTAINER_ROOM", "load_record", "untransform"]

# What a `torch.save` container adds around a tensor's bytes, at most (its pickle, zip
# headers and alignment take a few KiB): the bound on undoing a chunk's stream extensions.
CONTAINER_ROOM = 1 << 20


def untransform(
    registry: ExtensionRegistry | None,
    descriptors: Sequence[str],
    data: bytes,
    name: str,
    where: str,
    limit: int | None,
) -> bytes:
    """`data` with the stream extensions `descriptors` undone, refused past `limit` bytes
    (None: unbounded, for objects, whose size is not recorded)."""
    try:
        extensions = (registry or ExtensionRegistry()).from_descriptor_list(list(descriptors))
    except ValueError as e:  # DCP's "Unknown extension": not damage, a missing registry
        raise UnsupportedStorageError(
            f"'{name}' in {where} was written through stream extensions {list(descriptors)} "
            f"this reader does not know ({e}); pass a registry that does: "
            "Reader(path, _extension_registry=...), swc.load(..., extension_registry=...) "
            "or read_tensor(..., extension_registry=...)"
        ) from e
    stream: Any = io.BytesIO(data)
    for ex in extensions:
        if isinstance(ex, StreamTransformExtension):
            stream = ex.transform_from(stream)
    plain: bytes = stream.read(-1 if limit is None else limit + 1)
    if limit is not None and len(plain) > limit:
        raise CorruptCheckpointError(
            f"'{name}' in {where}: undoing its stream extensions yields over {limit} bytes, "
            "more than its chunk's elements and a torch.save container need: a "
            "decompression bomb, or damaged; refused"
        )
    return plain


def load_record(data: bytes, name: str, where: str) -> torch.Tensor:
    """The tensor of a whole `torch.save` record (tensors only: `weights_only`)."""
    try:
        value = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - any decoding failure means damaged bytes
        raise CorruptCheckpointError(f"'{name}' in {where}: cannot decode ({e})") from e
    if not isinstance(value, torch.Tensor):
        raise CorruptCheckpointError(f"'{name}' in {where}: the record holds no tensor")
    return value
