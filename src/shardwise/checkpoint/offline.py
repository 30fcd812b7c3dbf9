"""Offline tools: one process, no process group, memory bounded by one tensor or chunk.

`open_checkpoint` reads the metadata once; `inspect` describes a checkpoint,
`verify` recomputes every checksum and checks coverage, `convert` writes one
consolidated safetensors or torch file (or turns a safetensors file into a
checkpoint), and `reshard` rewrites a checkpoint into the per-rank files of
another layout. Works on shardwise and stock DCP checkpoints alike.
"""

from __future__ import annotations

import json
import math
import os
import pickle
import struct
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import crc32c
import torch
from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, ReadItem

from ..errors import CorruptCheckpointError, IncompleteCheckpointError
from ..layout import Block, Layout
from ..layout.coverage import analyze
from .commit import (
    already_exists,
    commit,
    data_file_name,
    holds_checkpoint,
    new_token,
    write_durably,
)
from .manifest import ChunkEntry, Manifest, ObjectEntry, TensorEntry, dtype_name
from .records import tensor_record, write_torch_archive
from .storage import Reader, pages_of, write_all

__all__ = [
    "CheckpointInfo",
    "OpenCheckpoint",
    "TensorInfo",
    "convert",
    "inspect",
    "open_checkpoint",
    "reshard",
    "verify",
]


class OpenCheckpoint:
    """A checkpoint opened for reading in this process: metadata read once."""

    def __init__(self, path: str | os.PathLike, *, verify: bool = True) -> None:
        self.path = Path(path)
        self.reader = Reader(self.path, verify=verify)
        self.metadata = self.reader.read_metadata()
        self.reader.set_up_storage_reader(self.metadata, True)

    @property
    def manifest(self) -> Manifest | None:
        return self.reader.manifest

    def tensor_keys(self) -> list[str]:
        return [
            k
            for k, md in self.metadata.state_dict_metadata.items()
            if isinstance(md, TensorStorageMetadata)
        ]

    def object_keys(self) -> list[str]:
        return [
            k
            for k, md in self.metadata.state_dict_metadata.items()
            if not isinstance(md, TensorStorageMetadata)
        ]

    def tensor_metadata(self, fqn: str) -> TensorStorageMetadata:
        md = self.metadata.state_dict_metadata.get(fqn)
        if md is None:
            raise KeyError(f"no tensor '{fqn}' in {self.path}")
        if not isinstance(md, TensorStorageMetadata):
            raise KeyError(f"'{fqn}' in {self.path} is a Python object, not a tensor")
        return md

    def read(self, fqn: str, region: Block | None = None) -> torch.Tensor:
        """Tensor `fqn`, or only `region` of it (global coordinates): only those bytes are read."""
        md = self.tensor_metadata(fqn)
        shape = tuple(md.size)
        if region is None:
            region = Block((0,) * len(shape), shape)
        if region.ndim != len(shape) or any(e > s for e, s in zip(region.ends, shape)):
            raise ValueError(f"region {region} is out of bounds of '{fqn}' with shape {shape}")
        out = torch.empty(region.sizes, dtype=md.properties.dtype)
        items = []
        for chunk in md.chunks:
            stored = Block(tuple(chunk.offsets), tuple(chunk.sizes))
            overlap = stored.intersect(region)
            if overlap is None:
                continue
            items.append(
                ReadItem(
                    type=LoadItemType.TENSOR,
                    dest_index=MetadataIndex(fqn, region.offsets),
                    dest_offsets=torch.Size(overlap.relative_to(region).offsets),
                    storage_index=MetadataIndex(fqn, chunk.offsets),
                    storage_offsets=torch.Size(overlap.relative_to(stored).offsets),
                    lengths=torch.Size(overlap.sizes),
                )
            )
        self.reader.read_data(_Plan(items), _IntoTensor(out)).wait()
        return out

    def object_bytes(self, fqn: str) -> bytes:
        """The stored bytes of object `fqn`, verified, not unpickled."""
        info = self.reader.storage_data[MetadataIndex(fqn)]
        with open(self.path / info.relative_path, "rb") as f:
            f.seek(info.offset)
            data = f.read(info.length)
        entry = self.manifest.objects.get(fqn) if self.manifest else None
        if len(data) != info.length or (entry is not None and crc32c.crc32c(data) != entry.crc32c):
            raise CorruptCheckpointError(
                f"object '{fqn}' in {self.path / info.relative_path} is damaged"
            )
        return data


def open_checkpoint(path: str | os.PathLike, *, verify: bool = True) -> OpenCheckpoint:
    return OpenCheckpoint(path, verify=verify)


class _Plan:
    def __init__(self, items: list[ReadItem]) -> None:
        self.items = items


class _IntoTensor:
    """The two LoadPlanner calls `Reader.read_data` makes, aimed at one tensor."""

    def __init__(self, out: torch.Tensor) -> None:
        self.out = out

    def resolve_tensor(self, req: ReadItem) -> torch.Tensor:
        return self.out[tuple(slice(o, o + n) for o, n in zip(req.dest_offsets, req.lengths))]

    def commit_tensor(self, req: ReadItem, tensor: torch.Tensor) -> None:
        pass


# -- inspect ----------------------------------------------------------------------------


@dataclass
class TensorInfo:
    key: str
    dtype: str
    shape: tuple[int, ...]
    chunks: int
    nbytes: int
    sharding: str


@dataclass
class CheckpointInfo:
    path: Path
    kind: str  # "shardwise" or "stock DCP"
    format_version: int | None
    world_size: int | None
    tensors: list[TensorInfo] = field(default_factory=list)
    objects: list[str] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    def to_json(self) -> dict[str, Any]:
        return {
            "path": str(self.path),
            "kind": self.kind,
            "format_version": self.format_version,
            "world_size": self.world_size,
            "bytes": self.nbytes,
            "tensors": {
                t.key: {
                    "dtype": t.dtype,
                    "shape": list(t.shape),
                    "chunks": t.chunks,
                    "bytes": t.nbytes,
                    "sharding": t.sharding,
                }
                for t in self.tensors
            },
            "objects": self.objects,
        }


def describe_sharding(shape: tuple[int, ...], chunks: list[Block]) -> str:
    """How a tensor's chunks cut it, in words: whole, row-wise, column-wise, grid, blocks."""
    if len(chunks) == 1 and chunks[0].sizes == shape:
        return "whole"
    cut = sorted({d for c in chunks for d in range(len(shape)) if c.sizes[d] != shape[d]})
    if len(cut) == 1:
        d = cut[0]
        sizes = {c.sizes[d] for c in chunks}
        name = {0: "row-wise", 1: "column-wise"}.get(d, f"along dim {d}")
        return f"{name}, {len(chunks)} parts" + (" (uneven)" if len(sizes) > 1 else "")
    parts = [len({c.offsets[d] for c in chunks}) for d in cut]
    if math.prod(parts) == len(chunks):
        return "grid " + "x".join(map(str, parts)) + f" over dims {cut}"
    return f"{len(chunks)} blocks"


def inspect(path: str | os.PathLike) -> CheckpointInfo:
    """What a checkpoint holds, from its metadata alone (no data read)."""
    ckpt = open_checkpoint(path)
    m = ckpt.manifest
    info = CheckpointInfo(
        ckpt.path,
        "shardwise" if m else "stock DCP",
        m.version if m else None,
        m.world_size if m else None,
    )
    for key in ckpt.tensor_keys():
        md = ckpt.tensor_metadata(key)
        shape = tuple(md.size)
        blocks = [Block(tuple(c.offsets), tuple(c.sizes)) for c in md.chunks]
        itemsize = torch.empty((), dtype=md.properties.dtype).element_size()
        info.tensors.append(
            TensorInfo(
                key,
                dtype_name(md.properties.dtype),
                shape,
                len(blocks),
                math.prod(shape) * itemsize,
                describe_sharding(shape, blocks),
            )
        )
    info.tensors.sort(key=lambda t: t.key)
    info.objects = sorted(ckpt.object_keys())
    return info


# -- verify -----------------------------------------------------------------------------


def verify(
    path: str | os.PathLike,
    progress: Callable[[int], None] | None = None,
    *,
    raise_on_error: bool = True,
) -> list[str]:
    """Check a whole checkpoint; raise, listing every problem found, unless it is sound.

    Recomputes every checksum page (shardwise checkpoints), checks that every
    tensor's chunks cover it exactly once, and that every record is readable.
    `progress(n)` is called with the bytes checked so far, as they are.

    Raises `IncompleteCheckpointError` when the save never committed, else
    `CorruptCheckpointError`; the message lists every problem and the
    exception's `problems` holds them, one line each. A path that holds no
    checkpoint at all raises `FileNotFoundError`.

    `raise_on_error=False` is the reporting form: the same problems are
    returned instead of raised (empty: the checkpoint is sound), for callers
    that show or count them. A sound checkpoint returns `[]` either way.
    """
    kind, problems = _find_problems(path, progress)
    if problems and raise_on_error:
        count = f"{len(problems)} problem{'s' if len(problems) > 1 else ''}"
        raise kind(f"{path} fails verification, {count}: " + "; ".join(problems), problems=problems)
    return problems


def _find_problems(
    path: str | os.PathLike, progress: Callable[[int], None] | None
) -> tuple[type[CorruptCheckpointError | IncompleteCheckpointError], list[str]]:
    """(the error that fits, every problem found) for `verify`."""
    try:
        ckpt = open_checkpoint(path)
    except IncompleteCheckpointError as e:
        return IncompleteCheckpointError, [str(e)]
    except FileNotFoundError as e:
        if e.filename is None:
            raise  # the reader found no checkpoint there: nothing is damaged, nothing to verify
        return CorruptCheckpointError, [f"{path}: {e}"]  # a file the checkpoint needs is gone
    except (OSError, ValueError, pickle.UnpicklingError) as e:  # unreadable metadata or manifest
        return CorruptCheckpointError, [f"{path}: {e}"]
    problems = []
    for key in ckpt.tensor_keys():
        md = ckpt.tensor_metadata(key)
        blocks = [Block(tuple(c.offsets), tuple(c.sizes)) for c in md.chunks]
        found = analyze(list(dict.fromkeys(b for b in blocks if not b.is_empty())), tuple(md.size))
        if found.out_of_bounds or found.overlap or found.hole is not None:
            what = (
                f"chunk {found.out_of_bounds} is out of bounds"
                if found.out_of_bounds
                else f"chunks {found.overlap[0]} and {found.overlap[1]} overlap"
                if found.overlap
                else f"element {found.hole} is in no chunk"
            )
            problems.append(f"'{key}': {what} (shape {tuple(md.size)})")
    if ckpt.manifest is None:
        for key in ckpt.tensor_keys():  # stock: no checksums; check every record reads
            try:
                ckpt.read(key)
            except (OSError, ValueError) as e:
                problems.append(f"'{key}': {e}")
            if progress:
                md = ckpt.tensor_metadata(key)
                progress(md.size.numel() * md.properties.dtype.itemsize)
        return CorruptCheckpointError, problems
    metadata = ckpt.path / ".metadata"
    try:
        if crc32c.crc32c(metadata.read_bytes()) != ckpt.manifest.metadata_crc32c:
            problems.append(
                f"{metadata} does not match the manifest's checksum: damaged, or a save was interrupted "
                f"between its two records; stock DCP readers see something else than shardwise readers"
            )
    except OSError as e:
        problems.append(f"{metadata}: {e}")
    page = ckpt.manifest.page_size
    for key, entry in ckpt.manifest.tensors.items():
        for chunk in entry.chunks:
            problems += _verify_chunk(ckpt.path, key, chunk, page, progress)
    for key, obj in ckpt.manifest.objects.items():
        try:
            ckpt.object_bytes(key)
        except (OSError, CorruptCheckpointError) as e:
            problems.append(str(e))
    return CorruptCheckpointError, problems


def _verify_chunk(
    folder: Path, key: str, chunk: ChunkEntry, page: int, progress: Callable[[int], None] | None
) -> list[str]:
    path = folder / chunk.file
    if (
        chunk.payload is None
    ):  # stored through a transform (e.g. zstd): one checksum over the record
        try:
            with open(path, "rb") as f:
                data = os.pread(f.fileno(), chunk.record[1], chunk.record[0])
        except OSError as e:
            return [f"'{key}' chunk at {chunk.offsets}: {e}"]
        if progress:
            progress(len(data))
        if len(data) != chunk.record[1] or crc32c.crc32c(data) != chunk.pages[0]:
            return [
                f"'{key}' chunk at {chunk.offsets}: bytes {chunk.record[0]}..{sum(chunk.record)} of {path} "
                f"fail their checksum"
            ]
        return []
    start, length = chunk.payload
    try:
        with open(path, "rb") as f:
            f.seek(chunk.record[0])
            head = f.read(start - chunk.record[0])
            f.seek(start + length)
            tail = f.read(sum(chunk.record) - start - length)
            if crc32c.crc32c(tail, crc32c.crc32c(head)) != chunk.frame:
                return [
                    f"'{key}' chunk at {chunk.offsets}: the torch.save record framing in {path} "
                    f"(bytes {chunk.record[0]}..{sum(chunk.record)}) fails its checksum"
                ]
            for i, expected in enumerate(chunk.pages):
                f.seek(start + i * page)
                data = f.read(min(page, length - i * page))
                lo = start + i * page
                if len(data) != min(page, length - i * page):
                    return [
                        f"'{key}' chunk at {chunk.offsets}: {path} is truncated at byte {lo + len(data)}"
                    ]
                if crc32c.crc32c(data) != expected:
                    return [
                        f"'{key}' chunk at {chunk.offsets}: bytes {lo}..{lo + len(data)} of {path} fail their checksum"
                    ]
                if progress:
                    progress(len(data))
    except OSError as e:
        return [f"'{key}' chunk at {chunk.offsets}: {e}"]
    return []


# -- convert ----------------------------------------------------------------------------

_SAFETENSORS_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}
_FROM_SAFETENSORS = {v: k for k, v in _SAFETENSORS_DTYPES.items()}


def _safetensors_files(out: Path, groups: list[list[str]]) -> list[Path]:
    if len(groups) == 1:
        return [out]
    stem = out.name.removesuffix(".safetensors")
    return [
        out.with_name(f"{stem}-{i + 1:05d}-of-{len(groups):05d}.safetensors")
        for i in range(len(groups))
    ]


def _write_safetensors(fd: int, keys: list[str], ckpt: OpenCheckpoint) -> None:
    """The safetensors layout: 8-byte header size, JSON header, tensor bytes in order;
    written tensor by tensor so memory holds one at a time."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt", "source": "shardwise"}}
    offset = 0
    for key in keys:
        md = ckpt.tensor_metadata(key)
        dtype = md.properties.dtype
        if dtype not in _SAFETENSORS_DTYPES:
            raise ValueError(f"'{key}' has dtype {dtype}, which safetensors cannot store")
        n = md.size.numel() * torch.empty((), dtype=dtype).element_size()
        header[key] = {
            "dtype": _SAFETENSORS_DTYPES[dtype],
            "shape": list(md.size),
            "data_offsets": [offset, offset + n],
        }
        offset += n
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    write_all(fd, [struct.pack("<Q", len(text)), text])
    for key in keys:
        t = ckpt.read(key)
        if t.numel():
            write_all(fd, [memoryview(t.reshape(-1).view(torch.uint8).numpy())])


def convert(
    path: str | os.PathLike,
    out: str | os.PathLike,
    format: str = "safetensors",
    *,
    max_file_size: int | None = None,
    overwrite: bool = False,
) -> list[Path]:
    """Convert between a checkpoint and one consolidated file; returns the files written.

    * checkpoint -> `safetensors` (split into `-0000k-of-0000n` files plus an
      index, as Hugging Face does, when `max_file_size` is exceeded) or `torch`
      (a file `torch.load(..., weights_only=True)` reads). Tensors only.
    * a `.safetensors` file -> `shardwise` (a checkpoint folder) or `torch`.
    Streams tensor by tensor: memory holds one tensor at a time.
    """
    path, out = Path(path), Path(out)
    if (out.is_file() or (out.is_dir() and holds_checkpoint(out))) and not overwrite:
        raise FileExistsError(
            already_exists(out) if out.is_dir() else f"{out} already exists; pass overwrite=True"
        )
    if path.is_file():
        return _convert_safetensors(path, out, format, overwrite)
    ckpt = open_checkpoint(path)
    keys = ckpt.tensor_keys()
    if format == "torch":
        items = [
            (k, ckpt.tensor_metadata(k).properties.dtype, tuple(ckpt.tensor_metadata(k).size))
            for k in keys
        ]
        _atomic_file(out, lambda fd: write_torch_archive(fd, items, lambda i: ckpt.read(keys[i])))
        return [out]
    if format != "safetensors":
        raise ValueError(
            f"unknown format {format!r} for a checkpoint; use 'safetensors' or 'torch'"
        )
    groups: list[list[str]] = [[]]
    size = 0
    for key in keys:
        md = ckpt.tensor_metadata(key)
        n = md.size.numel() * torch.empty((), dtype=md.properties.dtype).element_size()
        if max_file_size and groups[-1] and size + n > max_file_size:
            groups.append([])
            size = 0
        groups[-1].append(key)
        size += n
    files = _safetensors_files(out, groups)
    for file, group in zip(files, groups):
        _atomic_file(file, lambda fd, group=group: _write_safetensors(fd, group, ckpt))
    if len(files) > 1:
        index = {
            "metadata": {
                "total_size": sum(
                    ckpt.tensor_metadata(k).size.numel()
                    * torch.empty((), dtype=ckpt.tensor_metadata(k).properties.dtype).element_size()
                    for k in keys
                )
            },
            "weight_map": {k: f.name for f, g in zip(files, groups) for k in g},
        }
        index_path = out.with_name(
            out.name.removesuffix(".safetensors") + ".safetensors.index.json"
        )
        write_durably(index_path, json.dumps(index, indent=2).encode())
        files.append(index_path)
    return files


def _atomic_file(final: Path, write: Callable[[int], Any]) -> None:
    """Write `final` through a temporary name in its folder, fsynced, renamed when complete."""
    final.parent.mkdir(parents=True, exist_ok=True)
    part = final.with_name(final.name + ".part")
    fd = os.open(part, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        write(fd)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(part, final)


def _convert_safetensors(path: Path, out: Path, format: str, overwrite: bool) -> list[Path]:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        keys = list(f.keys())
        if format == "torch":
            first = {k: f.get_slice(k) for k in keys}
            items = [
                (k, _FROM_SAFETENSORS[first[k].get_dtype()], tuple(first[k].get_shape()))
                for k in keys
            ]
            _atomic_file(
                out, lambda fd: write_torch_archive(fd, items, lambda i: f.get_tensor(keys[i]))
            )
            return [out]
        if format != "shardwise":
            raise ValueError(
                f"unknown format {format!r} for a safetensors file; use 'shardwise' or 'torch'"
            )
        tensors = {k: f.get_tensor(k) for k in keys}  # mmap-backed: pages load as they are written
    from .api import save

    save(tensors, out, overwrite=overwrite)
    return [out]


# -- reshard ----------------------------------------------------------------------------


def reshard(
    path: str | os.PathLike,
    out: str | os.PathLike,
    world_size: int,
    *,
    dim: int = 0,
    layouts: Mapping[str, Layout] | None = None,
    overwrite: bool = False,
) -> Path:
    """Rewrite a checkpoint into the per-rank files of another layout, offline.

    Each tensor is split as `layouts[key]` when given, else chunked along `dim`
    (or replicated when it has no such dimension) over `world_size` ranks;
    rank r's blocks all go to one file `__r_0.sw<token>.distcp`, so a job of
    `world_size` ranks reads one contiguous file per rank. Memory holds one
    block at a time. The result is a shardwise checkpoint (stock-readable).
    """
    ckpt = open_checkpoint(path)
    out = Path(out)
    if out.is_dir() and holds_checkpoint(out) and not overwrite:
        raise FileExistsError(already_exists(out))
    plan = {}
    for key in ckpt.tensor_keys():
        shape = tuple(ckpt.tensor_metadata(key).size)
        layout = (layouts or {}).get(key)
        if layout is None:
            layout = (
                Layout.chunked(shape, dim, world_size)
                if len(shape) > dim
                else Layout.replicated(shape, world_size)
            )
        if layout.global_shape != shape or layout.world_size != world_size:
            raise ValueError(
                f"layout for '{key}' is {layout}, not {world_size} ranks over shape {shape}"
            )
        plan[key] = layout
    out.mkdir(parents=True, exist_ok=True)
    token = new_token()
    manifest = Manifest(world_size=world_size)
    written: set[tuple[str, Block]] = set()
    for rank in range(world_size):
        name = data_file_name(f"__{rank}_", 0, token)
        fd = os.open(out / name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        pos = 0
        try:
            if rank == 0:  # objects are copied verbatim, never unpickled
                for key in ckpt.object_keys():
                    data = ckpt.object_bytes(key)
                    write_all(fd, [data])
                    manifest.objects[key] = ObjectEntry(name, pos, len(data), crc32c.crc32c(data))
                    pos += len(data)
            for key, layout in plan.items():
                md = ckpt.tensor_metadata(key)
                entry = manifest.tensors.setdefault(
                    key, TensorEntry(dtype_name(md.properties.dtype), tuple(md.size))
                )
                for block in layout.blocks_of(rank):
                    if block.is_empty() or (key, block) in written:
                        continue  # replicas are stored once
                    written.add((key, block))
                    head, payload, tail = tensor_record(ckpt.read(key, block))
                    write_all(fd, [head, payload, tail])
                    length = len(head) + len(payload) + len(tail)
                    entry.chunks.append(
                        ChunkEntry(
                            block.offsets,
                            block.sizes,
                            name,
                            (pos, length),
                            (pos + len(head), len(payload)),
                            pages_of(payload),
                            crc32c.crc32c(tail, crc32c.crc32c(head)),
                        )
                    )
                    pos += length
            os.fsync(fd)
        finally:
            os.close(fd)
    metadata = pickle.dumps(_stock(manifest.to_metadata()))
    manifest.metadata_crc32c = crc32c.crc32c(metadata)
    keep = {data_file_name(f"__{rank}_", 0, token) for rank in range(world_size)}
    commit(out, metadata, manifest.to_json().encode(), keep)
    return out


def _stock(metadata: Any) -> Any:
    """`Metadata` whose storage infos are DCP's own class, for the pickled `.metadata`."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    metadata.storage_data = {
        k: _StorageInfo(v.relative_path, v.offset, v.length, v.transform_descriptors)
        for k, v in metadata.storage_data.items()
    }
    return metadata
