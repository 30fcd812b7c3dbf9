"""Tensors as `torch.save` records written straight from their memory: the write side of records.

The same archive torch.save(tensor) writes (entries stored, data aligned to
64 bytes, CRCs 0 as with torch.serialization.set_crc32_options(False)),
produced directly so the payload goes from tensor memory to the file with
no copy and no pickling machinery per tensor. `record_read` reads them back.
"""

from __future__ import annotations

import functools
import math
import struct
from collections.abc import Callable
from typing import Any

import torch

from ...errors import InvalidTypeError
from ...storage import Sink
from .byte_runs import c_strides
from .checksums import byte_view
from .zip_format import (
    CENTRAL_HEADER,
    CENTRAL_SIGNATURE,
    LOCAL_HEADER,
    LOCAL_SIGNATURE,
    STORED,
    UTF8_NAMES,
    VERSION,
    VERSION_ZIP64,
    ZIP64_EXTRA,
    ZIP64_LIMIT,
    end_of_archive,
)

__all__ = ["record_frame", "tensor_record", "write_torch_archive"]

_QUANTIZED = {
    torch.qint8,
    torch.qint32,
    torch.quint8,
    torch.quint4x2,
    torch.quint2x4,
}  # need scales: not plain
_STORAGE_NAMES = {
    dtype: name
    for dtype, name in torch.storage._dtype_to_storage_type_map().items()
    if dtype not in _QUANTIZED
}
_SAVABLE = set(_STORAGE_NAMES) | torch.storage._new_dtypes()  # plain tensors torch.save writes
_ALIGN = 64


def _pickle_int(n: int) -> bytes:
    if 0 <= n < 256:
        return b"K" + bytes([n])
    if -(2**31) <= n < 2**31:
        return b"J" + struct.pack("<i", n)
    raw = n.to_bytes((n.bit_length() + 8) // 8, "little", signed=True)
    return b"\x8a" + bytes([len(raw)]) + raw


def _pickle_str(s: str) -> bytes:
    raw = s.encode()
    return b"X" + struct.pack("<I", len(raw)) + raw


def _pickle_tuple(values: tuple[int, ...]) -> bytes:
    return b"(" + b"".join(_pickle_int(v) for v in values) + b"t" if values else b")"


def _rebuild_expr(dtype: torch.dtype, shape: tuple[int, ...], key: str) -> bytes:
    """Pickle opcodes that rebuild a tensor from storage `key`, as torch.save writes them:
    `_rebuild_tensor_v2` over a typed storage where the dtype has one, else
    `_rebuild_tensor_v3` over an untyped storage counted in bytes, then the dtype."""
    if dtype not in _SAVABLE:
        raise InvalidTypeError(f"a plain torch.save record cannot hold dtype {dtype}")
    if dtype in _STORAGE_NAMES:
        rebuild, storage, numel, tail = (
            b"_rebuild_tensor_v2",
            b"torch\n" + _STORAGE_NAMES[dtype].encode(),
            1,
            b"",
        )
    else:
        rebuild, storage, numel = (
            b"_rebuild_tensor_v3",
            b"torch.storage\nUntypedStorage",
            dtype.itemsize,
        )
        tail = b"ctorch\n" + str(dtype).removeprefix("torch.").encode() + b"\n"
    return b"".join(
        [
            b"ctorch._utils\n",
            rebuild,
            b"\n((",
            _pickle_str("storage"),
            b"c",
            storage,
            b"\n",
            _pickle_str(key),
            _pickle_str("cpu"),
            _pickle_int(math.prod(shape) * numel),
            b"tQ",
            _pickle_int(0),
            _pickle_tuple(shape),
            _pickle_tuple(c_strides(shape)),
            b"\x89ccollections\nOrderedDict\n)R",
            tail,
            b"t",
            b"R",
        ]
    )


def _data_pkl(dtype: torch.dtype, shape: tuple[int, ...]) -> bytes:
    """Protocol-2 pickle of one tensor in storage '0'."""
    return b"\x80\x02" + _rebuild_expr(dtype, shape, "0") + b"."


def _leading(pkl: bytes) -> list[tuple[bytes, bytes]]:
    """The entries torch.save writes before the tensor data."""
    return [
        (b"archive/data.pkl", pkl),
        (b"archive/.format_version", b"1"),
        (b"archive/.storage_alignment", b"64"),
        (b"archive/byteorder", b"little"),
    ]


def _trailing(serialization_id: str) -> list[tuple[bytes, bytes]]:
    """The entries torch.save writes after the tensor data."""
    return [
        (b"archive/version", b"3"),
        (b"archive/.data/serialization_id", serialization_id.encode()),
    ]


class _Archive:
    """Entry headers in archive order, remembered for the central directory that ends it."""

    def __init__(self) -> None:
        self.pos = 0
        self.central: list[tuple[bytes, int, int]] = []

    def header(self, name: bytes, size: int) -> bytes:
        """The local header of the next entry; its `size` bytes of data follow it."""
        header = _stored_entry(name, size, self.pos)
        self.central.append((name, size, self.pos))
        self.pos += len(header) + size
        return header

    def end(self) -> bytes:
        """The central directory and trailer, after the last entry."""
        directory = b"".join(_central_entry(*entry) for entry in self.central)
        return directory + end_of_archive(len(self.central), len(directory), self.pos)


def write_torch_archive(
    sink: Sink,
    tensors: list[tuple[str, torch.dtype, tuple[int, ...]]],
    load: Callable[[int], torch.Tensor],
) -> None:
    """Write what `torch.save(dict_of_tensors)` writes, streaming: `load(i)` is called
    for each tensor in turn, so memory holds one tensor at a time."""
    pkl = (
        b"\x80\x02}("
        + b"".join(
            _pickle_str(key) + _rebuild_expr(dtype, shape, str(i))
            for i, (key, dtype, shape) in enumerate(tensors)
        )
        + b"u."
    )
    archive = _Archive()

    def entry(name: bytes, data: Any) -> None:
        sink.write([archive.header(name, len(data)), data])

    for name, data in _leading(pkl):
        entry(name, data)
    for i in range(len(tensors)):
        t = _plain(load(i).detach().cpu())
        entry(
            f"archive/data/{i}".encode(),
            byte_view(t) if t.numel() else b"",
        )
    for name, data in _trailing("0" * 40):
        entry(name, data)
    sink.write([archive.end()])


def _stored_entry(name: bytes, size: int, pos: int) -> bytes:
    """A stored entry's local header, padded so its data starts 64-byte aligned."""
    zip64 = size >= ZIP64_LIMIT
    extra = struct.pack("<HHQQ", ZIP64_EXTRA, 16, size, size) if zip64 else b""
    fixed = LOCAL_HEADER.size + len(name) + len(extra) + 4
    pad = (-(pos + fixed)) % _ALIGN
    extra += b"FB" + struct.pack("<H", pad) + b"Z" * pad  # torch.save's padding field
    small = ZIP64_LIMIT if zip64 else size
    version = VERSION_ZIP64 if zip64 else VERSION
    fields = (version, UTF8_NAMES, STORED, 0, 0, 0, small, small, len(name), len(extra))
    return LOCAL_HEADER.pack(LOCAL_SIGNATURE, *fields) + name + extra


def _central_entry(name: bytes, size: int, offset: int) -> bytes:
    big = [
        v
        for v, over in (
            (size, size >= ZIP64_LIMIT),
            (size, size >= ZIP64_LIMIT),
            (offset, offset >= ZIP64_LIMIT),
        )
        if over
    ]
    extra = (
        struct.pack("<HH", ZIP64_EXTRA, 8 * len(big)) + struct.pack(f"<{len(big)}Q", *big)
        if big
        else b""
    )
    version = VERSION_ZIP64 if big else VERSION
    capped = min(size, ZIP64_LIMIT)
    fields = (VERSION_ZIP64, version, UTF8_NAMES, STORED, 0, 0, 0, capped, capped)
    return (
        CENTRAL_HEADER.pack(
            CENTRAL_SIGNATURE,
            *fields,
            len(name),
            len(extra),
            0,
            0,
            0,
            0,
            min(offset, ZIP64_LIMIT),
        )
        + name
        + extra
    )


def _plain(t: torch.Tensor) -> torch.Tensor:
    """`t` in C order with a pending conjugation or negation applied (copied only then):
    the record we write carries no such flag, so its bytes must be the values."""
    if t.is_conj() or t.is_neg():
        t = t.resolve_conj().resolve_neg()
    return t if t.is_contiguous() else t.contiguous()


def tensor_record(
    t: torch.Tensor, serialization_id: str = "0" * 40
) -> tuple[bytes, memoryview, bytes]:
    """`(head, payload, tail)` of the record `torch.save(t)` would write; `t` must be a
    contiguous CPU tensor. The payload is `t`'s own memory (a copy only when `t` has a
    conjugate or negative bit); it starts at `len(head)`."""
    t = _plain(t)
    payload = byte_view(t) if t.numel() else memoryview(b"")
    head, tail = record_frame(t.dtype, tuple(t.shape), serialization_id)
    return head, payload, tail


def record_frame(
    dtype: torch.dtype, shape: tuple[int, ...], serialization_id: str = "0" * 40
) -> tuple[bytes, bytes]:
    """`(head, tail)`: the bytes of a tensor record around its payload. They depend
    only on dtype and shape, so a planner knows every record's length (and where
    its payload starts) before any byte is written."""
    return _frame(dtype, shape, math.prod(shape) * dtype.itemsize, serialization_id)


@functools.lru_cache(maxsize=65536)
def _frame(
    dtype: torch.dtype, shape: tuple[int, ...], nbytes: int, serialization_id: str
) -> tuple[bytes, bytes]:
    """`record_frame`, cached: a state of many like-shaped tensors builds each frame once."""
    archive = _Archive()
    head = bytearray()
    for name, data in _leading(_data_pkl(dtype, shape)):
        head += archive.header(name, len(data)) + data
    head += archive.header(b"archive/data/0", nbytes)
    tail = bytearray()
    for name, data in _trailing(serialization_id):
        tail += archive.header(name, len(data)) + data
    tail += archive.end()
    return bytes(head), bytes(tail)
