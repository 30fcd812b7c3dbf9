"""The golden manifests (tests/checkpoint/golden): what a save of `golden_state` writes once
normalised, its index, and manifests with every optional field or none; shared by the tests
of `manifest`, `manifest_fields`, `fast_entries` and `manifest_index`.
`python -m tests.checkpoint.format.golden_manifest` regenerates the golden file of the
current version."""

from __future__ import annotations

import json
import re
import uuid
import warnings
from pathlib import Path
from typing import Any

import crc32c
import torch

import shardwise.checkpoint as swc
from shardwise import Block, Layout, ShardedTensor
from shardwise.checkpoint.format.manifest import (
    VERSION,
    ChunkEntry,
    Manifest,
    ObjectEntry,
    TensorEntry,
    tail_of,
)
from shardwise.checkpoint.format.manifest_entries import INLINE
from shardwise.checkpoint.format.manifest_index import write_sections

GOLDEN = Path(__file__).resolve().parents[1] / "golden"
DOC = Path(__file__).resolve().parents[3] / "docs" / "format.md"


SOURCE = "ckpt/shardwise.json"  # the file name errors must carry


def checksummed(doc: dict[str, Any]) -> dict[str, Any]:
    """`doc` with its crc32c as docs/format.md defines it: of the compact document, field 0."""
    body = json.dumps(dict(doc, crc32c=0), separators=(",", ":"))
    return dict(doc, crc32c=crc32c.crc32c(body.encode()))


def compact(doc: dict[str, Any]) -> str:
    return json.dumps(doc, separators=(",", ":"))


def golden_text(version: int = VERSION) -> str:
    return compact(json.loads((GOLDEN / f"manifest_v{version}.json").read_text()))


# The fields that legitimately differ between two saves of the same state. Each is
# checked against what it stands for, then replaced by the golden's fixed value:
#   chunk and object files, index.file      the save's random token: __0_{k}.sw<12 hex>.distcp
#   storage_meta.checkpoint_id              the path saved to
#   storage_meta.save_id                    DCP's random uuid of the save
#   a chunk's frame                         crc32c of record bytes holding a save_id-derived id
#   metadata_crc32c, metadata_tail          of .metadata, which holds all of the above: 0, [0, 0]
#   a tensor's section crc32c               of its rows, which hold the token and frames:
#                                           recomputed once the rows are normalised
#   crc32c                                  of the document: recomputed once normalised
FILE = "__0_0.sw000000000000.distcp"
INDEX_FILE = "__0_1.sw000000000000.distcp"  # swc.save's index: rank 0's next data file


CHECKPOINT_ID = "ckpt/step_100"


SAVE_ID = "00000000-0000-0000-0000-000000000000"


METADATA = b"a .metadata"  # what the manifests built here were committed with


def golden_chunks() -> dict[str, TensorEntry]:
    """The golden checkpoint's tensors with their chunks: the version 3 golden lists them."""
    return Manifest.from_json(golden_text(INLINE)).tensors


def golden_index() -> bytes:
    """The golden checkpoint's index file (version 4): the version 3 golden's chunks as
    sections, in one block."""
    return write_sections(golden_chunks(), 0)


def golden_folder(path: Path, head: str | None = None) -> Path:
    """The golden checkpoint, readable: `head` (the version 4 golden by default) as its
    manifest, the golden index, and a data file of zeros as long as its byte ranges need."""
    ends = [sum(c.record) for t in golden_chunks().values() for c in t.chunks]
    ends += [o.offset + o.length for o in Manifest.from_json(golden_text()).objects.values()]
    path.mkdir(parents=True, exist_ok=True)
    (path / "shardwise.json").write_text(golden_text() if head is None else head)
    (path / INDEX_FILE).write_bytes(golden_index())
    (path / FILE).write_bytes(bytes(max(ends)))
    return path


def full_manifest(version: int = INLINE) -> Manifest:
    """Every optional field set: what the writer emits must be the whole table."""
    m = Manifest(world_size=2, metadata_crc32c=5, dcp_version="1.0.0", version=version)
    m.storage_meta = {"checkpoint_id": "c", "save_id": "s", "modules": ["m"]}
    m.set_planner_data({"odd": {1: 2}})  # not plain JSON: pickled
    m.tensors["t"] = TensorEntry("int16", (2, 3), requires_grad=True)
    m.tensors["t"].chunks.append(
        ChunkEntry((0, 0), (2, 3), FILE, (0, 99), None, [7], 0, ["stream.zstd/1"])
    )
    m.objects["o"] = ObjectEntry(FILE, 99, 3, 9, ["stream.zstd/1"])
    return m


def minimal_manifest(version: int = INLINE) -> Manifest:
    m = Manifest(world_size=1, version=version)
    m.tensors["t"] = TensorEntry("int16", (2, 3))
    m.tensors["t"].chunks.append(
        ChunkEntry((0, 0), (2, 3), FILE, (0, 40), (20, 12), [1, 2], 3, None, (1, 3))
    )
    m.objects["o"] = ObjectEntry(FILE, 40, 3, 9)
    return m


def written(m: Manifest, folder: Path | None = None) -> tuple[str, bytes]:
    """What a writer saves of `m` in its version: its text and (version 4) its index, whose
    sections it points at (committed with `METADATA`); into `folder` when given, with a
    data file of zeros as long as its byte ranges need."""
    if m.version <= INLINE:
        text, index = m.to_json(), b""
    else:
        raw, index = m.indexed(INDEX_FILE, METADATA)
        text = raw.decode()
    if folder is not None:
        ends = [sum(c.record) for t in m.tensors.values() for c in t.chunks]
        ends += [o.offset + o.length for o in m.objects.values()]
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "shardwise.json").write_text(text)
        (folder / INDEX_FILE).write_bytes(index)
        (folder / FILE).write_bytes(bytes(max(ends)))
    return text, index


def golden_state() -> dict[str, Any]:
    """Every record type and a few variants: two chunks of one tensor, a 0-d tensor,
    bfloat16 with requires_grad, a pickled object."""
    layout = Layout((6, 4), {0: [Block((0, 0), (4, 4)), Block((4, 0), (2, 4))]})
    w = torch.arange(24, dtype=torch.float32).reshape(6, 4)
    bias = torch.tensor([1.0, 2.0, 3.0], dtype=torch.bfloat16, requires_grad=True)
    return {
        "model": {
            "w": ShardedTensor.from_layout(layout, [w[:4].clone(), w[4:].clone()]),
            "bias": bias,
            "scale": torch.tensor(0.5, dtype=torch.float64),
        },
        "extra": {"step": 7},
    }


def readable(value: Any, indent: int = 0) -> str:
    """JSON for people (the golden files, the example in docs/format.md): what fits in a
    line stays on one line."""
    flat = json.dumps(value, separators=(", ", ": "))
    if not isinstance(value, (dict, list)) or indent + len(flat) <= 80:
        return flat
    pad = " " * (indent + 1)
    if isinstance(value, dict):
        items = [f"{pad}{json.dumps(k)}: {readable(v, indent + 1)}" for k, v in value.items()]
        return "{\n" + ",\n".join(items) + "\n" + " " * indent + "}"
    items = [pad + readable(v, indent + 1) for v in value]
    return "[\n" + ",\n".join(items) + "\n" + " " * indent + "]"


def normalised(folder: Path) -> tuple[str, bytes]:
    """The manifest a save of the golden state wrote in `folder`, and its index file's
    bytes, each normalised (see above)."""
    written_text = (folder / "shardwise.json").read_text()
    doc = json.loads(written_text)
    assert compact(doc) == written_text  # the writer writes the compact, canonical form
    m = Manifest.read(folder)  # every section read, its checksum and rows checked
    (name,) = {c.file for t in m.tensors.values() for c in t.chunks} | {
        o.file for o in m.objects.values()
    }  # one data file
    token = re.fullmatch(r"__0_0\.sw([0-9a-f]{12})\.distcp", name)
    assert token is not None and m.index is not None
    assert (m.index.file, m.index.blocks) == (f"__0_1.sw{token.group(1)}.distcp", [0])
    data = (folder / name).read_bytes()
    for t in m.tensors.values():
        for c in t.chunks:
            assert c.payload is not None
            (start, length), (at, size) = c.record, c.payload
            assert c.frame == crc32c.crc32c(
                data[at + size : start + length], crc32c.crc32c(data[start:at])
            )
            c.file, c.frame = FILE, 0
    saved = {k: t.section for k, t in m.tensors.items()}
    index = write_sections(m.tensors, 0)  # the same rows, normalised: new crc32cs only
    assert len(index) == len((folder / m.index.file).read_bytes())
    for k, t in m.tensors.items():
        assert saved[k] is not None and t.section is not None
        assert saved[k][:4] == t.section[:4], k
        doc["tensors"][k]["section"] = list(t.section)
    doc["index"]["file"] = INDEX_FILE
    for entry in doc["objects"].values():
        entry["file"] = FILE
    metadata = (folder / ".metadata").read_bytes()
    assert doc["metadata_crc32c"] == crc32c.crc32c(metadata)
    assert doc["metadata_tail"] == list(tail_of(metadata))
    doc["metadata_crc32c"], doc["metadata_tail"] = 0, [0, 0]
    meta = doc["storage_meta"]
    assert meta["checkpoint_id"] == str(folder) and uuid.UUID(meta["save_id"])
    meta["checkpoint_id"], meta["save_id"] = CHECKPOINT_ID, SAVE_ID
    return compact(checksummed(doc)), index


def save_golden(folder: Path) -> None:
    with warnings.catch_warnings():  # "assuming the intent is to save in a single process"
        warnings.simplefilter("ignore", UserWarning)
        swc.save(golden_state(), folder)


if __name__ == "__main__":  # regenerate the golden file of the current version
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        save_golden(Path(tmp) / "step_100")
        doc = json.loads(normalised(Path(tmp) / "step_100")[0])
    (GOLDEN / f"manifest_v{VERSION}.json").write_text(readable(doc) + "\n")
