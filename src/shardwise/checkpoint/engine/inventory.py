"""What one rank holds of a flattened state dict, as plain data the ranks exchange once.

The save and load engines (`saving`, `loading`) never build DCP's per-item
`WriteItem`/`ReadItem` objects. Each rank describes its values compactly —
per key: dtype, global shape and the (offsets, sizes) of the pieces it holds,
or the byte length of a serialized object — and keeps the tensors beside
that description. One `all_gather_object` of these tuples is the whole
planning exchange of a save.

Values it understands: shardwise `ShardedTensor`, plain tensors (replicated:
one piece, the whole tensor), DTensor (plain local tensor or
`LocalShardsWrapper`), and any other non-tensor value (a Python object).
Any other tensor subclass makes `describe` return None: the caller then takes
DCP's own path for the whole call.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import crc32c
import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._shards_wrapper import LocalShardsWrapper
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from ...tensor import ShardedTensor
from ..format.manifest import dtype_name

__all__ = ["Entry", "Piece", "describe", "pieces_of"]

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, sizes) in global coordinates


class Piece(NamedTuple):
    """A local tensor holding the box `offsets`/`sizes` of a global tensor (a
    NamedTuple: a save or load makes one per shard, 100,000 of them at scale)."""

    tensor: torch.Tensor
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]


# One key as exchanged: (key, path, dtype name or None for an object, global shape,
# requires_grad, boxes held) for a tensor; (key, path, None, None, False, (byte length,
# crc32c)) for an object, whose bytes every rank serializes before the exchange
# for an object. Tuples of builtins: they pickle fast and compare exactly.
Entry = tuple[str, tuple[Any, ...], str | None, tuple[int, ...] | None, bool, Any]


_PLAIN = (torch.Tensor, torch.nn.Parameter)
_DTYPE_NAMES: dict[torch.dtype, str] = {}


def _plain_tensor(value: Any) -> bool:
    return type(value) in _PLAIN


def _dtype_name(dtype: torch.dtype) -> str:
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = dtype_name(dtype)
    return name


def pieces_of(value: Any) -> list[Piece] | None:
    """The pieces this rank holds of a tensor value; None for a type we leave to DCP."""
    if type(value) in _PLAIN:
        return [Piece(value, (0,) * value.dim(), tuple(value.shape))]
    if isinstance(value, ShardedTensor):
        return [
            Piece(shard, block.offsets, block.sizes)
            for shard, block in zip(value.local_shards(), value.local_blocks)
        ]
    if isinstance(value, DTensor):
        local = value._local_tensor
        if isinstance(local, LocalShardsWrapper):
            return [
                Piece(shard, tuple(offsets), tuple(shard.shape))
                for shard, offsets in zip(local.local_shards(), local.local_offsets())
            ]
        if not _plain_tensor(local):
            return None
        if value.device_mesh.get_coordinate() is None:  # this rank is not in the mesh
            return []
        sizes, offsets = compute_local_shape_and_global_offset(
            value.shape, value.device_mesh, value.placements
        )
        return [Piece(local, tuple(offsets), tuple(sizes))]
    if _plain_tensor(value):
        return [Piece(value, (0,) * value.dim(), tuple(value.shape))]
    return None


def describe(
    flat: dict[str, Any], mappings: dict[str, tuple[Any, ...]], objects: dict[str, bytes]
) -> tuple[list[Entry], dict[str, list[Piece]]] | None:
    """`(entries, pieces by key)` for a flattened state dict, or None when a value
    is a tensor type only DCP's own machinery handles. `objects` holds the
    serialized bytes of each non-tensor value."""
    entries: list[Entry] = []
    pieces: dict[str, list[Piece]] = {}
    for key, value in flat.items():
        path = tuple(mappings.get(key, (key,)))
        if isinstance(value, torch.Tensor):
            held = pieces_of(value)
            if held is None:
                return None
            pieces[key] = held
            shape = tuple(value.shape)
            if len(held) == 1 and held[0].sizes == shape:  # whole (a plain tensor): no copies
                boxes: tuple[Box, ...] = ((held[0].offsets, shape),)
            else:
                boxes = tuple((p.offsets, p.sizes) for p in held)
            name = _dtype_name(value.dtype)
            entries.append((key, path, name, shape, value.requires_grad, boxes))
        else:
            data = objects[key]
            entries.append((key, path, None, None, False, (len(data), crc32c.crc32c(data))))
    return entries, pieces
