"""What makes a checkpoint Megatron-Core's: its `metadata.json` and its common state.

Megatron's `dist_checkpointing.load` opens a DCP checkpoint whose folder holds
`metadata.json` naming the torch_dist backend, and finds its non-tensor state in
one object stored under `COMMON_STATE_KEY` (or, written by older Megatron, in a
legacy `common.pt`); `read_common_state` reads it back from either writer without
unpickling code.

Both side files are untrusted input like every other file of a checkpoint, so
they are read as its records are: through the `Folder` (a plain file inside the
folder, never through a link, never blocking on a FIFO), their size bounded
before a byte is read.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import re
from typing import Any

import torch

from ...errors import CheckpointExistsError, CorruptCheckpointError, UnsafeMetadataError
from ...storage import Folder, LocalFolder, open_folder
from ..offline import open_checkpoint

__all__ = [
    "COMMON_PT",
    "COMMON_STATE_KEY",
    "METADATA_JSON",
    "metadata_json_problem",
    "read_common_state",
    "write_metadata_json",
]

# Megatron's `ShardedObject("common_state", ..., (1,), (0,)).unique_key`: its non-tensor state.
COMMON_STATE_KEY = "common_state/shard_0_1"
METADATA_JSON = "metadata.json"
COMMON_PT = "common.pt"  # older Megatron's common state, beside the DCP files
_BACKEND = {"sharded_backend": "torch_dist", "sharded_backend_version": 1}
# Megatron's metadata.json is one small JSON object (~60 bytes): 64 KiB is ample, and
# a larger one is not Megatron's.
_MAX_METADATA_JSON = 1 << 16
# common.pt holds the non-sharded state (arguments, iteration, optimizer param groups,
# a few small tensors): kilobytes to megabytes. It is unpickled whole in memory, so a
# larger one (a crafted, sparse file may claim terabytes) is refused unread.
_MAX_COMMON_PT = 1 << 30
_GLOBAL = re.compile(r"GLOBAL ([\w.]+)")
_DETAIL = re.compile(r"WeightsUnpickler error: \s*([^\n]+)")


def _folder(path: str | os.PathLike | Folder) -> Folder:
    return path if isinstance(path, Folder) else LocalFolder(path)


def _read_bounded(folder: Folder, name: str, limit: int, what: str) -> bytes | None:
    """`name`'s bytes, or None when there is none. Read as a record is (`Folder.open`:
    a link or anything but a plain file raises `CorruptCheckpointError`); one over
    `limit` bytes raises it too, before a byte is read."""
    try:
        f = folder.open(name)
    except FileNotFoundError:
        return None
    try:
        size = f.size()
        if size > limit:
            raise CorruptCheckpointError(
                f"{f.where} holds {size} bytes, more than the {limit} {what} may: refused unread"
            )
        parts, got = [], 0
        while got < size:  # a short read (a network filesystem): go on from there
            part = f.pread(size - got, got)
            if not part:
                break
            parts.append(part)
            got += len(part)
        return b"".join(parts)
    finally:
        f.close()


def _present(folder: Folder, name: str) -> bool:
    """Whether `name` is in the folder in any form (a link or a FIFO too): opened, not read."""
    try:
        folder.open(name).close()
    except FileNotFoundError:
        return False
    except CorruptCheckpointError:  # a link (dangling or not), a FIFO, a folder
        return True
    return True


def _metadata_json(folder: Folder) -> Any:
    """The parsed `metadata.json`, None when absent, `{}` when it is no JSON (or nests
    past the decoder's depth: no JSON Megatron writes); `CorruptCheckpointError` when
    it is no plain file or too large."""
    data = _read_bounded(folder, METADATA_JSON, _MAX_METADATA_JSON, "Megatron's metadata.json")
    if data is None:
        return None
    try:
        return json.loads(data)
    except (ValueError, RecursionError):
        return {}


def metadata_json_problem(path: str | os.PathLike | Folder) -> BaseException | None:
    """A `metadata.json` already in the folder that is not Megatron's torch_dist one,
    or a legacy `common.pt`, which both readers prefer to the new common state.
    Found through the `Folder`: a link or a FIFO under either name is in the way too,
    and is never read."""
    folder = _folder(path)
    if _present(folder, COMMON_PT):
        return CheckpointExistsError(
            f"{folder.where(COMMON_PT)} exists (a legacy Megatron common state): Megatron and "
            f"read_common_state would read it instead of this save's; move it away first"
        )
    try:
        existing = _metadata_json(folder)
    except CorruptCheckpointError as e:  # a link, a FIFO, a huge file: never read
        return CheckpointExistsError(f"{e}; it is in the way of Megatron's metadata.json")
    except OSError:
        existing = {}
    if existing is None or existing == _BACKEND:
        return None
    return CheckpointExistsError(
        f"{folder.where(METADATA_JSON)} exists and is not Megatron's torch_dist metadata: "
        f"it would be overwritten"
    )


def write_metadata_json(path: str | os.PathLike | Folder) -> None:
    """Megatron's `metadata.json` (what `verify_checkpoint` looks for), written durably
    under a new name renamed over it, unless it is already there. Checked by
    `metadata_json_problem` first: a link or a FIFO planted since raises
    `CorruptCheckpointError`, never blocks."""
    folder = _folder(path)
    if _metadata_json(folder) == _BACKEND:
        return  # else (it changed since it was checked) replaced whole
    folder.make()
    folder.write_durably(METADATA_JSON, json.dumps(_BACKEND).encode())


def read_common_state(
    path: str | os.PathLike | Folder,
    *,
    trust_objects: bool = False,
    storage_options: dict[str, Any] | None = None,
) -> Any:
    """Megatron's common (non-tensor) state of a checkpoint: from a legacy `common.pt`
    when there is one (as Megatron reads it), else from its common state object.

    `common.pt` is read as any file of the checkpoint: one that is a link, not a
    plain file (a FIFO) or over 1 GiB raises `CorruptCheckpointError`, nothing read
    through it. Unpickled onto the CPU with `torch.load(weights_only=True)` rules,
    as Megatron does: a global they refuse (a class nobody allowlisted) raises
    `UnsafeMetadataError` before it runs, unless allowlisted
    (`shardwise.checkpoint.allow_object_globals`; importing Megatron-Core allowlists
    its own, `argparse.Namespace` among them) or the checkpoint is trusted
    (`trust_objects=True`: plain pickle, which runs whatever the file names).
    `path` may be an fsspec URL, `storage_options` its backend's options."""
    folder = open_folder(path, storage_options)
    data = _read_bounded(folder, COMMON_PT, _MAX_COMMON_PT, "a Megatron common state")
    if data is not None:
        return _unpickle(data, folder.where(COMMON_PT), trust_objects)
    where = f"object '{COMMON_STATE_KEY}' in {folder.location}"
    try:
        stored = open_checkpoint(folder).object_bytes(COMMON_STATE_KEY)
    except KeyError:  # a lookup that misses: KeyError, as for any key
        raise KeyError(
            f"no Megatron common state in {folder.location}: neither a {COMMON_PT} nor an "
            f"object '{COMMON_STATE_KEY}' (saved with megatron=True, or by Megatron)"
        ) from None
    values = _unpickle(stored, where, trust_objects)
    if not isinstance(values, list) or not values:  # Megatron stores [common state]
        raise CorruptCheckpointError(
            f"{where} holds {type(values).__name__} {_short(values)}, not Megatron's "
            f"[common state]: not a common state Megatron wrote"
        )
    return values[0]


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _unpickle(data: bytes, where: str, trust: bool) -> Any:
    """`torch.load` of Megatron's common state onto the CPU (it may hold CUDA tensors),
    with `weights_only` rules unless `trust`."""
    try:
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=not trust)
    except pickle.UnpicklingError as e:
        if trust:
            raise CorruptCheckpointError(f"{where}: cannot decode ({e})") from e
        found, detail = _GLOBAL.search(str(e)), _DETAIL.search(str(e))
        what = (
            f"refused global {found.group(1)}"
            if found
            else f"refused ({detail.group(1).strip() if detail else 'not a weights-only pickle'})"
        )
        raise UnsafeMetadataError(
            f"{where}: {what}, nothing was run; Megatron's common state loads with "
            f"torch.load(weights_only=True) rules: if you trust this checkpoint, pass "
            f"trust_objects=True, or allowlist the class with "
            f"shardwise.checkpoint.allow_object_globals(...)"
        ) from None
    except Exception as e:  # noqa: BLE001 - any other decoding failure means damaged bytes
        raise CorruptCheckpointError(f"{where}: cannot decode ({type(e).__name__}: {e})") from e
