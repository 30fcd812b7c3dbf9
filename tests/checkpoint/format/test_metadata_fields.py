"""`format.pickles`: every object the safe unpickler builds from a `.metadata` holds the
fields and types of DCP's dataclass (issue 35, point 11). One flipped bit in a field's name
made `verify`, `load` and `read_tensor` raise `AttributeError: 'TensorStorageMetadata'
object has no attribute 'chunks'`; now any such object is a `CorruptCheckpointError`
naming the file, the class and the field, on every reader."""

from __future__ import annotations

import dataclasses
import io
import pickle
import re
import shutil
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

import shardwise.checkpoint as swc
from shardwise.checkpoint.format.pickles import EXTRA, FIELDS, load_metadata
from shardwise.errors import CorruptCheckpointError

from ..readers import READERS

STATE = {"a": torch.arange(12.0).reshape(3, 4)}


def _refusal(path: Path, reader: str) -> str:
    """The message `reader` refuses `path` with: its `CorruptCheckpointError`, or the one
    problem `verify(raise_on_error=False)` returns."""
    if reader == "verify_report":
        problems = READERS[reader](path)
        assert len(problems) == 1, problems
        return problems[0]
    with pytest.raises(CorruptCheckpointError) as info:
        READERS[reader](path)
    return str(info.value)


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict[str, Path]:
    """A shardwise checkpoint (`.metadata` beside its manifest) and a stock one."""
    root = tmp_path_factory.mktemp("saved")
    swc.save(STATE, root / "shardwise")
    dcp.save(STATE, checkpoint_id=str(root / "stock"), no_dist=True)
    return {"shardwise": root / "shardwise", "stock": root / "stock"}


def _copy(saved: dict[str, Path], kind: str, to: Path) -> Path:
    shutil.copytree(saved[kind], to)
    return to


def _flip_name(path: Path, name: str) -> str:
    """The first pickled string `name` in `path`'s `.metadata` with one bit flipped (the low
    bit of its last letter): the attribute name that instance is built with instead."""
    data = bytearray((path / ".metadata").read_bytes())
    raw = name.encode()
    found = [
        at + len(prefix)
        for prefix in (b"X" + struct.pack("<I", len(raw)), b"\x8c" + bytes([len(raw)]))
        if (at := data.find(prefix + raw)) >= 0
    ]
    assert found, f"{name!r} is not in {path / '.metadata'}"
    last = min(found) + len(raw) - 1
    data[last] ^= 1
    (path / ".metadata").write_bytes(bytes(data))
    return name[:-1] + chr(data[last])


# field name -> the class whose (first) instance holds it, and where that sits
NAMES = {
    "chunks": ("TensorStorageMetadata", "state_dict_metadata['a']"),
    "properties": ("TensorStorageMetadata", "state_dict_metadata['a']"),
    "size": ("TensorStorageMetadata", "state_dict_metadata['a']"),
    "offsets": ("ChunkStorageMetadata", "state_dict_metadata['a'].chunks[0]"),
    "sizes": ("ChunkStorageMetadata", "state_dict_metadata['a'].chunks[0]"),
    "state_dict_metadata": ("Metadata", ""),
    "planner_data": ("Metadata", ""),
    "storage_data": ("Metadata", ""),
    "storage_meta": ("Metadata", ""),
    "version": ("Metadata", ""),
    "relative_path": ("_StorageInfo", "storage_data['a' at (0, 0)]"),
    "length": ("_StorageInfo", "storage_data['a' at (0, 0)]"),
    "checkpoint_id": ("StorageMeta", "storage_meta"),
    "save_id": ("StorageMeta", "storage_meta"),
    "modules": ("StorageMeta", "storage_meta"),
}
FLIPS = [
    (kind, name, reader) for kind in ("shardwise", "stock") for name in NAMES for reader in READERS
]


@pytest.mark.parametrize("kind, name, reader", FLIPS, ids=[f"{k}-{n}-{r}" for k, n, r in FLIPS])
def test_a_flipped_bit_in_a_field_name_is_refused_naming_it(saved, tmp_path, kind, name, reader):
    path = _copy(saved, kind, tmp_path / "ck")
    flipped = _flip_name(path, name)
    message = _refusal(path, reader)
    cls, at = NAMES[name]
    where = re.escape(f"{path / '.metadata'}: {at + ': ' if at else ''}")
    assert re.search(
        rf"{where}a {cls} that (has no field '{name}' and )?holds '{re.escape(flipped)}', "
        r"no field of DCP's \(damaged or crafted, or written by a newer PyTorch than this one\): "
        "refused",
        message,
    ), message


def _metadata(path: Path) -> Metadata:
    with open(path / ".metadata", "rb") as f:
        return pickle.load(f)  # noqa: S301 - the test's own checkpoint


def _tensor(md: Metadata) -> Any:
    return md.state_dict_metadata["a"]


def _info(md: Metadata) -> Any:
    (info,) = md.storage_data.values()
    return info


# what a crafted `.metadata` holds instead: (change, class, field, type found); where: PATHS
VALUES: dict[str, tuple[Callable[[Metadata], None], str, str, str]] = {
    "size a str": (
        lambda md: setattr(_tensor(md), "size", "3x4"),
        "TensorStorageMetadata",
        "size",
        "str",
    ),
    "chunks a tuple": (
        lambda md: setattr(_tensor(md), "chunks", tuple(_tensor(md).chunks)),
        "TensorStorageMetadata",
        "chunks",
        "tuple",
    ),
    "offsets of a float": (
        lambda md: setattr(_tensor(md).chunks[0], "offsets", (0.0, 0)),
        "ChunkStorageMetadata",
        "offsets",
        "tuple",
    ),
    "dtype a str": (
        lambda md: setattr(_tensor(md).properties, "dtype", "float32"),
        "TensorProperties",
        "dtype",
        "str",
    ),
    "requires_grad an int": (
        lambda md: setattr(_tensor(md).properties, "requires_grad", 1),
        "TensorProperties",
        "requires_grad",
        "int",
    ),
    "storage offset a float": (
        lambda md: setattr(_info(md), "offset", 0.5),
        "_StorageInfo",
        "offset",
        "float",
    ),
    "relative_path bytes": (
        lambda md: setattr(_info(md), "relative_path", b"__0_0.distcp"),
        "_StorageInfo",
        "relative_path",
        "bytes",
    ),
    "storage_meta a str": (
        lambda md: setattr(md, "storage_meta", "x"),
        "Metadata",
        "storage_meta",
        "str",
    ),
    "modules a str": (
        lambda md: setattr(md.storage_meta, "modules", "torch"),
        "StorageMeta",
        "modules",
        "str",
    ),
    "version an int": (lambda md: setattr(md, "version", 1), "Metadata", "version", "int"),
}
PATHS = {
    "TensorStorageMetadata": "state_dict_metadata['a']",
    "ChunkStorageMetadata": "state_dict_metadata['a'].chunks[0]",
    "TensorProperties": "state_dict_metadata['a'].properties",
    "_StorageInfo": "storage_data['a' at (0, 0)]",
    "Metadata": "",
    "StorageMeta": "storage_meta",
}
CRAFTED = [(case, reader) for case in VALUES for reader in READERS]


@pytest.mark.parametrize("case, reader", CRAFTED, ids=[f"{c}-{r}" for c, r in CRAFTED])
def test_a_field_of_another_type_is_refused_naming_it(saved, tmp_path, case, reader):
    path = _copy(saved, "stock", tmp_path / "ck")
    change, cls, field, found = VALUES[case]
    md = _metadata(path)
    change(md)
    (path / ".metadata").write_bytes(pickle.dumps(md))
    message = _refusal(path, reader)
    at = PATHS[cls]
    where = re.escape(f"{path / '.metadata'}: {at + ': ' if at else ''}")
    assert re.search(
        rf"{where}a {cls} whose field '{field}' holds a {found} \(.*\), not what DCP keeps "
        r"there \(damaged or crafted\): refused",
        message,
    ), message


def test_an_attribute_no_dcp_class_has_is_refused(saved, tmp_path):
    path = _copy(saved, "stock", tmp_path / "ck")
    md = _metadata(path)
    md.surprise = 1  # type: ignore[attr-defined]
    (path / ".metadata").write_bytes(pickle.dumps(md))
    with pytest.raises(CorruptCheckpointError, match="a Metadata that holds 'surprise', no field"):
        swc.read_tensor(path, "a")


def test_what_an_older_pytorch_left_out_takes_its_default(saved):
    """Fields an older DCP did not write: `storage_meta`, `version` (class defaults) and
    `StorageMeta.modules` (a default factory, which no class attribute holds: set)."""
    md = _metadata(saved["stock"])
    meta = StorageMeta(checkpoint_id="/c", save_id="s")
    del meta.__dict__["modules"]
    md.storage_meta = meta
    older = Metadata(md.state_dict_metadata, storage_data=md.storage_data)
    del older.__dict__["storage_meta"], older.__dict__["version"], older.__dict__["planner_data"]
    for value in (md, older):
        loaded = load_metadata(io.BytesIO(pickle.dumps(value)), "old.metadata")
        assert loaded.state_dict_metadata == md.state_dict_metadata
    assert load_metadata(io.BytesIO(pickle.dumps(md))).storage_meta.modules == []
    assert load_metadata(io.BytesIO(pickle.dumps(older))).storage_meta is None


def test_the_field_tables_are_torchs_dataclasses():
    """`FIELDS` lists each admitted dataclass's fields as the installed torch declares
    them: a PyTorch that adds or renames one fails here first, not on users' files."""
    for cls, fields in FIELDS.items():
        assert list(fields) == [f.name for f in dataclasses.fields(cls)], cls.__name__
    assert set(EXTRA) <= set(FIELDS)
