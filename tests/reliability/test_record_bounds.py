"""A record read whole costs what the folder stores, never what the record's size claims
(issue 35, point 10): an 8 GiB sparse file costs no disk, and reading it into one buffer
under a 3 GiB memory limit raised a bare `MemoryError`.

Each crafted folder (a sparse manifest, `.metadata`, per-rank manifest, index section, or
the zip directory of a stock record) is read by every offline entry point and by `load`
in one subprocess whose address space is capped at 3 GiB (`RLIMIT_AS`), so an unbounded
read fails there as it would on a small machine. Each must be a `CorruptCheckpointError`
naming the file, raised before the buffer exists."""

from __future__ import annotations

import json
import os
import pickle
import re
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import MetadataIndex

import shardwise.checkpoint as swc
from shardwise.checkpoint.format.manifest import Manifest
from shardwise.storage import open_folder

from .crafted import resealed

pytestmark = pytest.mark.spawned

SPARSE = 8 << 30  # bytes a crafted file claims: more than the subprocess may allocate
LIMIT = 3 << 30  # the subprocess's address space
ENTRIES = ("verify", "verify_report", "load", "read_tensor", "inspect")
STATE = {"a": torch.arange(12.0).reshape(3, 4)}


def _shardwise(path: Path) -> Path:
    swc.save(STATE, path)
    return path


def _stock(path: Path) -> Path:
    dcp.save(STATE, checkpoint_id=str(path), no_dist=True)
    return path


def _grown(path: Path, name: str) -> None:
    os.truncate(path / name, SPARSE)  # sparse: no disk


def _manifest(path: Path) -> Path:
    _grown(_shardwise(path), "shardwise.json")
    return path


def _stock_metadata(path: Path) -> Path:
    _grown(_stock(path), ".metadata")
    return path


def _shardwise_metadata(path: Path) -> Path:
    """Its size no longer the manifest's `metadata_tail`: followed as a stock `.metadata`,
    which a reader reads whole."""
    _grown(_shardwise(path), ".metadata")
    return path


def _per_rank_manifest(path: Path) -> Path:
    dcp.save(STATE, storage_writer=swc.Writer(path), use_collectives=False)
    _grown(path, "__0.shardwise.json")
    return path


def _index_section(path: Path) -> Path:
    """The index grown to 8 GiB and the section of 'a' claiming nearly all of it, the
    manifest sealed again: inside the file, so no truncation check refuses it."""
    folder = open_folder(_shardwise(path))
    index = Manifest.read_head(folder).index
    assert index is not None
    _grown(path, index.file)

    def claim(doc: dict) -> None:
        doc["tensors"]["a"]["section"][2] = SPARSE - 64

    resealed(folder, claim)
    return path


_EOCD = struct.Struct("<4s4H2LH")  # zip's end of central directory record
_DIRECTORY = 0xFFFF_FFF0  # the central directory it claims: 4 GiB


def _stock_record(path: Path) -> Path:
    """A stock chunk's record whose zip directory claims 4 GiB (its end record at the
    end of a sparse data file): read through `zipfile`, whose buffer that would be."""
    _stock(path)
    _grown(path, "__0_0.distcp")
    length = _DIRECTORY + _EOCD.size
    with open(path / "__0_0.distcp", "r+b") as f:
        f.seek(SPARSE - _EOCD.size)
        f.write(_EOCD.pack(b"PK\x05\x06", 0, 0, 1, 1, _DIRECTORY, 0, 0))
    with open(path / ".metadata", "rb") as f:
        metadata = pickle.load(f)  # noqa: S301 - the test's own file
    metadata.storage_data[MetadataIndex("a", (0, 0))] = _StorageInfo(
        "__0_0.distcp", SPARSE - length, length
    )
    with open(path / ".metadata", "wb") as f:
        pickle.dump(metadata, f)
    return path


# scenario: (how its folder is made, the entry points that read the record, what names it)
SCENARIOS = {
    "sparse manifest": (_manifest, ENTRIES, r"shardwise\.json holds 8589934592 bytes"),
    "sparse stock .metadata": (_stock_metadata, ENTRIES, r"\.metadata holds 8589934592 bytes"),
    "sparse .metadata beside a manifest": (
        _shardwise_metadata,
        ENTRIES,
        r"\.metadata holds 8589934592 bytes",
    ),
    "sparse per-rank manifest": (
        _per_rank_manifest,
        ("load",),
        r"__0\.shardwise\.json holds 8589934592 bytes",
    ),
    "index section of 8 GiB": (
        _index_section,
        ENTRIES,
        r"the section of 'a' claims 8589934528 bytes of .*__0_1\.sw[0-9a-f]{12}\.distcp",
    ),
    "stock record's zip directory of 4 GiB": (
        _stock_record,
        ("verify", "verify_report", "load", "read_tensor"),  # inspect reads no record
        r"__0_0\.distcp.* 4294967280 bytes of a tensor record's zip structures",
    ),
}

# Run with the address space capped, after the imports (torch's own mappings fit under it).
_CAPPED = """
import json, resource, sys, traceback
import torch
import shardwise.checkpoint as swc
resource.setrlimit(resource.RLIMIT_AS, ({limit}, {limit}))
calls = {{
    "verify": lambda p: swc.verify(p),
    "verify_report": lambda p: swc.verify(p, raise_on_error=False),
    "load": lambda p: swc.load({{"a": torch.zeros(3, 4)}}, p),
    "read_tensor": lambda p: swc.read_tensor(p, "a"),
    "inspect": lambda p: swc.inspect(p),
}}
out = {{}}
for scenario, (path, entries) in json.loads(sys.argv[1]).items():
    for entry in entries:
        try:
            got = calls[entry](path)
            out[f"{{scenario}}/{{entry}}"] = ["returned", got if isinstance(got, list) else str(got)]
        except BaseException as e:
            out[f"{{scenario}}/{{entry}}"] = [type(e).__name__, str(e)]
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory) -> dict[str, list[str]]:
    """What every entry point did on every crafted folder, read in one capped subprocess."""
    root = tmp_path_factory.mktemp("bounds")
    folders = {
        name: (str(make(root / f"case{i}")), entries)
        for i, (name, (make, entries, _)) in enumerate(SCENARIOS.items())
    }
    done = subprocess.run(
        [sys.executable, "-c", _CAPPED.format(limit=LIMIT), json.dumps(folders)],
        capture_output=True,
        timeout=600,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    return json.loads(done.stdout.decode().strip().splitlines()[-1])


CASES = [(s, e) for s, (_, entries, _) in SCENARIOS.items() for e in entries]


@pytest.mark.parametrize("scenario, entry", CASES, ids=[f"{s}-{e}" for s, e in CASES])
def test_an_oversized_record_is_refused_before_it_is_read(outcomes, scenario, entry):
    kind, found = outcomes[f"{scenario}/{entry}"]
    if entry == "verify_report":  # the reporting form returns the one problem it raises
        assert kind == "returned" and isinstance(found, list) and len(found) == 1, (kind, found)
        (found,) = found
    else:
        assert kind == "CorruptCheckpointError", (kind, found)
    assert re.search(SCENARIOS[scenario][2], found), found
