"""Where a tensor's bytes sit inside a `torch.save` record, read without loading it.

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
Both are read here; `record_write` writes them.
"""

from __future__ import annotations

import io
import math
import operator
import pickle
import struct
import zipfile
from dataclasses import dataclass

import torch

from ...storage import RandomAccess
from .byte_runs import c_strides, nbytes
from .zip_format import LOCAL_HEADER, LOCAL_SIGNATURE, STORED, RecordError, local_header

__all__ = ["HEAD_BYTES", "RecordLayout", "read_record_layout"]


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
            raise RecordError(
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


def read_record_layout(file: RandomAccess, offset: int, length: int) -> RecordLayout:
    """Parse the `torch.save` record at `[offset, offset + length)` of `file`.

    Reads the record's first few KiB (its small entries come before the
    payload) or, failing that, its zip directory. Raises `RecordError` (a
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


HEAD_BYTES = 4096  # what `read_record_layout` reads first: a plain record's leading entries


def _stored_entry_at(head: bytes, pos: int) -> tuple[str, int]:
    """(entry name without the archive folder, data start) of the local header at `pos`."""
    header = local_header(head, pos)
    if header.method != STORED:
        raise RecordError("not a stored zip entry")
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
    args = _TensorRecordUnpickler(stream).load()
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


def _read_via_directory(file: RandomAccess, offset: int, length: int) -> RecordLayout:
    window = _Window(file, offset, length)
    try:
        with zipfile.ZipFile(_Capped(window)) as archive:
            infos = {i.filename.split("/", 1)[-1]: i for i in archive.infolist()}
            pkl = infos.get("data.pkl")
            if pkl is None:
                raise RecordError("no data.pkl in the record")
            args = _TensorRecordUnpickler(io.BytesIO(archive.read(pkl))).load()
    except (zipfile.BadZipFile, pickle.UnpicklingError, EOFError, struct.error, TypeError) as e:
        raise RecordError(f"not a readable tensor record: {e}") from e
    if not isinstance(args, _TensorArgs):
        raise RecordError("the record holds something other than a single tensor")
    entry = infos.get(f"data/{args.storage.key}")
    if entry is None or entry.compress_type != zipfile.ZIP_STORED:
        raise RecordError("tensor payload missing or compressed")
    header = local_header(file.pread(LOCAL_HEADER.size, offset + entry.header_offset))
    data_start = entry.header_offset + header.data_offset
    return _layout(args, offset, data_start, entry.file_size, length)


def _layout(
    args: object, offset: int, data_start: int, data_size: int, length: int
) -> RecordLayout:
    if not isinstance(args, _TensorArgs):
        raise RecordError("the record holds something other than a single tensor")
    if data_size < 0:
        raise RecordError(f"tensor payload of {data_size} bytes")
    if data_start + data_size > length:
        raise RecordError("tensor payload runs past the end of the record")
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
        raise RecordError(
            f"tensor payload of {data_size} bytes, fewer than its {tuple(shape)} "
            f"{args.dtype} elements need ({nbytes(shape, args.dtype)})"
        )
    return RecordLayout(offset + data_start, data_size, args.dtype, shape, contiguous)
