"""`Folder.read(name, limit)`: a file larger than `limit` is refused, naming it, before
anything is allocated for it (issue 35: a sparse 8 GiB record costs no disk), on local
folders and under fsspec URLs alike; within the limit it reads whole as before."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import fsspec
import pytest

from shardwise.errors import CorruptCheckpointError
from shardwise.storage import Folder, open_folder

SPARSE = 8 << 30


@pytest.fixture(params=["local", "memory"])
def folder(request, tmp_path: Path) -> Iterator[Folder]:
    if request.param == "local":
        yield open_folder(tmp_path)
        return
    root = f"/sw-limit-{uuid.uuid4().hex[:8]}"
    yield open_folder(f"memory://{root}")
    fsspec.filesystem("memory").rm(root, recursive=True)


def test_a_file_within_the_limit_reads_whole(folder):
    folder.write_durably("r", b"0123456789")
    assert folder.read("r", 10) == b"0123456789"
    assert folder.read("r", 1 << 20) == folder.read("r") == b"0123456789"
    folder.write_durably("empty", b"")
    assert folder.read("empty", 0) == b""


def test_a_file_past_the_limit_is_refused_naming_it(folder):
    folder.write_durably("r", b"0123456789")
    with pytest.raises(CorruptCheckpointError) as info:
        folder.read("r", 9)
    assert str(info.value) == (
        f"{folder.where('r')} holds 10 bytes, more than the 9 bytes a record there may hold "
        "(damaged or crafted: refused, nothing read)"
    )


def test_a_sparse_file_of_8_gib_is_refused_before_any_buffer(tmp_path):
    """Refused by its size alone: nothing of it is read (a read would take 8 GiB)."""
    with open(tmp_path / "shardwise.json", "wb") as f:
        f.truncate(SPARSE)
    folder = open_folder(tmp_path)
    with pytest.raises(CorruptCheckpointError, match=f"shardwise.json holds {SPARSE} bytes"):
        folder.read("shardwise.json", 64 << 20)
    assert os.stat(tmp_path / "shardwise.json").st_size == SPARSE


def test_an_object_grown_since_it_was_listed_is_refused():
    """The listing's size is checked first, and the read itself asks for at most
    `limit` + 1 bytes: an object replaced by a larger one in between is refused too."""
    root = f"/sw-limit-{uuid.uuid4().hex[:8]}"
    folder = open_folder(f"memory://{root}")
    try:
        folder.write_durably("r", b"small")
        assert folder.sizes() == {"r": 5}  # listed: 5 bytes
        fsspec.filesystem("memory").pipe_file(f"{root}/r", b"x" * 100)
        with pytest.raises(CorruptCheckpointError, match="holds 11 bytes, more than the 10"):
            folder.read("r", 10)
    finally:
        fsspec.filesystem("memory").rm(root, recursive=True)
