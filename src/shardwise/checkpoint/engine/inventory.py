"""What one rank holds of a flattened state dict, as plain data the ranks exchange once.

The save and load engines (`saving`, `loading`) never build DCP's per-item
`WriteItem`/`ReadItem` objects. Each rank describes its values compactly —
per key: dtype, global shape and the (offsets, sizes) of the pieces it holds,
or the byte length of a serialized object — and keeps the tensors beside
that description. One `all_gather_object` of these tuples is the whole
planning exchange of a save.

Values: shardwise `ShardedTensor`, plain tensors (replicated: one piece, the
whole tensor), types a client describes in place (DTensor, `clients.dtensor`),
any other tensor type through DCP's own per-item protocol (`dcp_pieces`), and any other
value as an object: its `torch.save` bytes, or its own bytes when it comes
`Serialized` (Megatron's pre-serialized common state).
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from typing import Any, NamedTuple

import crc32c
import torch
from torch.distributed.checkpoint.planner_helpers import _create_write_items
from torch.distributed.checkpoint.utils import find_tensor_shard

from ...errors import InvalidTypeError
from ...tensor import ShardedTensor
from ..format.manifest import dtype_name
from .adapters import pieces_in_place

__all__ = [
    "Entry",
    "Held",
    "Piece",
    "Serialized",
    "dcp_pieces",
    "describe",
    "is_plain_tensor",
    "pieces_of",
    "serialize_objects",
]

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, sizes) in global coordinates


class Piece(NamedTuple):
    """A local tensor holding the box `offsets`/`sizes` of a global tensor (a
    NamedTuple: a save or load makes one per shard, 100,000 of them at scale)."""

    tensor: torch.Tensor
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]


# One key as exchanged: (key, path, dtype name, global shape, requires_grad, boxes
# held) for a tensor; (key, path, None, None, False, (byte length, crc32c)) for an
# object, whose bytes every rank serializes before the exchange. `path` is DCP's
# (`planner_data`), None where it is `(key,)` (a flat state's). Tuples of builtins:
# they pickle fast and compare exactly.
Entry = tuple[str, tuple[Any, ...] | None, str | None, tuple[int, ...] | None, bool, Any]


@dataclass(frozen=True)
class Serialized:
    """An object its owner serialized already (Megatron's common state, `torch.save`d
    as Megatron-Core stores it): stored as these bytes, never pickled again."""

    data: bytes


_PLAIN = (torch.Tensor, torch.nn.Parameter)
_DTYPE_NAMES: dict[torch.dtype, str] = {}


def is_plain_tensor(value: Any) -> bool:
    """A tensor (or Parameter) of no subclass: its memory is its values, read and
    written as they are."""
    return type(value) in _PLAIN


def _dtype_name(dtype: torch.dtype) -> str:
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = dtype_name(dtype)
    return name


def pieces_of(value: Any) -> list[Piece] | None:
    """The pieces this rank holds of a tensor value: a plain tensor or a ShardedTensor
    here, other types by the client that describes them in place (`clients.dtensor`);
    None for a type only DCP's own write items describe (`dcp_pieces`)."""
    if type(value) in _PLAIN:
        return [Piece(value, (0,) * value.dim(), tuple(value.shape))]
    if isinstance(value, ShardedTensor):
        return [
            Piece(shard, block.offsets, block.sizes)
            for shard, block in zip(value.local_shards(), value.local_blocks)
        ]
    return pieces_in_place(value)  # DTensor and other clients' types; None: DCP's items


def dcp_pieces(key: str, value: torch.Tensor) -> list[Piece]:
    """The pieces of a tensor type `pieces_of` leaves to DCP, through DCP's own per-item
    protocol: its write items (a `_Checkpointable`'s `__create_write_items__`; any other
    tensor, whole), each resolved as `DefaultSavePlanner.resolve_data` resolves it
    (`__get_tensor_shard__`)."""
    pieces = []
    for item in _create_write_items(key, value):
        assert item.tensor_data is not None  # a tensor's items are never bytes
        chunk = item.tensor_data.chunk
        shard = find_tensor_shard(value, item.index)
        pieces.append(Piece(shard, tuple(chunk.offsets), tuple(chunk.sizes)))
    return pieces


def serialize_objects(flat: dict[str, Any]) -> tuple[dict[str, bytes], BaseException | None]:
    """Each non-tensor value as the bytes DCP stores (`torch.save`; a `Serialized`
    value's own bytes), or the first failure."""
    objects: dict[str, bytes] = {}
    for key, value in flat.items():
        if isinstance(value, torch.Tensor):
            continue
        if isinstance(value, Serialized):
            objects[key] = value.data
            continue
        buffer = io.BytesIO()
        try:
            torch.save(value, buffer)
        except Exception as e:  # noqa: BLE001 - any pickling failure is the caller's to fix
            why = f"object '{key}' cannot be pickled ({type(e).__name__}: {e})"
            return objects, InvalidTypeError(why)
        objects[key] = buffer.getvalue()
    return objects, None


class Held:
    """The tensors a rank's entries describe, found again by (key, box index) when
    written. A plain tensor or a `ShardedTensor` is looked up in the flattened state
    itself: a `Piece` per shard kept for the whole save would be 100,000 objects
    (12 MiB) at scale; other types keep the pieces their protocol returned."""

    def __init__(self, flat: dict[str, Any], pieces: dict[str, list[Piece]]) -> None:
        self.flat, self.pieces = flat, pieces

    def tensor(self, key: str, index: int) -> torch.Tensor:
        """The local tensor of box `index` of `key`'s entry."""
        pieces = self.pieces.get(key)
        if pieces is not None:
            return pieces[index].tensor
        value = self.flat[key]
        return value if type(value) in _PLAIN else value.local_shards()[index]


def describe(
    flat: dict[str, Any], mappings: dict[str, tuple[Any, ...]], objects: dict[str, bytes]
) -> tuple[list[Entry], Held]:
    """`(entries, the tensors they describe)` for a flattened state dict. `objects`
    holds the serialized bytes of each non-tensor value (`serialize_objects`). Like
    shapes and boxes are one tuple (10,000 tensors sharded alike share theirs): held
    once here, and pickled once to their owners."""
    entries: list[Entry] = []
    pieces: dict[str, list[Piece]] = {}
    same: dict[Any, Any] = {}
    for key, value in flat.items():
        path = mappings.get(key)
        path = None if path is None or path == (key,) else tuple(path)
        if isinstance(value, torch.Tensor):
            shape = tuple(value.shape)
            shape = same.setdefault(shape, shape)
            if type(value) in _PLAIN:
                boxes: tuple[Box, ...] = (((0,) * len(shape), shape),)
            elif isinstance(value, ShardedTensor):
                boxes = tuple((b.offsets, b.sizes) for b in value.local_blocks)
            else:
                held = pieces_of(value)
                if held is None:
                    held = dcp_pieces(key, value)
                pieces[key] = held
                if len(held) == 1 and held[0].sizes == shape:  # whole: no copies
                    boxes = ((held[0].offsets, shape),)
                else:
                    boxes = tuple((p.offsets, p.sizes) for p in held)
            boxes = same.setdefault(boxes, boxes)
            entries.append((key, path, _dtype_name(value.dtype), shape, value.requires_grad, boxes))
        else:
            data = objects[key]
            entries.append((key, path, None, None, False, (len(data), crc32c.crc32c(data))))
    return entries, Held(flat, pieces)
