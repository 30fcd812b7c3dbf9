"""`convert`: a checkpoint to one consolidated file and back, through a registry of targets.

Each output format is a `Target` in `TARGETS` saying what it can be written
from (a checkpoint folder, a `.safetensors` file); `convert` looks the format
up, and the command line offers the same names. Everything streams tensor by
tensor, so memory holds one tensor at a time.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ...comm.agreement import Agreement
from ...comm.communicator import SingleProcess
from ...errors import CheckpointExistsError, InvalidArgumentError, UnsupportedStorageError
from ...storage import Folder, Sink, is_url, open_folder
from ...storage.folder import temporary_name
from ..engine import save_state
from ..format import byte_view, write_torch_archive
from ..io import in_the_way
from .opening import OpenCheckpoint, listed, open_checkpoint

__all__ = ["TARGETS", "Target", "convert"]

log = logging.getLogger("shardwise")

# Every dtype the safetensors format defines that torch has (F6_* it has not).
_SAFETENSORS_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint64: "U64",
    torch.uint32: "U32",
    torch.uint16: "U16",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.complex64: "C64",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e4m3fnuz: "F8_E4M3FNUZ",
    torch.float8_e5m2: "F8_E5M2",
    torch.float8_e5m2fnuz: "F8_E5M2FNUZ",
    torch.float8_e8m0fnu: "F8_E8M0",
    torch.float4_e2m1fn_x2: "F4",
}
_FROM_SAFETENSORS = {v: k for k, v in _SAFETENSORS_DTYPES.items()}
# torch's element of F4 packs 2 of the format's: a header's shape counts the format's
# elements, so its last dimension is twice the tensor's (as safetensors writes it)
_PACKED = {"F4": 2}


def _header_shape(dtype: str, shape: tuple[int, ...]) -> list[int]:
    """The shape a safetensors header gives a tensor of `shape` and `dtype`."""
    per = _PACKED.get(dtype, 1)
    return [*shape[:-1], shape[-1] * per] if per > 1 else list(shape)


def _tensor_shape(dtype: str, header: list[int]) -> tuple[int, ...]:
    """`_header_shape` undone: the torch tensor's shape."""
    per = _PACKED.get(dtype, 1)
    return (*header[:-1], header[-1] // per) if per > 1 else tuple(header)


# (open checkpoint, output, max_file_size, overwrite) -> files written
FromCheckpoint = Callable[[OpenCheckpoint, "_Output", int | None, bool], list[Any]]
# (open safetensors file, output, overwrite) -> files written
FromSafetensors = Callable[[Any, "_Output", bool], list[Any]]


@dataclass(frozen=True)
class _Output:
    """Where a conversion writes: a file (or folder) `name` in `folder`, local or remote."""

    folder: Folder
    name: str
    location: Path | str  # as the caller named it, returned in the list of files written
    storage_options: dict[str, Any] | None = None

    def sibling(self, name: str) -> _Output:
        where = (
            Path(self.location).with_name(name)
            if isinstance(self.location, Path)
            else f"{self.location.rsplit('/', 1)[0]}/{name}"
        )
        return _Output(self.folder, name, where, self.storage_options)


def _output(out: str | os.PathLike, storage_options: dict[str, Any] | None) -> _Output:
    if is_url(out):
        text = str(out).rstrip("/")
        parent, name = text.rsplit("/", 1)
        return _Output(open_folder(parent, storage_options), name, text, storage_options)
    path = Path(out)
    return _Output(open_folder(path.parent), path.name, path, storage_options)


@dataclass(frozen=True)
class Target:
    """One output format: how to write it from each source it accepts (None: not
    accepted), whether it writes a file at `out` (else a checkpoint folder), and
    whether it stores a checkpoint's non-tensor values (else `convert` names each
    one it dropped)."""

    from_checkpoint: FromCheckpoint | None = None
    from_safetensors: FromSafetensors | None = None
    writes_file: bool = True
    stores_objects: bool = False


def convert(
    path: str | os.PathLike,
    out: str | os.PathLike,
    format: str = "safetensors",
    *,
    max_file_size: int | None = None,
    overwrite: bool = False,
    storage_options: dict[str, Any] | None = None,
    progress: Callable[[int], None] | None = None,
) -> list[Path | str]:
    """Convert between a checkpoint and one consolidated file; returns the files written.

    * checkpoint -> `safetensors` (split into `-0000k-of-0000n` files plus an
      index, as Hugging Face does, when `max_file_size` is exceeded) or `torch`
      (a file `torch.load(..., weights_only=True)` reads). Tensors only: the
      checkpoint's non-tensor values (`step`, `param_groups`, ...) are dropped,
      and a warning on the `shardwise` logger names each one once the files are
      written.
    * a `.safetensors` file -> `shardwise` (a checkpoint folder) or `torch`.

    Streams tensor by tensor: memory holds one tensor at a time. The formats
    are the keys of `TARGETS`. `path` and `out` may be fsspec URLs (a
    `.safetensors` input is read from a local file), `storage_options` their
    backend's options. `progress(n)` is called with the bytes of each tensor as it
    is read (they add up to the tensors' bytes), as `verify`'s is.

    Without `overwrite`, nothing is written when any file the export would write
    is already there (for `safetensors`, also the single file or index of the
    other mode). With it, a `safetensors` export replaces the old one as a whole:
    its files are written under temporary names first (a failure leaves the old
    export as it was), then renamed; once the new files and index are durable,
    the old export's files that would still look current (its index, the shards
    that index names, a single file the index now stands for) are removed; no
    other file is touched.
    """
    if max_file_size is not None and (
        isinstance(max_file_size, bool) or not isinstance(max_file_size, int) or max_file_size < 1
    ):
        raise InvalidArgumentError(
            f"max_file_size must be None or an int of at least 1 byte, got {max_file_size!r}"
        )
    target = _output(out, storage_options)
    at_out = open_folder(out, storage_options)
    kind = TARGETS.get(format)
    if kind is not None and kind.writes_file and at_out.is_folder() and not at_out.is_file():
        # a rename onto a folder fails only after the whole file is written, and
        # overwrite=True never means "replace a folder with a file"
        raise InvalidArgumentError(
            f"cannot convert to {at_out.location}: it is a folder, and format {format!r} "
            "writes one file; name a file path instead (nothing was written)"
        )
    existing = in_the_way(at_out, files=True)
    if existing and not overwrite:
        raise CheckpointExistsError(existing)
    source = open_folder(path, storage_options)
    if source.is_file():
        local = source.local_path
        if local is None:
            raise UnsupportedStorageError(
                f"cannot convert {path}: a .safetensors input is read from a local file"
            )
        try:
            from safetensors import safe_open  # the `safetensors` extra
        except ImportError as e:
            raise UnsupportedStorageError(
                f"cannot convert {path}: reading a .safetensors file needs the safetensors "
                "package (pip install 'shardwise[safetensors]')"
            ) from e

        with safe_open(str(local), framework="pt") as f:
            from_file = _lookup(format, "safetensors", "a safetensors file")
            _check_safetensors_dtypes(f, local)
            return from_file(_Counted(f, progress), target, overwrite)
    ckpt = open_checkpoint(source)
    ckpt.on_read = progress
    from_checkpoint = _lookup(format, "checkpoint", "a checkpoint")
    written = from_checkpoint(ckpt, target, max_file_size, overwrite)
    dropped = sorted(ckpt.object_keys())
    if dropped and not TARGETS[format].stores_objects:
        log.warning(_dropped_objects(format, dropped))
    return written


def _dropped_objects(format: str, keys: list[str]) -> str:
    """The warning of a conversion to `format` that left out the non-tensor values `keys`."""
    return (
        f"dropped {len(keys)} non-tensor value{'s' if len(keys) > 1 else ''} that format "
        f"{format!r} cannot store (it holds tensors only): {listed(keys)}; load them from "
        "the checkpoint itself (swc.load) if you need them"
    )


class _Counted:
    """An open safetensors file whose `get_tensor` reports each tensor's bytes."""

    def __init__(self, f: Any, progress: Callable[[int], None] | None) -> None:
        self._f, self._progress = f, progress

    def __getattr__(self, name: str) -> Any:
        return getattr(self._f, name)

    def get_tensor(self, key: str) -> torch.Tensor:
        t = self._f.get_tensor(key)
        if self._progress:
            self._progress(t.nbytes)
        return t


def _lookup(format: str, source: str, what: str) -> Callable[..., list[Any]]:
    """`TARGETS[format]`'s converter from `source`; the error names every format that has one."""
    target = TARGETS.get(format)
    found: Callable[..., list[Any]] | None = getattr(target, f"from_{source}", None)
    if found is None:
        names = sorted(repr(n) for n, t in TARGETS.items() if getattr(t, f"from_{source}"))
        raise InvalidArgumentError(
            f"unknown format {format!r} for {what}; use {' or '.join(names)}"
        )
    return found


def _write_file(out: _Output, write: Callable[[Sink], object]) -> None:
    out.folder.make()
    out.folder.write_atomically(out.name, write, sync=True)


def _checkpoint_to_torch(
    ckpt: OpenCheckpoint, out: _Output, max_file_size: int | None, overwrite: bool
) -> list[Path | str]:
    # one file, `out` itself: `convert` has checked it
    keys = ckpt.tensor_keys()
    items = [
        (k, ckpt.tensor_metadata(k).properties.dtype, tuple(ckpt.tensor_metadata(k).size))
        for k in keys
    ]
    _write_file(out, lambda sink: write_torch_archive(sink, items, lambda i: ckpt.read(keys[i])))
    return [out.location]


def _checkpoint_to_safetensors(
    ckpt: OpenCheckpoint, out: _Output, max_file_size: int | None, overwrite: bool
) -> list[Path | str]:
    keys = ckpt.tensor_keys()
    groups: list[list[str]] = [[]]
    size = 0
    for key in keys:
        dtype = ckpt.tensor_metadata(key).properties.dtype
        if dtype not in _SAFETENSORS_DTYPES:
            raise InvalidArgumentError(f"'{key}' has dtype {dtype}, which safetensors cannot store")
        if _SAFETENSORS_DTYPES[dtype] in _PACKED and not ckpt.tensor_metadata(key).size:
            raise InvalidArgumentError(
                f"'{key}' is a 0-d tensor of dtype {dtype}: safetensors stores that dtype's "
                "pairs along a last dimension; give it one"
            )
        n = ckpt.tensor_nbytes(key)
        if max_file_size and groups[-1] and size + n > max_file_size:
            groups.append([])
            size = 0
        groups[-1].append(key)
        size += n
    files = _safetensors_files(out, groups)
    index_file = out.sibling(_index_name(out.name))
    # every name is known from the metadata alone: checked before any file is written
    stale = _stale_export(out, [f.name for f in files], overwrite)
    folder = out.folder
    folder.make()
    # every file is written under a temporary name first: a failure (a read, the disk)
    # leaves the old export as it was, and only renames remain once all are durable
    staged: list[str] = []
    try:
        for file, group in zip(files, groups):
            sink = folder.create(temporary_name(file.name))
            try:
                _write_safetensors(sink, keys=group, ckpt=ckpt)
                sink.close(sync=True)
            except BaseException:
                sink.abort()
                raise
            staged.append(sink.name)
    except BaseException:
        for name in staged:
            with contextlib.suppress(OSError):  # the failure, not the cleanup, is reported
                folder.remove(name)
        raise
    split = len(files) > 1
    if split and folder.removable(index_file.name) and any(folder.has(f.name) for f in files):
        # the renames replace shards the old index names: without it, a rename cut
        # short leaves no export looking current rather than a mixed one
        folder.remove(index_file.name)
    for i, (name, file) in enumerate(zip(staged, files)):
        try:
            folder.replace(name, file.name)
        except BaseException:
            for left in staged[i:]:  # the temporaries not renamed yet: nothing will
                with contextlib.suppress(OSError):
                    folder.remove(left)
            raise
    if split:
        index = {
            "metadata": {"total_size": sum(ckpt.tensor_nbytes(k) for k in keys)},
            "weight_map": {k: f.name for f, g in zip(files, groups) for k in g},
        }
        folder.write_durably(index_file.name, json.dumps(index, indent=2).encode())
        files.append(index_file)
    folder.sync()  # the new set's names are durable before the old set goes
    for name in stale:
        folder.remove(name)
    return [f.location for f in files]


def _safetensors_files(out: _Output, groups: list[list[str]]) -> list[_Output]:
    if len(groups) == 1:
        return [out]
    stem = out.name.removesuffix(".safetensors")
    return [
        out.sibling(f"{stem}-{i + 1:05d}-of-{len(groups):05d}.safetensors")
        for i in range(len(groups))
    ]


def _index_name(name: str) -> str:
    """`model.safetensors.index.json`: the index of a split export named `name`."""
    return name.removesuffix(".safetensors") + ".safetensors.index.json"


_INDEX_BYTES = 64 << 20  # far above any real index; a larger one is not read
_SHARD = r"-\d{5,}-of-\d{5,}\.safetensors"  # how `_safetensors_files` names a split's files


def _stale_export(out: _Output, shards: list[str], overwrite: bool) -> list[str]:
    """The files of an export already named `out` that the new one (`shards`, plus
    its index when split) leaves looking current, in the order to remove them: the
    index first, so the old set stops being current before any of it goes.

    Without `overwrite`, `CheckpointExistsError` naming every such file that exists
    (a split export's index, the single file, a shard name the new one uses).
    Only the old export's own files can be stale: the other mode's index or single
    file (`out` itself, which `overwrite` gives leave to replace), and the shards its
    index names that follow the `<stem>-NNNNN-of-MMMMM` pattern; any other file,
    a shard no index names included, is never touched. Links are never removed."""
    folder = out.folder
    split = len(shards) > 1
    index = _index_name(out.name)
    new = {*shards, index} if split else {out.name}
    if not overwrite:
        found = [n for n in sorted({*new, out.name, index}) if folder.has(n)]
        if found:
            where = ", ".join(folder.where(n) for n in found)
            raise CheckpointExistsError(
                f"{where} already exist{'s' if len(found) == 1 else ''} (an export named "
                f"{out.name}); pass overwrite=True to replace it"
            )
        return []
    stale = [] if split else [index]  # a new split export rewrites the index itself
    pattern = re.compile(re.escape(out.name.removesuffix(".safetensors")) + _SHARD)
    stale += sorted(n for n in _indexed_files(folder, index) if pattern.fullmatch(n))
    if split:
        stale.append(out.name)  # it would shadow the index: loaders take it first
    return [n for n in dict.fromkeys(stale) if n not in new and folder.removable(n)]


def _indexed_files(folder: Folder, index: str) -> set[str]:
    """The files an existing index names; none when it is missing or unreadable (an
    index is untrusted: it is parsed, never followed outside the folder)."""
    if not folder.removable(index):
        return set()
    try:  # a larger index is refused unread (CorruptCheckpointError, an OSError)
        weight_map = json.loads(folder.read(index, limit=_INDEX_BYTES)).get("weight_map")
    except (OSError, ValueError, AttributeError, RecursionError):
        return set()
    if not isinstance(weight_map, dict):
        return set()
    return {v for v in weight_map.values() if isinstance(v, str)}


def _write_safetensors(sink: Sink, keys: list[str], ckpt: OpenCheckpoint) -> None:
    """The safetensors layout: 8-byte header size, JSON header, tensor bytes in order;
    written tensor by tensor so memory holds one at a time."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt", "source": "shardwise"}}
    offset = 0
    for key in keys:
        md = ckpt.tensor_metadata(key)
        n = ckpt.tensor_nbytes(key)
        header_dtype = _SAFETENSORS_DTYPES[md.properties.dtype]  # checked before any write
        header[key] = {
            "dtype": header_dtype,
            "shape": _header_shape(header_dtype, tuple(md.size)),
            "data_offsets": [offset, offset + n],
        }
        offset += n
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    sink.write([struct.pack("<Q", len(text)), text])
    for key in keys:
        t = ckpt.read(key)
        if t.numel():
            sink.write([byte_view(t)])


def _check_safetensors_dtypes(f: Any, file: Path) -> None:
    """Refuse, before anything is written, a tensor of a dtype the converters have
    no torch dtype for (`_SAFETENSORS_DTYPES`), or a packed one whose shape no torch
    tensor has, naming its key, dtype and file (safetensors' own error names neither)."""
    for key in f.keys():
        piece = f.get_slice(key)
        dtype = piece.get_dtype()
        if dtype not in _FROM_SAFETENSORS:
            raise InvalidArgumentError(
                f"'{key}' in {file} has safetensors dtype {dtype}, which shardwise does not "
                f"convert (it converts {', '.join(sorted(_FROM_SAFETENSORS))})"
            )
        shape = piece.get_shape()
        if dtype in _PACKED and (not shape or shape[-1] % _PACKED[dtype]):
            raise InvalidArgumentError(
                f"'{key}' in {file} has safetensors dtype {dtype} and shape {shape}: torch "
                f"holds {_PACKED[dtype]} of its elements in one, along the last dimension"
            )


def _safetensors_to_torch(f: Any, out: _Output, overwrite: bool) -> list[Path | str]:
    keys = list(f.keys())
    first = {k: f.get_slice(k) for k in keys}
    items = [
        (
            k,
            _FROM_SAFETENSORS[first[k].get_dtype()],  # checked by `convert`
            _tensor_shape(first[k].get_dtype(), first[k].get_shape()),
        )
        for k in keys
    ]
    _write_file(out, lambda sink: write_torch_archive(sink, items, lambda i: f.get_tensor(keys[i])))
    return [out.location]


def _safetensors_to_shardwise(f: Any, out: _Output, overwrite: bool) -> list[Path | str]:
    tensors = {k: f.get_tensor(k) for k in f.keys()}  # mmap-backed: pages load as written
    # one process: the engine itself, under the path's lease (`convert` checked the target)
    folder = open_folder(out.location, out.storage_options)
    save_state(tensors, folder, Agreement(SingleProcess()), overwrite=overwrite)
    return [out.location]


TARGETS: dict[str, Target] = {
    "safetensors": Target(from_checkpoint=_checkpoint_to_safetensors),
    "torch": Target(_checkpoint_to_torch, _safetensors_to_torch),
    "shardwise": Target(from_safetensors=_safetensors_to_shardwise, writes_file=False),
}
