"""The golden manifests (tests/checkpoint/golden): what a save of `golden_state` writes once
normalised, its index, and manifests with every optional field or none; shared by the tests
of `manifest`, `format.entries`, `format.entries` and `format.index`.
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
import numpy as np
import torch

import shardwise.checkpoint as swc
from shardwise import Block, Layout, ShardedTensor
from shardwise.checkpoint.format.entries import INDEXED, INLINE
from shardwise.checkpoint.format.index import read_sections, write_sections
from shardwise.checkpoint.format.manifest import (
    VERSION,
    ChunkEntry,
    Manifest,
    ObjectEntry,
    TensorEntry,
    tail_of,
)
from shardwise.checkpoint.format.table import encode_section, row_width
from shardwise.storage import open_folder

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
#   metadata_crc32c, metadata_tail          of .metadata, which holds all of the above: 0, [0, 0]
#   a tensor's section crc32c               of its rows, which hold the token: recomputed once
#                                           the rows are normalised
#   crc32c                                  of the document: recomputed once normalised
# (A chunk's frame, the crc32c of record bytes holding a save_id-derived id, is 0 in its row
# since version 5: it is in the data file's checksum block, which no record checksums.)
FILE = "__0_0.sw000000000000.distcp"
INDEX_FILE = "__0_1.sw000000000000.distcp"  # swc.save's index: rank 0's next data file


CHECKPOINT_ID = "ckpt/step_100"


SAVE_ID = "00000000-0000-0000-0000-000000000000"


METADATA = b"a .metadata"  # what the manifests built here were committed with


def golden_chunks() -> dict[str, TensorEntry]:
    """The golden checkpoint's tensors with their chunks: the version 3 golden lists them."""
    return Manifest.from_json(golden_text(INLINE)).tensors


def kept_chunks(tensors: dict[str, TensorEntry]) -> dict[str, TensorEntry]:
    """The golden checkpoint's `tensors` as `swc.save` writes them from version 5: each chunk's frame and checksums
    in its data file's checksum block, after the file's last record (chunk or object), in
    record order (`crc_at`)."""
    golden = Manifest.from_json(golden_text(INLINE))
    at = max(
        [sum(c.record) for t in tensors.values() for c in t.chunks]
        + [o.offset + o.length for o in golden.objects.values()]
    )
    for c in sorted((c for t in tensors.values() for c in t.chunks), key=lambda c: c.record):
        c.crc_at, at = at, at + 4 * (1 + len(c.crcs))
    return tensors


def data_file(tensors: dict[str, TensorEntry], objects: dict[str, ObjectEntry]) -> bytes:
    """A data file of zeros as long as the byte ranges of `tensors` and `format.pickles` need, with
    each chunk's frame and checksums at its `crc_at` (if any)."""
    chunks = [c for t in tensors.values() for c in t.chunks]
    ends = [sum(c.record) for c in chunks] + [o.offset + o.length for o in objects.values()]
    data = bytearray(max(ends + [c.crc_at + 4 + 4 * len(c.crcs) for c in chunks]))
    for c in (c for c in chunks if c.crc_at >= 0):
        data[c.crc_at : c.crc_at + 4 + 4 * len(c.crcs)] = np.asarray(
            [c.frame, *c.crcs], dtype="<u4"
        ).tobytes()
    return bytes(data)


def v4_sections(tensors: dict[str, TensorEntry]) -> bytes:
    """The index a version 4 writer wrote of `tensors`: rows without `crc_at` (version 5's
    inline rows less their last column), each row's checksums after them; each tensor's
    `section` set to point into it."""
    out, at = [], 0
    for t in tensors.values():
        assert all(c.crc_at == -1 for c in t.chunks)
        t.transforms = []
        data = encode_section(t.chunks, len(t.shape), t.transforms)
        n, width = len(t.chunks), row_width(len(t.shape))
        rows = np.frombuffer(data, dtype="<i8", count=n * width).reshape(n, width)
        assert (rows[:, -1] == -1).all()
        data = rows[:, :-1].tobytes() + data[n * width * 8 :]
        t.section = (0, at, len(data), n, crc32c.crc32c(data))
        out.append(data)
        at += len(data)
    return b"".join(out)


def golden_index(version: int = VERSION) -> bytes:
    """The golden checkpoint's index file: the version 3 golden's chunks as sections, in one
    block; in version 4 with their checksums, from version 5 as `swc.save` writes them
    (`kept_chunks`)."""
    if version == INDEXED:
        return v4_sections(golden_chunks())
    return write_sections(kept_chunks(golden_chunks()), 0)


def golden_folder(path: Path, head: str | None = None) -> Path:
    """The golden checkpoint, readable: `head` (the current golden by default) as its
    manifest, the golden index of its version (of the current one up to version 3, unread),
    and a data file of zeros as long as its byte ranges need, then (version 5) its checksums."""
    text = golden_text() if head is None else head
    version = max(INDEXED, json.loads(text)["version"])
    tensors = golden_chunks() if version == INDEXED else kept_chunks(golden_chunks())
    path.mkdir(parents=True, exist_ok=True)
    (path / "shardwise.json").write_text(text)
    (path / INDEX_FILE).write_bytes(golden_index(version))
    (path / FILE).write_bytes(data_file(tensors, Manifest.from_json(golden_text()).objects))
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
    """What a writer saves of `m` in its version: its text and (from version 4) its index,
    whose sections it points at (committed with `METADATA`); into `folder` when given, with
    a data file of zeros as long as its byte ranges need, the checksums of chunks with a
    `crc_at` there."""
    if m.version <= INLINE:
        text, index = m.to_json(), b""
    else:
        version = m.version
        raw, index = m.indexed(INDEX_FILE, METADATA)  # written in the current version
        if version == INDEXED:  # as a version 4 writer wrote it
            m.version = INDEXED
            index = v4_sections(m.tensors)
            raw = m.to_json().encode()
        text = raw.decode()
    if folder is not None:
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "shardwise.json").write_text(text)
        (folder / INDEX_FILE).write_bytes(index)
        (folder / FILE).write_bytes(data_file(m.tensors, m.objects))
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
    tables = dict(
        read_sections(open_folder(folder), m.index, [*m.tensors.items()], "", version=m.version)
    )
    for k, t in m.tensors.items():
        for c, at in zip(t.chunks, tables[k].crc_at, strict=True):
            assert c.payload is not None
            (start, length), (pay, size) = c.record, c.payload
            assert c.frame == crc32c.crc32c(
                data[pay + size : start + length], crc32c.crc32c(data[start:pay])
            )
            # its frame and tiles in its data file's checksum block (`kept_chunks`)
            block = np.frombuffer(data, dtype="<u4", count=1 + len(c.crcs), offset=at)
            assert block.tolist() == [c.frame, *c.crcs]
            c.file, c.frame, c.crc_at = FILE, 0, at
    saved = {k: t.section for k, t in m.tensors.items()}
    raw = (folder / m.index.file).read_bytes()
    index = write_sections(m.tensors, 0)  # the same rows, normalised: new crc32cs only
    assert len(index) == len(raw)
    for k, t in m.tensors.items():
        assert saved[k] is not None and t.section is not None
        assert saved[k][:4] == t.section[:4], k
        _, at, length, count, _ = t.section
        d = len(t.shape)
        rows = np.frombuffer(raw, dtype="<i8", count=count * row_width(d), offset=at).copy()
        rows.reshape(count, -1)[:, 3 * d + 2] = 0  # the token: what alone differs
        assert rows.tobytes() + raw[at + rows.nbytes : at + length] == index[at : at + length]
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
