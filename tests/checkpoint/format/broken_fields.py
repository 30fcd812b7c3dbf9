"""Ways to break one field of a golden manifest, and what the reader must say: shared by
the tests of `manifest`, `format.entries` and `format.entries`."""

from __future__ import annotations

from typing import Any

import pytest

import shardwise.checkpoint as swc
from shardwise.checkpoint.format.manifest import Manifest

from .golden_manifest import SOURCE, checksummed, compact

# Where each record type sits in the golden manifests (the first of its kind): chunks up to
# version 3, the index from version 4.
WHERE: dict[str, tuple[Any, ...]] = {
    "top level": (),
    "storage_meta": ("storage_meta",),
    "tensor": ("tensors", "model.w"),
    "chunk": ("tensors", "model.w", "chunks", 0),
    "object": ("objects", "extra.step"),
    "index": ("index",),
}


PATH = {  # the same places as the reader names them in its errors
    "top level": "",
    "storage_meta": "storage_meta.",
    "tensor": "tensors['model.w'].",
    "chunk": "tensors['model.w'].chunks[0].",
    "object": "objects['extra.step'].",
    "index": "index.",
}


def holds(doc: dict[str, Any], record: str) -> bool:
    """Whether `doc` has a `record` where `WHERE` says."""
    target: Any = doc
    for step in WHERE[record]:
        if not isinstance(target, (dict, list)) or step not in (
            target if isinstance(target, dict) else range(len(target))
        ):
            return False
        target = target[step]
    return True


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


# Broken fields of the version 3 golden (chunks listed inline).
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


SECTION = "expected [block, offset, length, rows, crc32c]: non-negative integers, got "
TRANSFORMS = "expected a list of transforms, got "
TAIL = "expected [size, crc32c], got "

# Broken fields of the version 4 golden (chunks in the index): its new fields, and the
# fields of older versions it must not have.
BAD_V4 = {
    "world_size-zero": ("top level", "world_size", 0, "expected a positive integer"),
    "page_size-in-v4": ("top level", "page_size", 1048576, "unexpected (format version 4 "),
    "metadata_tail-three": ("top level", "metadata_tail", [1, 2, 3], TAIL),
    "metadata_tail-negative": ("top level", "metadata_tail", [-1, 0], TAIL),
    "metadata_tail-too-big": ("top level", "metadata_tail", [1, 1 << 32], TAIL),
    "metadata_tail-null": ("top level", "metadata_tail", None, TAIL),
    "index-list": ("top level", "index", [], "expected an object, got []"),
    "index-null": ("top level", "index", None, "expected an object, got None"),
    "index-file-traversal": ("index", "file", "../x", "expected a file name (no `/`, no `..`)"),
    "index-file-int": ("index", "file", 1, "expected a file name (no `/`, no `..`)"),
    "index-blocks-negative": ("index", "blocks", [-1], "expected a list of non-negative integers"),
    "index-blocks-int": ("index", "blocks", 0, "expected a list of non-negative integers"),
    "index-blocks-float": ("index", "blocks", [0.0], "expected a list of non-negative integers"),
    "unexpected-index": ("index", "size", 456, "unexpected (format version 4 "),
    "section-four": ("tensor", "section", [0, 0, 264, 2], SECTION),
    "section-six": ("tensor", "section", [0, 0, 264, 2, 0, 0], SECTION),
    "section-negative": ("tensor", "section", [0, -1, 264, 2, 0], SECTION),
    "section-crc-too-big": ("tensor", "section", [0, 0, 264, 2, 1 << 32], SECTION),
    "section-bool": ("tensor", "section", [0, 0, 264, True, 0], SECTION),
    "section-float": ("tensor", "section", [0, 0, 264.0, 2, 0], SECTION),
    "section-null": ("tensor", "section", None, SECTION),
    "transforms-string": ("tensor", "transforms", "stream.zstd/1", TRANSFORMS),
    "transforms-flat": ("tensor", "transforms", ["stream.zstd/1"], TRANSFORMS),
    "transforms-empty-one": ("tensor", "transforms", [[]], TRANSFORMS),
    "transforms-int": ("tensor", "transforms", [[1]], TRANSFORMS),
    "chunks-in-v4": ("tensor", "chunks", [], "unexpected (format version 4 "),
    "unexpected-tensor": ("tensor", "layout", "strided", "unexpected (format version 4 "),
    "shape-negative": ("tensor", "shape", [6, -4], "expected a list of non-negative integers"),
    "dtype-unknown": ("tensor", "dtype", "float33", "expected a torch dtype name"),
}
