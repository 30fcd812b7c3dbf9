"""`io.read`: the one place chunk bytes are read — whole chunks by one preadv
straight into their targets, one prefetch window, one missing-file error, one verifier."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

import shardwise.checkpoint as swc
from shardwise import Block, Layout, ShardedTensor
from shardwise.checkpoint.format.manifest import Manifest, StoredChunk
from shardwise.checkpoint.io import read as prefetch_window
from shardwise.checkpoint.io.chunks import ChunkRead
from shardwise.checkpoint.io.read import ReadExecutor
from shardwise.storage import open_folder

FULL = torch.arange(64.0).reshape(8, 8)


@pytest.mark.parametrize("via", ["swc.load", "read_tensor", "opened before"])
def test_one_missing_file_error_for_every_reader(tmp_path, via):
    """Found by the records' check before any read, or (a file gone after the records
    were read) by the executor as it opens the files: the same words either way."""
    path = tmp_path / "ck"
    swc.save({"w": FULL}, path)
    index = Manifest.read(path).index
    assert index is not None
    (data,) = [p for p in path.glob("*.distcp") if p.name != index.file]
    opened = swc.open_checkpoint(path)
    os.remove(data)
    with pytest.raises(swc.CorruptCheckpointError, match=rf"data file .*{data.name} is missing"):
        if via == "swc.load":
            swc.load({"w": torch.zeros(8, 8)}, path)
        elif via == "read_tensor":
            swc.read_tensor(path, "w")
        else:
            opened.read("w")


class _Counting:
    """A file whose `readinto` calls are counted."""

    def __init__(self, f: Any, calls: list[int]) -> None:
        self.f, self.calls = f, calls

    def readinto(self, buffers: Any, offset: int) -> int:
        self.calls.append(len(buffers))
        return self.f.readinto(buffers, offset)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.f, name)


def test_whole_chunks_go_straight_into_their_targets_by_one_preadv(tmp_path, monkeypatch):
    path = tmp_path / "ck"
    rows = Layout.row_wise((8, 8), [2, 2, 2, 2])
    layout = Layout((8, 8), {0: [b for r in range(4) for b in rows.blocks_of(r)]})
    state = {"w": ShardedTensor.from_layout(layout, [FULL[2 * i : 2 * i + 2] for i in range(4)])}
    swc.save(state, path)
    folder = open_folder(path)
    calls: list[int] = []
    opened = folder.open
    monkeypatch.setattr(folder, "open", lambda name: _Counting(opened(name), calls))
    targets = [torch.zeros(2, 8) for _ in range(4)]
    ptrs = [t.data_ptr() for t in targets]
    chunks = swc.open_checkpoint(path).manifest.tensors["w"].chunks
    reads = [
        ChunkRead(
            "w",
            StoredChunk.of(c, "float32"),
            c.sizes,
            torch.float32,
            (0, 0),
            c.sizes,
            (lambda t=targets[i]: t),
        )
        for i, c in enumerate(chunks)
    ]
    executor = ReadExecutor(folder)
    executor.run(reads)
    assert len(calls) == 1  # neighbouring chunks of one file: one preadv
    assert [t.data_ptr() for t in targets] == ptrs  # no copy: the bytes landed in place
    got = torch.cat(targets)
    assert torch.equal(got, FULL) and executor.bytes_read >= FULL.nbytes


def test_an_object_store_prefetches_in_one_window(tmp_path, monkeypatch):
    path = tmp_path / "ck"
    swc.save({"w": FULL, "n": 1}, path)
    folder = open_folder(path)
    windows: list[dict] = []
    monkeypatch.setattr(type(folder), "wants_prefetch", True, raising=False)
    monkeypatch.setattr(folder, "prefetch", lambda ranges: windows.append(dict(ranges)))
    monkeypatch.setattr(prefetch_window, "WINDOW", 1 << 30)
    target = {"w": torch.zeros(8, 8), "n": 0}
    swc.load(target, folder)
    assert torch.equal(target["w"], FULL) and target["n"] == 1
    assert len(windows) == 1  # the object and the chunk, fetched together


def test_verify_and_reads_word_a_bad_tile_alike(tmp_path):
    path = tmp_path / "ck"
    swc.save({"w": FULL}, path)
    chunk = swc.open_checkpoint(path).manifest.tensors["w"].chunks[0]
    with open(path / chunk.file, "r+b") as f:
        f.seek(chunk.payload[0] + 5)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(swc.CorruptCheckpointError) as read:
        swc.read_tensor(path, "w", Block((0, 0), (1, 1)))
    (problem,) = swc.verify(path, raise_on_error=False)
    assert problem.startswith(f"'w' chunk at {chunk.offsets}: ")
    assert problem.split(": ", 1)[1] == str(read.value).removeprefix("'w': ")
