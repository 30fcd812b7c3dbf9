"""How a save becomes visible in a folder that may hold other files.

A checkpoint folder can hold files that are not ours (a `model.pt`, notes, a
previous checkpoint). So a save never renames or deletes the folder; it works
file by file:

1. every rank writes its data under fresh names that carry the save's token
   (`__0_0.sw1a2b3c4d5e6f.distcp`), so nothing committed is overwritten;
2. the coordinator writes the marker `.shardwise` (once: it makes the folder
   recognisable as ours even if the manifest is later lost), then DCP's
   `.metadata`, then `shardwise.json` — each to a temporary name, fsynced,
   renamed into place, the folder fsynced. The manifest's rename is the
   commit point for shardwise readers; `.metadata`'s for stock readers. Both
   only ever name data that is already durable;
3. after the commit, files of the previous checkpoint (those its manifest or
   `.metadata` named) and leftovers of interrupted saves (our token-named
   data and temporary files) are removed. Nothing else is ever deleted.

A crash before step 2 leaves the previous checkpoint as it was (plus
token-named leftovers that the next save collects); a crash between the two
renames leaves stock readers on the new checkpoint and shardwise readers on
the old one, both complete; a crash during step 3 leaves only garbage.
"""

from __future__ import annotations

import json
import os
import re
import uuid
from dataclasses import dataclass
from pathlib import Path

from torch.distributed.checkpoint.filesystem import DEFAULT_SUFFIX

from .faults import failpoint
from .manifest import MANIFEST, MARKER
from .safe_pickle import load_metadata

__all__ = [
    "RecordNames",
    "already_exists",
    "collect",
    "commit",
    "data_file_name",
    "fsync_dir",
    "holds_checkpoint",
    "leftover_data",
    "new_token",
    "referenced_files",
    "token_of",
    "write_durably",
]

METADATA = ".metadata"
_DATA = re.compile(r"^__(\d+)_(\d+)\.sw([0-9a-f]{12})" + re.escape(DEFAULT_SUFFIX) + "$")
_TEMP = re.compile(r"^(.+)\.sw([0-9a-f]{12})\.tmp$")


def new_token() -> str:
    return uuid.uuid4().hex[:12]


def token_of(save_id: str) -> str:
    """The file-name token of a save, from DCP's `save_id` (a uuid)."""
    digits = re.sub(r"[^0-9a-f]", "", save_id.lower())
    return (digits + new_token())[:12]


def data_file_name(prefix: str, index: int, token: str) -> str:
    """`__{rank}_{index}.sw{token}.distcp`: `prefix` is DCP's `__{rank}_`."""
    return f"{prefix}{index}.sw{token}{DEFAULT_SUFFIX}"


@dataclass(frozen=True)
class RecordNames:
    """The commit records of one checkpoint: the global ones, or one rank's
    when DCP saves without collectives (`__{rank}.metadata`)."""

    rank: int | None = None

    @property
    def metadata(self) -> str:
        return METADATA if self.rank is None else f"__{self.rank}{METADATA}"

    @property
    def manifest(self) -> str:
        return MANIFEST if self.rank is None else f"__{self.rank}.{MANIFEST}"

    def owns(self, data_name: str) -> bool:
        """Whether a token-named data file is in this record's scope (all ranks, or its rank)."""
        m = _DATA.match(data_name)
        return m is not None and (self.rank is None or int(m.group(1)) == self.rank)


def holds_checkpoint(folder: Path, names: RecordNames = RecordNames()) -> bool:
    """Whether `folder` already holds a checkpoint (stock or ours, committed or not)."""
    candidates = [names.metadata, names.manifest, RecordNames(0).metadata, RecordNames(0).manifest]
    if names.rank is None:
        candidates.append(MARKER)
    return any((folder / c).exists() for c in candidates)


def already_exists(folder: Path) -> str:
    return f"Checkpoint already exists at {folder}; pass overwrite=True to replace it"


def leftover_data(folder: Path) -> list[str]:
    """Token-named data files: what an interrupted save leaves behind."""
    try:
        return sorted(n for n in os.listdir(folder) if _DATA.match(n))
    except OSError:
        return []


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_durably(path: Path, data: bytes, *, sync: bool = True) -> None:
    """Write `path` whole or not at all: a unique temporary name, fsync, rename."""
    tmp = path.with_name(f"{path.name}.sw{new_token()}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        if sync:
            os.fsync(f.fileno())
    os.replace(tmp, path)


def commit(
    folder: Path, metadata: bytes, manifest: bytes, referenced: set[str], previous: set[str],
    names: RecordNames = RecordNames(), *, sync: bool = True,
) -> list[str]:
    """Make a checkpoint whose data is durable visible; collect what it replaces.

    `referenced`: the data files the new records name; `previous`: those the
    records being replaced named (see `referenced_files`, read before the
    commit). Returns the names removed.
    """
    failpoint("before-commit")
    if names.rank is None and not (folder / MARKER).exists():
        write_durably(folder / MARKER, b"shardwise checkpoint folder\n", sync=sync)
    write_durably(folder / names.metadata, metadata, sync=sync)
    failpoint("between-records")
    write_durably(folder / names.manifest, manifest, sync=sync)
    if sync:
        fsync_dir(folder)
    failpoint("before-collect")
    return collect(folder, referenced, previous, names)


def collect(folder: Path, keep: set[str], previous: set[str], names: RecordNames = RecordNames()) -> list[str]:
    """Remove, after a commit, the files the committed records replaced: those
    the previous records named, token-named data no record names, and our
    temporary files. Never anything else."""
    removed = []
    for name in sorted(os.listdir(folder)):
        if name in keep:
            continue
        temp = _TEMP.match(name)
        ours = (
            name in previous
            or names.owns(name)
            or (temp is not None and temp.group(1) in (names.metadata, names.manifest, MARKER))
        )
        if ours and (folder / name).is_file():
            os.unlink(folder / name)
            removed.append(name)
            failpoint("mid-collect")
    return removed


def referenced_files(folder: Path, names: RecordNames = RecordNames()) -> set[str]:
    """The data files the committed records in `folder` name: those of its
    manifest and of its `.metadata` (a stock one read with the safe unpickler).
    Unreadable records name nothing, so their files are never collected."""
    found: set[str] = set()
    try:
        doc = json.loads((folder / names.manifest).read_bytes())
        found |= {c["file"] for t in doc["tensors"].values() for c in t["chunks"]}
        found |= {o["file"] for o in doc["objects"].values()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        # No manifest: a stock checkpoint (or ours without its manifest, whose
        # token-named files are collected by name anyway).
        try:
            with open(folder / names.metadata, "rb") as f:
                storage = load_metadata(f).storage_data or {}
            found |= {info.relative_path for info in storage.values()}
        except Exception:  # noqa: BLE001 - a record we cannot read names nothing we may delete
            pass
    return {n for n in found if isinstance(n, str) and n and "/" not in n and os.sep not in n and n not in (".", "..")}
