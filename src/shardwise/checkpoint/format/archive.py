"""Torch archives: a tensor's `torch.save` archive inside a data file.

Each stored tensor or object is one `torch.save` zip archive in a data file
(what DCP's `FileSystemWriter` writes). Written here straight from a tensor's
memory, and read without loading it (where its bytes sit). The zip structures
are defined once for both directions. Called an archive, not a record, so that
"record" keeps one meaning: a checkpoint's metadata files (`shardwise.json`,
`.metadata`).
"""

from __future__ import annotations

import functools
import io
import math
import operator
import pickle
import struct
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from ...errors import InvalidTypeError, ShardwiseError
from ...storage import RandomAccess, Sink
from .checksums import byte_view, c_strides, nbytes

__all__ = [
    "CENTRAL_HEADER",
    "CENTRAL_SIGNATURE",
    "HEAD_BYTES",
    "LOCAL_HEADER",
    "LOCAL_SIGNATURE",
    "LocalHeader",
    "ArchiveError",
    "ArchiveLayout",
    "STORED",
    "UTF8_NAMES",
    "VERSION",
    "VERSION_ZIP64",
    "ZIP64_EXTRA",
    "ZIP64_LIMIT",
    "end_of_archive",
    "local_header",
    "read_archive_layout",
    "archive_frame",
    "tensor_archive",
    "write_torch_archive",
]


# -----------------------------------------------------------------------------
# The zip structures of a `torch.save` archive, defined once for the record reader and writer.
#
# torch.save writes a zip64 archive of stored (uncompressed) entries; these are
# the header layouts and the end-of-archive trailer both sides must agree on.
# -----------------------------------------------------------------------------


class ArchiveError(ShardwiseError, ValueError):
    """A `torch.save` record that is not a single plain tensor, or is damaged.
    Internal: its readers catch it (as a `ValueError`) and raise
    `CorruptCheckpointError` naming the tensor and the file, or fall back to
    loading the record whole."""


# signature, version, flags, method, time, date, crc, sizes, name/extra lengths
LOCAL_HEADER = struct.Struct("<4s5H3I2H")

LOCAL_SIGNATURE = b"PK\x03\x04"

# signature, versions made by/needed, flags, method, time, date, crc, sizes, name/extra/comment
# lengths, disk, attributes, local header offset
CENTRAL_HEADER = struct.Struct("<4s6H3I5H2I")

CENTRAL_SIGNATURE = b"PK\x01\x02"

_END64 = struct.Struct("<4sQ2H2I4Q")  # zip64 end of central directory record

_END64_SIGNATURE = b"PK\x06\x06"

_LOCATOR = struct.Struct("<4sIQI")  # where the zip64 record is

_LOCATOR_SIGNATURE = b"PK\x06\x07"

_END = struct.Struct("<4s4H2IH")  # the classic end of central directory record

_END_SIGNATURE = b"PK\x05\x06"

STORED = 0  # compression method: none

UTF8_NAMES = 0x0800  # general purpose flag: entry names are UTF-8

VERSION = 20  # version needed for a plain stored entry

VERSION_ZIP64 = 45  # ... and for one with zip64 fields

ZIP64_EXTRA = 1  # extra field id of the zip64 sizes/offsets

ZIP64_LIMIT = 0xFFFFFFFF  # a 32-bit field at this value defers to the zip64 extra field


class LocalHeader(NamedTuple):
    method: int
    name_length: int
    extra_length: int

    @property
    def data_offset(self) -> int:
        """Where the entry's data starts, from the start of its header."""
        return LOCAL_HEADER.size + self.name_length + self.extra_length


def local_header(buf: bytes, pos: int = 0) -> LocalHeader:
    """The local header at `pos` of `buf`; `ArchiveError` when there is none."""
    if len(buf) < pos + LOCAL_HEADER.size or buf[pos : pos + 4] != LOCAL_SIGNATURE:
        raise ArchiveError("bad zip local header in the record")
    fields = LOCAL_HEADER.unpack_from(buf, pos)
    return LocalHeader(fields[3], fields[9], fields[10])


def end_of_archive(entries: int, directory_size: int, directory_offset: int) -> bytes:
    """What follows the central directory: the zip64 record, its locator, and the classic
    record with its fields capped (readers then take the zip64 values)."""
    return (
        _END64.pack(
            _END64_SIGNATURE,
            44,  # the size of the rest of this record
            VERSION_ZIP64,
            VERSION_ZIP64,
            0,
            0,
            entries,
            entries,
            directory_size,
            directory_offset,
        )
        + _LOCATOR.pack(_LOCATOR_SIGNATURE, 0, directory_offset + directory_size, 1)
        + _END.pack(
            _END_SIGNATURE,
            0,
            0,
            min(entries, 0xFFFF),
            min(entries, 0xFFFF),
            min(directory_size, ZIP64_LIMIT),
            min(directory_offset, ZIP64_LIMIT),
            0,
        )
    )


# -----------------------------------------------------------------------------
# Where a tensor's bytes sit inside a `torch.save` record, read without loading it.
#
# Stock DCP stores every chunk as one `torch.save` record (a zip archive, entries
# stored uncompressed) inside a `.distcp` file. To read a sub-box of a chunk we
# need the offset of the storage payload and the tensor's dtype, shape, strides
# and storage offset. Both come from the record itself: the zip central
# directory (read by `zipfile` through a window on the file) and the tiny
# `data.pkl`, parsed by an unpickler that admits only the globals a plain
# tensor record uses and never rebuilds anything.
#
# torch.save writes two kinds of record: `_rebuild_tensor_v2` over a typed
# storage (`torch.FloatStorage`, ...) for the dtypes that have one, and
# `_rebuild_tensor_v3` over an `UntypedStorage` (sized in bytes) plus the dtype
# for the newer ones (`torch.storage._new_dtypes()`: float8, uint16/32/64, ...).
# Both are read here; `format.archive` writes them.
# -----------------------------------------------------------------------------


@dataclass(frozen=True)
class ArchiveLayout:
    """A tensor record: payload bytes at `payload_offset` (absolute, in the file)."""

    payload_offset: int
    payload_length: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    c_contiguous: bool  # payload holds the elements in C order from byte 0

    @property
    def nbytes(self) -> int:
        return nbytes(self.shape, self.dtype)


class _Window(io.RawIOBase):
    """A read-only, seekable view of `[start, start + length)` of an open file."""

    def __init__(self, file: RandomAccess, start: int, length: int) -> None:
        self._file, self._start, self._length, self._pos = file, start, length, 0

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
        data = self._file.pread(n, self._start + self._pos) if n else b""
        buffer[: len(data)] = data
        self._pos += len(data)
        return len(data)


# The most one read of a record's zip structures (its directory, `data.pkl`) may take: a
# tensor record's are a few hundred bytes; a crafted one claims what its file's size
# allows (a sparse 8 GiB file costs no disk), and is refused before a buffer exists.
ZIP_READ = 1 << 20


class _Capped(io.BufferedReader):
    """A buffered `_Window` that refuses any read of more than `ZIP_READ` bytes."""

    def read(self, size: int | None = -1) -> bytes:
        if size is None or size < 0:  # the rest of the record
            at = self.tell()
            size = self.seek(0, 2) - at
            self.seek(at)
        if size > ZIP_READ:
            raise ArchiveError(
                f"a read of {size} bytes of a tensor record's zip structures, more than the "
                f"{ZIP_READ} any holds (damaged or crafted)"
            )
        return super().read(size)


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
        dtype: object,
        plain: bool,
    ) -> None:
        if not isinstance(storage, _StorageRef) or not isinstance(dtype, torch.dtype):
            raise pickle.UnpicklingError(
                "malformed tensor rebuild call in a tensor record: no storage or no dtype"
            )
        try:
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


class _TensorArchiveUnpickler(pickle.Unpickler):
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


def read_archive_layout(file: RandomAccess, offset: int, length: int) -> ArchiveLayout:
    """Parse the `torch.save` record at `[offset, offset + length)` of `file`.

    Reads the record's first few KiB (its small entries come before the
    payload) or, failing that, its zip directory. Raises `ArchiveError` (a
    `ValueError`) when the record is not a single plain tensor.
    """
    head = file.pread(min(length, HEAD_BYTES), offset)
    try:
        fast = _scan_head(head)
    except (pickle.UnpicklingError, EOFError, struct.error, ValueError, TypeError):
        fast = None
    if fast is not None:
        args, data_start = fast
        return _layout(
            args, offset, data_start, args.storage.numel * args.storage.dtype.itemsize, length
        )
    return _read_via_directory(file, offset, length)


HEAD_BYTES = 4096  # what `read_archive_layout` reads first: a plain record's leading entries


def _stored_entry_at(head: bytes, pos: int) -> tuple[str, int]:
    """(entry name without the archive folder, data start) of the local header at `pos`."""
    header = local_header(head, pos)
    if header.method != STORED:
        raise ArchiveError("not a stored zip entry")
    at = pos + LOCAL_HEADER.size
    name = head[at : at + header.name_length].decode("utf-8", "replace")
    return name.split("/", 1)[-1], pos + header.data_offset


def _scan_head(head: bytes) -> tuple[_TensorArgs, int] | None:
    """Walk torch.save's leading entries: data.pkl (unpickled in place, which
    tells where it ends, since local headers carry no sizes), then the small
    entries up to the payload's header. None when anything is unusual."""
    name, start = _stored_entry_at(head, 0)
    if name != "data.pkl":
        return None
    stream = io.BytesIO(head[start:])
    args = _TensorArchiveUnpickler(stream).load()
    if not isinstance(args, _TensorArgs):
        return None
    pos = start + stream.tell()
    while True:
        pos = head.find(LOCAL_SIGNATURE, pos)
        if pos < 0 or pos + LOCAL_HEADER.size > len(head):
            return None
        name, data_start = _stored_entry_at(head, pos)
        if name == f"data/{args.storage.key}":
            return args, data_start
        pos = data_start


def _read_via_directory(file: RandomAccess, offset: int, length: int) -> ArchiveLayout:
    window = _Window(file, offset, length)
    try:
        with zipfile.ZipFile(_Capped(window)) as archive:
            infos = {i.filename.split("/", 1)[-1]: i for i in archive.infolist()}
            pkl = infos.get("data.pkl")
            if pkl is None:
                raise ArchiveError("no data.pkl in the record")
            args = _TensorArchiveUnpickler(io.BytesIO(archive.read(pkl))).load()
    except (zipfile.BadZipFile, pickle.UnpicklingError, EOFError, struct.error, TypeError) as e:
        raise ArchiveError(f"not a readable tensor record: {e}") from e
    if not isinstance(args, _TensorArgs):
        raise ArchiveError("the record holds something other than a single tensor")
    entry = infos.get(f"data/{args.storage.key}")
    if entry is None or entry.compress_type != zipfile.ZIP_STORED:
        raise ArchiveError("tensor payload missing or compressed")
    header = local_header(file.pread(LOCAL_HEADER.size, offset + entry.header_offset))
    data_start = entry.header_offset + header.data_offset
    return _layout(args, offset, data_start, entry.file_size, length)


def _layout(
    args: object, offset: int, data_start: int, data_size: int, length: int
) -> ArchiveLayout:
    if not isinstance(args, _TensorArgs):
        raise ArchiveError("the record holds something other than a single tensor")
    if data_size < 0:
        raise ArchiveError(f"tensor payload of {data_size} bytes")
    if data_start + data_size > length:
        raise ArchiveError("tensor payload runs past the end of the record")
    shape = args.size
    contiguous = (
        args.plain
        and args.offset == 0
        and (
            math.prod(shape) <= 1
            or all(st == c for st, c, s in zip(args.stride, c_strides(shape), shape) if s > 1)
        )
    )
    if contiguous and data_size < nbytes(shape, args.dtype):  # the storage must hold them all
        raise ArchiveError(
            f"tensor payload of {data_size} bytes, fewer than its {tuple(shape)} "
            f"{args.dtype} elements need ({nbytes(shape, args.dtype)})"
        )
    return ArchiveLayout(offset + data_start, data_size, args.dtype, shape, contiguous)


# -----------------------------------------------------------------------------
# Tensors as `torch.save` records written straight from their memory: the write side of records.
#
# The same archive torch.save(tensor) writes (entries stored, data aligned to
# 64 bytes, CRCs 0 as with torch.serialization.set_crc32_options(False)),
# produced directly so the payload goes from tensor memory to the file with
# no copy and no pickling machinery per tensor. `format.archive` reads them back.
# -----------------------------------------------------------------------------

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


def tensor_archive(
    t: torch.Tensor, serialization_id: str = "0" * 40
) -> tuple[bytes, memoryview, bytes]:
    """`(head, payload, tail)` of the record `torch.save(t)` would write; `t` must be a
    contiguous CPU tensor. The payload is `t`'s own memory (a copy only when `t` has a
    conjugate or negative bit); it starts at `len(head)`."""
    t = _plain(t)
    payload = byte_view(t) if t.numel() else memoryview(b"")
    head, tail = archive_frame(t.dtype, tuple(t.shape), serialization_id)
    return head, payload, tail


def archive_frame(
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
    """`archive_frame`, cached: a state of many like-shaped tensors builds each frame once."""
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
