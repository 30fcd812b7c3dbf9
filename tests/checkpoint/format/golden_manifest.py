"""The golden manifest (tests/checkpoint/golden): what a save of `golden_state` writes once
normalised, and ways to break one field of it; shared by the tests of `manifest`,
`manifest_fields` and `fast_entries`. `python -m tests.checkpoint.format.golden_manifest`
regenerates the golden file of the current version."""

from __future__ import annotations

import json
import re
import uuid
import warnings
from pathlib import Path
from typing import Any

import crc32c
import pytest
import torch

import shardwise.checkpoint as swc
from shardwise import Block, Layout, ShardedTensor
from shardwise.checkpoint.format.manifest import (
    VERSION,
    ChunkEntry,
    Manifest,
    ObjectEntry,
    TensorEntry,
)

GOLDEN = Path(__file__).resolve().parents[1] / "golden"
DOC = Path(__file__).resolve().parents[3] / "docs" / "format.md"


SOURCE = "ckpt/shardwise.json"  # the file name errors must carry


# Where each record type sits in the golden manifest (the first of its kind).
WHERE: dict[str, tuple[Any, ...]] = {
    "top level": (),
    "storage_meta": ("storage_meta",),
    "tensor": ("tensors", "model.w"),
    "chunk": ("tensors", "model.w", "chunks", 0),
    "object": ("objects", "extra.step"),
}


PATH = {  # the same places as the reader names them in its errors
    "top level": "",
    "storage_meta": "storage_meta.",
    "tensor": "tensors['model.w'].",
    "chunk": "tensors['model.w'].chunks[0].",
    "object": "objects['extra.step'].",
}


def checksummed(doc: dict[str, Any]) -> dict[str, Any]:
    """`doc` with its crc32c as docs/format.md defines it: of the compact document, field 0."""
    body = json.dumps(dict(doc, crc32c=0), separators=(",", ":"))
    return dict(doc, crc32c=crc32c.crc32c(body.encode()))


def compact(doc: dict[str, Any]) -> str:
    return json.dumps(doc, separators=(",", ":"))


def golden_text(version: int = VERSION) -> str:
    return compact(json.loads((GOLDEN / f"manifest_v{version}.json").read_text()))


def full_manifest() -> Manifest:
    """Every optional field set: what the writer emits must be the whole table."""
    m = Manifest(world_size=2, metadata_crc32c=5, dcp_version="1.0.0")
    m.storage_meta = {"checkpoint_id": "c", "save_id": "s", "modules": ["m"]}
    m.set_planner_data({"odd": {1: 2}})  # not plain JSON: pickled
    m.tensors["t"] = TensorEntry("int16", (2, 3), requires_grad=True)
    m.tensors["t"].chunks.append(
        ChunkEntry((0, 0), (2, 3), "f", (0, 99), None, [7], 0, ["stream.zstd/1"])
    )
    m.objects["o"] = ObjectEntry("f", 99, 3, 9, ["stream.zstd/1"])
    return m


def minimal_manifest() -> Manifest:
    m = Manifest(world_size=1)
    m.tensors["t"] = TensorEntry("int16", (2, 3))
    m.tensors["t"].chunks.append(
        ChunkEntry((0, 0), (2, 3), "f", (0, 40), (20, 12), [1, 2], 3, None, (1, 3))
    )
    m.objects["o"] = ObjectEntry("f", 40, 3, 9)
    return m


REMOVE = object()


def mutate(doc: dict[str, Any], record: str, name: str, value: Any) -> dict[str, Any]:
    """`doc` with field `name` of the first `record` set to `value`, or removed."""
    target = doc
    for step in WHERE[record]:
        target = target[step]
    if value is REMOVE:
        del target[name]
    else:
        target[name] = value
    return doc


def refused(doc: dict[str, Any], checksum: bool = True) -> str:
    text = compact(checksummed(doc) if checksum else doc)
    with pytest.raises(swc.CorruptCheckpointError) as info:
        Manifest.from_json(text, SOURCE)
    message = str(info.value)
    assert message.startswith(f"{SOURCE}: unreadable manifest: field "), message
    return message


BAD = {
    "world_size-string": ("top level", "world_size", "2", "expected a positive integer"),
    "world_size-zero": ("top level", "world_size", 0, "expected a positive integer"),
    "page_size-in-v3": ("top level", "page_size", 1048576, "unexpected (format version 3 "),
    "metadata_crc32c-negative": ("top level", "metadata_crc32c", -1, "expected a crc32c"),
    "metadata_crc32c-too-big": ("top level", "metadata_crc32c", 1 << 32, "expected a crc32c"),
    "checksum-md5": ("top level", "checksum", "md5", "expected \"crc32c\", got 'md5'"),
    "dcp_version-int": ("top level", "dcp_version", 1, "expected a string or null"),
    "planner_data_pickle-not-base64": (
        "top level",
        "planner_data_pickle",
        "not base64!",
        "expected base64 text",
    ),
    "tensors-list": ("top level", "tensors", [], "expected an object, got []"),
    "objects-null": ("top level", "objects", None, "expected an object, got None"),
    "unexpected-top-level": ("top level", "compression", "zstd", "unexpected"),
    "storage_meta-string": ("top level", "storage_meta", "x", "expected an object"),
    "storage_meta-modules": ("storage_meta", "modules", "m", "expected a list of strings"),
    "storage_meta-checkpoint_id": ("storage_meta", "checkpoint_id", 3, "a string or null"),
    "unexpected-storage_meta": ("storage_meta", "rank", 0, "unexpected"),
    "dtype-unknown": ("tensor", "dtype", "float33", "expected a torch dtype name"),
    "dtype-not-a-dtype": ("tensor", "dtype", "tensor", "expected a torch dtype name"),
    "shape-string": ("tensor", "shape", "6x4", "expected a list of non-negative integers"),
    "shape-negative": ("tensor", "shape", [6, -4], "expected a list of non-negative integers"),
    "requires_grad-string": ("tensor", "requires_grad", "yes", "expected true or false"),
    "chunks-object": ("tensor", "chunks", {}, "expected a list"),
    "unexpected-tensor": ("tensor", "layout", "strided", "unexpected"),
    "sizes-negative": ("chunk", "sizes", [-2, 4], "expected a list of non-negative integers"),
    "offsets-float": ("chunk", "offsets", [0.0, 0], "expected a list of non-negative integers"),
    "file-traversal": (
        "chunk",
        "file",
        "../../etc/passwd",
        "expected a file name (no `/`, no `..`)",
    ),
    "file-empty": ("chunk", "file", "", "expected a file name (no `/`, no `..`)"),
    "record-three": ("chunk", "record", [0, 1, 2], "expected [offset, length]"),
    "payload-negative": ("chunk", "payload", [-1, 64], "expected [offset, length] or null"),
    "pages-in-v3": ("chunk", "pages", [1], "unexpected (format version 3 "),
    "tiles-too-big": ("chunk", "tiles", [1 << 32], "expected a list of crc32c"),
    "tiles-bool": ("chunk", "tiles", [True], "expected a list of crc32c"),
    "tile-negative": ("chunk", "tile", [-1, 4], "expected a list of non-negative integers or null"),
    "tile-float": ("chunk", "tile", [4.0, 4], "expected a list of non-negative integers or null"),
    "tile-string": ("chunk", "tile", "4x4", "expected a list of non-negative integers or null"),
    "frame-float": ("chunk", "frame", 1.5, "expected a crc32c"),
    "transform-empty": ("chunk", "transform", [], "expected a non-empty list of strings"),
    "unexpected-chunk": ("chunk", "compression", "zstd", "unexpected"),
    "object-offset-negative": ("object", "offset", -1, "expected a non-negative integer"),
    "object-length-bool": ("object", "length", True, "expected a non-negative integer"),
    "object-crc32c-null": ("object", "crc32c", None, "expected a crc32c"),
    "unexpected-object": ("object", "dtype", "float32", "unexpected"),
}


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


# The fields that legitimately differ between two saves of the same state. Each is
# checked against what it stands for, then replaced by the golden's fixed value:
#   tensors[].chunks[].file, objects[].file   the save's random token: __0_0.sw<12 hex>.distcp
#   storage_meta.checkpoint_id                the path saved to
#   storage_meta.save_id                      DCP's random uuid of the save
#   tensors[].chunks[].frame                  crc32c of record bytes holding a save_id-derived id
#   metadata_crc32c                           crc32c of .metadata, which holds all of the above
#   crc32c                                    of the document: recomputed once normalised
FILE = "__0_0.sw000000000000.distcp"


CHECKPOINT_ID = "ckpt/step_100"


SAVE_ID = "00000000-0000-0000-0000-000000000000"


def normalised(folder: Path) -> str:
    written = (folder / "shardwise.json").read_text()
    doc = json.loads(written)
    assert compact(doc) == written  # the writer writes the compact, canonical form
    token = re.compile(r"__0_0\.sw[0-9a-f]{12}\.distcp")
    chunks = [c for t in doc["tensors"].values() for c in t["chunks"]]
    names = {entry["file"] for entry in chunks + list(doc["objects"].values())}
    assert len(names) == 1 and token.fullmatch(next(iter(names)))  # one file, one token
    data = (folder / next(iter(names))).read_bytes()
    for entry in chunks + list(doc["objects"].values()):
        entry["file"] = FILE
    for c in chunks:
        (start, length), (at, size) = c["record"], c["payload"]
        assert c["frame"] == crc32c.crc32c(
            data[at + size : start + length], crc32c.crc32c(data[start:at])
        )
        c["frame"] = 0
    assert doc["metadata_crc32c"] == crc32c.crc32c((folder / ".metadata").read_bytes())
    doc["metadata_crc32c"] = 0
    meta = doc["storage_meta"]
    assert meta["checkpoint_id"] == str(folder) and uuid.UUID(meta["save_id"])
    meta["checkpoint_id"], meta["save_id"] = CHECKPOINT_ID, SAVE_ID
    return compact(checksummed(doc))


def save_golden(folder: Path) -> None:
    with warnings.catch_warnings():  # "assuming the intent is to save in a single process"
        warnings.simplefilter("ignore", UserWarning)
        swc.save(golden_state(), folder)


if __name__ == "__main__":  # regenerate the golden file of the current version
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        save_golden(Path(tmp) / "step_100")
        doc = json.loads(normalised(Path(tmp) / "step_100"))
    (GOLDEN / f"manifest_v{VERSION}.json").write_text(readable(doc) + "\n")
