"""Where a tensor's bytes sit inside a `torch.save` record, without loading it.

Stock DCP stores every chunk as one `torch.save` record (a zip archive, entries
stored uncompressed) inside a `.distcp` file. To read a sub-box of a chunk we
need the offset of the storage payload and the tensor's dtype, shape, strides
and storage offset. Both come from the record itself: the zip central
directory (read by `zipfile` through a window on the file) and the tiny
`data.pkl`, parsed by an unpickler that admits only the globals a plain
tensor record uses and never rebuilds anything.

torch.save writes two kinds of record: `_rebuild_tensor_v2` over a typed
storage (`torch.FloatStorage`, ...) for the dtypes that have one, and
`_rebuild_tensor_v3` over an `UntypedStorage` (sized in bytes) plus the dtype
for the newer ones (`torch.storage._new_dtypes()`: float8, uint16/32/64, ...).
Both are read and written here.
"""

from __future__ import annotations

import functools
import io
import math
import operator
import os
import pickle
import struct
import zipfile
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["RecordLayout", "read_record_layout"]


@dataclass(frozen=True)
class RecordLayout:
    """A tensor record: payload bytes at `payload_offset` (absolute, in the file)."""

    payload_offset: int
    payload_length: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    c_contiguous: bool  # payload holds the elements in C order from byte 0

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


class _Window(io.RawIOBase):
    """A read-only, seekable view of `[start, start + length)` of an open file."""

    def __init__(self, fd: int, start: int, length: int) -> None:
        self._fd, self._start, self._length, self._pos = fd, start, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = 0) -> int:
        base = {0: 0, 1: self._pos, 2: self._length}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def readinto(self, buffer: memoryview) -> int:  # type: ignore[override]
        n = max(0, min(len(buffer), self._length - self._pos))
        data = os.pread(self._fd, n, self._start + self._pos) if n else b""
        buffer[: len(data)] = data
        self._pos += len(data)
        return len(data)


class _StorageRef:
    """A storage's persistent id: `numel` elements of `dtype` (bytes for an untyped storage)."""

    def __init__(self, dtype: torch.dtype, key: str, numel: int) -> None:
        self.dtype, self.key, self.numel = dtype, key, numel


class _TensorArgs:
    """The arguments of a tensor rebuild call, kept as data.

    `plain` is false when the record asks for more than its bytes say (a
    conjugate or negative bit in `metadata`, `requires_grad`, hooks): such a
    record is then loaded whole by `torch.load`, never read raw."""

    def __init__(
        self,
        storage: object,
        offset: int,
        size: tuple,
        stride: tuple,
        dtype: torch.dtype,
        plain: bool,
    ) -> None:
        try:
            if not isinstance(storage, _StorageRef) or not isinstance(dtype, torch.dtype):
                raise TypeError("no storage or no dtype")
            self.offset = operator.index(offset)
            self.size, self.stride = (
                tuple(map(operator.index, size)),
                tuple(map(operator.index, stride)),
            )
        except TypeError as e:
            raise pickle.UnpicklingError(
                f"malformed tensor rebuild call in a tensor record: {e}"
            ) from e
        self.storage, self.dtype, self.plain = storage, dtype, plain


def _rebuild_v1(storage: _StorageRef, offset: int, size: tuple, stride: tuple) -> _TensorArgs:
    return _TensorArgs(storage, offset, size, stride, getattr(storage, "dtype", None), True)


def _rebuild_v2(
    storage: _StorageRef,
    offset: int,
    size: tuple,
    stride: tuple,
    requires_grad: bool = False,
    hooks: object = None,
    metadata: object = None,
) -> _TensorArgs:
    plain = not (requires_grad or hooks or metadata)
    return _TensorArgs(storage, offset, size, stride, getattr(storage, "dtype", None), plain)


def _rebuild_v3(
    storage: _StorageRef,
    offset: int,
    size: tuple,
    stride: tuple,
    requires_grad: bool,
    hooks: object,
    dtype: torch.dtype,
    metadata: object = None,
) -> _TensorArgs:
    if getattr(storage, "dtype", None) != torch.uint8:
        raise pickle.UnpicklingError("_rebuild_tensor_v3 over a typed storage in a tensor record")
    return _TensorArgs(
        storage, offset, size, stride, dtype, not (requires_grad or hooks or metadata)
    )


_REBUILDS = {
    "_rebuild_tensor": _rebuild_v1,
    "_rebuild_tensor_v2": _rebuild_v2,
    "_rebuild_tensor_v3": _rebuild_v3,
}

# "FloatStorage" -> torch.float32, without touching the deprecated TypedStorage classes.
# An UntypedStorage holds bytes: its persistent id counts them.
_STORAGE_DTYPES = {
    name: dtype for dtype, name in torch.storage._dtype_to_storage_type_map().items()
}
_UNTYPED = (("torch.storage", "UntypedStorage"), ("torch", "UntypedStorage"))


class _TensorRecordUnpickler(pickle.Unpickler):
    """Reads `data.pkl` of a single-tensor record into `_TensorArgs`; refuses anything else."""

    def find_class(self, module: str, name: str) -> object:
        if module == "torch._utils" and name in _REBUILDS:
            return _REBUILDS[name]
        if (module, name) == ("collections", "OrderedDict"):
            return dict
        if (module, name) in _UNTYPED:
            return torch.uint8
        if module == "torch" and name in _STORAGE_DTYPES:
            return _STORAGE_DTYPES[name]
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"refused global {module}.{name} in a tensor record")

    def persistent_load(self, pid: object) -> _StorageRef:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
            raise pickle.UnpicklingError(f"unexpected persistent id {pid!r} in a tensor record")
        _, dtype, key, _location, numel = pid
        if not isinstance(dtype, torch.dtype):
            raise pickle.UnpicklingError("storage of unknown dtype in a tensor record")
        return _StorageRef(dtype, str(key), int(numel))


def _c_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, acc = [], 1
    for s in reversed(shape):
        strides.append(acc)
        acc *= s
    return tuple(reversed(strides))


def read_record_layout(fd: int, offset: int, length: int) -> RecordLayout:
    """Parse the `torch.save` record at `[offset, offset + length)` of `fd`.

    Reads the record's first few KiB (its small entries come before the
    payload) or, failing that, its zip directory. Raises `ValueError` when
    the record is not a single plain tensor.
    """
    head = os.pread(fd, min(length, _HEAD), offset)
    try:
        fast = _scan_head(head)
    except (pickle.UnpicklingError, EOFError, struct.error, ValueError, TypeError):
        fast = None
    if fast is not None:
        args, data_start = fast
        return _layout(
            args, offset, data_start, args.storage.numel * args.storage.dtype.itemsize, length
        )
    return _read_via_directory(fd, offset, length)


_HEAD = 4096
_LOCAL = struct.Struct(
    "<4s5H3I2H"
)  # signature, version, flags, method, time, date, crc, sizes, name/extra lengths
_SIGNATURE = b"PK\x03\x04"


def _local_header(head: bytes, pos: int) -> tuple[str, int]:
    """(entry name without the archive folder, data start) of the local header at `pos`."""
    sig, _, _, method, _, _, _, _, _, nlen, xlen = _LOCAL.unpack_from(head, pos)
    if sig != _SIGNATURE or method != 0:
        raise ValueError("not a stored zip entry")
    name = head[pos + _LOCAL.size : pos + _LOCAL.size + nlen].decode("utf-8", "replace")
    return name.split("/", 1)[-1], pos + _LOCAL.size + nlen + xlen


def _scan_head(head: bytes) -> tuple[_TensorArgs, int] | None:
    """Walk torch.save's leading entries: data.pkl (unpickled in place, which
    tells where it ends, since local headers carry no sizes), then the small
    entries up to the payload's header. None when anything is unusual."""
    name, start = _local_header(head, 0)
    if name != "data.pkl":
        return None
    stream = io.BytesIO(head[start:])
    args = _TensorRecordUnpickler(stream).load()
    if not isinstance(args, _TensorArgs):
        return None
    pos = start + stream.tell()
    while True:
        pos = head.find(_SIGNATURE, pos)
        if pos < 0 or pos + _LOCAL.size > len(head):
            return None
        name, data_start = _local_header(head, pos)
        if name == f"data/{args.storage.key}":
            return args, data_start
        pos = data_start


def _read_via_directory(fd: int, offset: int, length: int) -> RecordLayout:
    window = _Window(fd, offset, length)
    try:
        with zipfile.ZipFile(io.BufferedReader(window)) as archive:
            infos = {i.filename.split("/", 1)[-1]: i for i in archive.infolist()}
            pkl = infos.get("data.pkl")
            if pkl is None:
                raise ValueError("no data.pkl in the record")
            args = _TensorRecordUnpickler(io.BytesIO(archive.read(pkl))).load()
    except (zipfile.BadZipFile, pickle.UnpicklingError, EOFError, struct.error, TypeError) as e:
        raise ValueError(f"not a readable tensor record: {e}") from e
    if not isinstance(args, _TensorArgs):
        raise ValueError("the record holds something other than a single tensor")
    entry = infos.get(f"data/{args.storage.key}")
    if entry is None or entry.compress_type != zipfile.ZIP_STORED:
        raise ValueError("tensor payload missing or compressed")
    header = os.pread(fd, 30, offset + entry.header_offset)
    if len(header) != 30 or header[:4] != b"PK\x03\x04":
        raise ValueError("bad zip local header in the record")
    name_len, extra_len = struct.unpack("<HH", header[26:30])
    data_start = entry.header_offset + 30 + name_len + extra_len
    return _layout(args, offset, data_start, entry.file_size, length)


def _layout(
    args: object, offset: int, data_start: int, data_size: int, length: int
) -> RecordLayout:
    if not isinstance(args, _TensorArgs):
        raise ValueError("the record holds something other than a single tensor")
    if data_start + data_size > length:
        raise ValueError("tensor payload runs past the end of the record")
    shape = args.size
    contiguous = (
        args.plain
        and args.offset == 0
        and (
            math.prod(shape) <= 1
            or all(st == c for st, c, s in zip(args.stride, _c_strides(shape), shape) if s > 1)
        )
    )
    return RecordLayout(offset + data_start, data_size, args.dtype, shape, contiguous)


# -- writing ----------------------------------------------------------------------------
#
# The same archive torch.save(tensor) writes (entries stored, data aligned to
# 64 bytes, CRCs 0 as with torch.serialization.set_crc32_options(False)),
# produced directly so the payload goes from tensor memory to the file with
# no copy and no pickling machinery per tensor.

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
_ZIP64_LIMIT = 0xFFFFFFFF


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
        raise TypeError(f"a plain torch.save record cannot hold dtype {dtype}")
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
            _pickle_tuple(_c_strides(shape)),
            b"\x89ccollections\nOrderedDict\n)R",
            tail,
            b"t",
            b"R",
        ]
    )


def _data_pkl(dtype: torch.dtype, shape: tuple[int, ...]) -> bytes:
    """Protocol-2 pickle of one tensor in storage '0'."""
    return b"\x80\x02" + _rebuild_expr(dtype, shape, "0") + b"."


def write_torch_archive(
    fd: int, tensors: list[tuple[str, torch.dtype, tuple[int, ...]]], load: Any
) -> None:
    """Write what `torch.save(dict_of_tensors)` writes, streaming: `load(i)` is called
    for each tensor in turn, so memory holds one tensor at a time."""
    from .storage import write_all

    pkl = (
        b"\x80\x02}("
        + b"".join(
            _pickle_str(key) + _rebuild_expr(dtype, shape, str(i))
            for i, (key, dtype, shape) in enumerate(tensors)
        )
        + b"u."
    )
    central: list[tuple[bytes, int, int]] = []
    pos = 0

    def entry(name: bytes, data: Any) -> None:
        nonlocal pos
        header = _stored_entry(name, len(data), pos)
        central.append((name, len(data), pos))
        write_all(fd, [header, data])
        pos += len(header) + len(data)

    entry(b"archive/data.pkl", pkl)
    entry(b"archive/.format_version", b"1")
    entry(b"archive/.storage_alignment", b"64")
    entry(b"archive/byteorder", b"little")
    for i in range(len(tensors)):
        t = _plain(load(i).detach().cpu())
        entry(
            f"archive/data/{i}".encode(),
            memoryview(t.reshape(-1).view(torch.uint8).numpy()) if t.numel() else b"",
        )
    entry(b"archive/version", b"3")
    entry(b"archive/.data/serialization_id", b"0" * 40)
    directory = b"".join(_central_entry(*e) for e in central)
    n = len(central)
    trailer = directory + struct.pack(
        "<4sQHHIIQQQQ", b"PK\x06\x06", 44, 45, 45, 0, 0, n, n, len(directory), pos
    )
    trailer += struct.pack("<4sIQI", b"PK\x06\x07", 0, pos + len(directory), 1)
    trailer += struct.pack(
        "<4sHHHHIIH",
        b"PK\x05\x06",
        0,
        0,
        min(n, 0xFFFF),
        min(n, 0xFFFF),
        min(len(directory), _ZIP64_LIMIT),
        min(pos, _ZIP64_LIMIT),
        0,
    )
    write_all(fd, [trailer])


def _stored_entry(name: bytes, size: int, pos: int) -> bytes:
    """A stored entry's local header, padded so its data starts 64-byte aligned."""
    zip64 = size >= _ZIP64_LIMIT
    extra = struct.pack("<HHQQ", 1, 16, size, size) if zip64 else b""
    fixed = 30 + len(name) + len(extra) + 4
    pad = (-(pos + fixed)) % _ALIGN
    extra += b"FB" + struct.pack("<H", pad) + b"Z" * pad
    small = _ZIP64_LIMIT if zip64 else size
    return (
        struct.pack(
            "<4sHHHHHIIIHH",
            b"PK\x03\x04",
            45 if zip64 else 20,
            0x0800,
            0,
            0,
            0,
            0,
            small,
            small,
            len(name),
            len(extra),
        )
        + name
        + extra
    )


def _central_entry(name: bytes, size: int, offset: int) -> bytes:
    fields = [
        v
        for v, big in (
            (size, size >= _ZIP64_LIMIT),
            (size, size >= _ZIP64_LIMIT),
            (offset, offset >= _ZIP64_LIMIT),
        )
        if big
    ]
    extra = (
        struct.pack("<HH", 1, 8 * len(fields)) + struct.pack(f"<{len(fields)}Q", *fields)
        if fields
        else b""
    )
    return (
        struct.pack(
            "<4sHHHHHHIIIHHHHHII",
            b"PK\x01\x02",
            45,
            45 if fields else 20,
            0x0800,
            0,
            0,
            0,
            0,
            min(size, _ZIP64_LIMIT),
            min(size, _ZIP64_LIMIT),
            len(name),
            len(extra),
            0,
            0,
            0,
            0,
            min(offset, _ZIP64_LIMIT),
        )
        + name
        + extra
    )


def _plain(t: torch.Tensor) -> torch.Tensor:
    """`t` in C order with a pending conjugation or negation applied (copied only then):
    the record we write carries no such flag, so its bytes must be the values."""
    return t.resolve_conj().resolve_neg().contiguous()


def tensor_record(
    t: torch.Tensor, serialization_id: str = "0" * 40
) -> tuple[bytes, memoryview, bytes]:
    """`(head, payload, tail)` of the record `torch.save(t)` would write; `t` must be a
    contiguous CPU tensor. The payload is `t`'s own memory (a copy only when `t` has a
    conjugate or negative bit); it starts at `len(head)`."""
    t = _plain(t)
    payload = memoryview(t.reshape(-1).view(torch.uint8).numpy()) if t.numel() else memoryview(b"")
    head, tail = _frame(t.dtype, tuple(t.shape), len(payload), serialization_id)
    return head, payload, tail


@functools.lru_cache(maxsize=4096)
def _frame(
    dtype: torch.dtype, shape: tuple[int, ...], nbytes: int, serialization_id: str
) -> tuple[bytes, bytes]:
    """The bytes around a payload: the same for every tensor of one dtype and shape,
    so a state of many like-shaped tensors builds each frame once."""
    central: list[tuple[bytes, int, int]] = []
    head = bytearray()
    for name, data in (
        (b"archive/data.pkl", _data_pkl(dtype, shape)),
        (b"archive/.format_version", b"1"),
        (b"archive/.storage_alignment", b"64"),
        (b"archive/byteorder", b"little"),
    ):
        central.append((name, len(data), len(head)))
        head += _stored_entry(name, len(data), len(head)) + data
    central.append((b"archive/data/0", nbytes, len(head)))
    head += _stored_entry(b"archive/data/0", nbytes, len(head))
    pos = len(head) + nbytes
    tail = bytearray()
    for name, data in (
        (b"archive/version", b"3"),
        (b"archive/.data/serialization_id", serialization_id.encode()),
    ):
        central.append((name, len(data), pos + len(tail)))
        tail += _stored_entry(name, len(data), pos + len(tail)) + data
    cd_start = pos + len(tail)
    directory = b"".join(_central_entry(*entry) for entry in central)
    tail += directory
    eocd64_at = cd_start + len(directory)
    n = len(central)
    tail += struct.pack(
        "<4sQHHIIQQQQ", b"PK\x06\x06", 44, 45, 45, 0, 0, n, n, len(directory), cd_start
    )
    tail += struct.pack("<4sIQI", b"PK\x06\x07", 0, eocd64_at, 1)
    tail += struct.pack(
        "<4sHHHHIIH",
        b"PK\x05\x06",
        0,
        0,
        n,
        n,
        min(len(directory), _ZIP64_LIMIT),
        min(cd_start, _ZIP64_LIMIT),
        0,
    )
    return bytes(head), bytes(tail)
