"""Crafted checkpoints for the untrusted-input tests: each attack of issue 20, on a local
folder or under `memory://`, made by rewriting the records of a sound checkpoint."""

from __future__ import annotations

import hashlib
import json
import pickle
import uuid
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex

import shardwise.checkpoint as swc
from shardwise.checkpoint.format.manifest import Manifest, seal
from shardwise.checkpoint.format.pickles import load_metadata
from shardwise.checkpoint.format.table import file_of
from shardwise.storage import Folder, open_folder

SECRET = b"top secret, never to be read through a checkpoint\n" * 64
NOTES = b"the user's own notes, not ours\n"


def resealed(folder: Folder, change: Callable[[dict[str, Any]], None]) -> None:
    """`shardwise.json` in `folder` changed by `change` and sealed again (its crc32c right):
    only the checks that follow can refuse it."""
    doc = json.loads(folder.read("shardwise.json"))
    change(doc)
    doc["crc32c"] = 0
    folder.write_durably("shardwise.json", seal(json.dumps(doc, separators=(",", ":"))).encode())


# -- version 5 section rows: checksums in the section (`crc_at` -1) or kept by the writer -----


def kept_words(folder: Folder, row: list[int], ndim: int) -> list[int]:
    """The frame and checksums that the data file of `row` (a version 5 row, its writer
    keeping them) holds at its `crc_at`."""
    d = 3 * ndim
    name, count, at = file_of(*row[d : d + 3]), row[d + 8], row[d + 10]
    return np.frombuffer(folder.read(name), "<u4", 1 + count, at).tolist()


def inlined(folder: Folder, rows: np.ndarray, ndim: int) -> tuple[np.ndarray, np.ndarray]:
    """Rows as `swc.save` writes them (every one's checksums in its data file) with their
    frames and checksums moved into the section instead (`crc_at` -1), and those checksums:
    the other form version 5 reads, a section to craft as version 4's were."""
    rows, crcs = rows.copy(), []
    for row in rows:
        assert row[-1] >= 0
        frame, *tiles = kept_words(folder, row.tolist(), ndim)
        row[3 * ndim + 7], row[-1] = frame, -1
        crcs += tiles
    return rows, np.asarray(crcs, dtype="<u4")


def new_slot(folder: Folder, name: str, words: list[int]) -> int:
    """`words` (a frame, then tile checksums) appended to data file `name` as its writer
    would keep them: where they start (a row's `crc_at`)."""
    data = folder.read(name)
    folder.write_durably(name, data + np.asarray(words, dtype="<u4").tobytes())
    return len(data)


def state() -> dict[str, Any]:
    return {
        "w": torch.arange(16, dtype=torch.float32).reshape(4, 4),
        "v": torch.arange(100, 116, dtype=torch.float32).reshape(4, 4),
        "e": torch.zeros(0),
    }


def targets() -> dict[str, Any]:
    return {k: torch.full_like(v, -1.0) for k, v in state().items()}


class Place:
    """A checkpoint path (`ckpt`) and a victim file outside it (`secret`), local or in memory."""

    def __init__(self, root: Path | str) -> None:
        self.root = root
        if isinstance(root, Path):
            self.ckpt: str = str(root / "ckpt")
            self.secret_path: str = str(root / "secret.distcp")
        else:
            self.ckpt = f"{root}/ckpt"
            self.secret_path = f"{root.removeprefix('memory://')}/secret.distcp"
        self.folder: Folder = open_folder(self.ckpt)
        self.parent: Folder = open_folder(str(root) if isinstance(root, Path) else root)
        self.local = isinstance(root, Path)

    def out(self, name: str) -> str:
        return str(self.root / name) if isinstance(self.root, Path) else f"{self.root}/{name}"

    def save(self) -> None:
        swc.save(state(), self.ckpt)
        self.parent.write_durably("secret.distcp", SECRET)
        self.folder.write_durably("notes.txt", NOTES)

    def data_file(self) -> str:
        """The one data file of the tensors (not the index of a version 4 save)."""
        index = Manifest.read(self.folder).index
        skip = index.file if index is not None else None
        (name,) = [n for n in self.folder.names() if n.endswith(".distcp") and n != skip]
        return name

    def victims(self) -> dict[str, str]:
        """Digests of the files no checkpoint operation may change or remove."""
        return {
            "secret": hashlib.sha256(self.parent.read("secret.distcp")).hexdigest(),
            "notes": hashlib.sha256(self.folder.read("notes.txt")).hexdigest(),
        }

    # -- rewriting records -------------------------------------------------------------------

    def manifest(self) -> Manifest:
        """The manifest with every chunk (read from the index from version 4)."""
        return Manifest.read(self.folder)

    def write_manifest(self, m: Manifest) -> None:
        """`m` written as version 3, its chunks inline: what a crafted entry edits."""
        m.version, m.index = 3, None
        self.folder.write_durably("shardwise.json", m.to_json().encode())

    def metadata(self) -> Any:
        return load_metadata(__import__("io").BytesIO(self.folder.read(".metadata")))

    def make_stock(self, metadata: Any) -> None:
        """Only `.metadata` (as crafted) remains of our records: a stock checkpoint."""
        for name in ("shardwise.json", ".shardwise"):
            self.folder.remove(name)
        self.folder.write_durably(".metadata", pickle.dumps(metadata))


def stock_path(place: Place, path: str) -> None:
    """A stock `.metadata` whose chunk of 'w' lives at `path` (relative or absolute)."""
    md = place.metadata()
    index = MetadataIndex("w", torch.Size([0, 0]))
    md.storage_data[index] = replace(md.storage_data[index], relative_path=path)
    place.make_stock(md)


def manifest_file(place: Place, name: str, content: bytes | None = None) -> None:
    """A manifest whose empty tensor 'e' lives in `name` (`content` planted there if given)."""
    m = place.manifest()
    m.tensors["e"].chunks[0].file = name
    if content is not None:
        place.folder.write_durably(name, content)
    place.write_manifest(m)


def huge_shape(place: Place, stock: bool) -> None:
    """'w' claims 10^6 x 10^6 elements and keeps its one 4x4 chunk."""
    if stock:
        md = place.metadata()
        md.state_dict_metadata["w"].size = torch.Size([10**6, 10**6])
        place.make_stock(md)
    else:
        m = place.manifest()
        m.tensors["w"].shape = (10**6, 10**6)
        place.write_manifest(m)


def reshaped(place: Place, stock: bool, shape: tuple[int, ...], second_at: tuple[int, ...]) -> None:
    """'w' of `shape` stored as two 4x4 chunks: its own at (0, 0) and 'v''s at `second_at`
    ('v' itself dropped): a partial overlap or a hole, depending on the numbers."""
    if stock:
        md = place.metadata()
        w, v = md.state_dict_metadata["w"], md.state_dict_metadata.pop("v")
        w.size = torch.Size(shape)
        w.chunks.append(ChunkStorageMetadata(torch.Size(second_at), torch.Size([4, 4])))
        info = md.storage_data.pop(MetadataIndex("v", torch.Size([0, 0])))
        md.storage_data[MetadataIndex("w", torch.Size(second_at))] = info
        del v
        place.make_stock(md)
    else:
        m = place.manifest()
        v = m.tensors.pop("v")
        w = m.tensors["w"]
        w.shape = shape
        w.chunks.append(replace(v.chunks[0], offsets=second_at))
        place.write_manifest(m)


def nested_manifest(place: Place, depth: int = 100_000) -> None:
    """A manifest whose `format.entries` nests `depth` lists, its checksum right."""
    doc = json.loads(place.folder.read("shardwise.json"))
    mark = uuid.uuid4().hex
    doc["planner_data"], doc["crc32c"] = mark, 0
    text = json.dumps(doc, separators=(",", ":"))
    text = text.replace(f'"{mark}"', "[" * depth + "]" * depth)
    place.folder.write_durably("shardwise.json", seal(text).encode())


def nested_pickle(place: Place, depth: int = 100_000) -> None:
    """A stock `.metadata` whose `format.entries` nests `depth` lists (built from opcodes:
    `pickle.dumps` itself cannot go that deep)."""
    md = place.metadata()
    mark = uuid.uuid4().hex
    md.planner_data = mark
    data = pickle.dumps(md, protocol=2)
    encoded = b"X" + len(mark).to_bytes(4, "little") + mark.encode()  # BINUNICODE
    assert data.count(encoded) == 1
    nested = b"]" * depth + b"a" * (depth - 1)
    place.make_stock(md)
    place.folder.write_durably(".metadata", data.replace(encoded, nested))


def type_error_pickle(place: Place) -> None:
    """A stock `.metadata` whose pickle makes an admitted class raise TypeError."""
    place.make_stock(place.metadata())
    place.folder.write_durably(".metadata", b"\x80\x02ctorch\nSize\nK\x01K\x02\x86R.")
