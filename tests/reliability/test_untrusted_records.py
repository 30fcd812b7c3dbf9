"""A stock `torch.save` record whose storage claims fewer bytes than its tensor needs.

Found by review: the record's payload size comes from the storage's element count
in its `data.pkl`, which the file controls. A record claiming 0 elements (or 2 of
4, the file cut after them) must be refused as damaged by every reader, never
leave a target unfilled or return uninitialized memory while reporting success.
"""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

import shardwise.checkpoint as swc
from shardwise.errors import CorruptCheckpointError


def _stock_with_numel(folder: Path, numel: int, truncate: bool) -> None:
    """A stock checkpoint of `w` = [1, 2, 3, 4] whose record's storage claims `numel`
    elements; `truncate`: the file cut after those, and `.metadata` made to agree."""
    dcp.save({"w": torch.arange(4, dtype=torch.float32) + 1}, checkpoint_id=folder, no_dist=True)
    md = pickle.loads((folder / ".metadata").read_bytes())
    info = next(iter(md.storage_data.values()))
    path = folder / info.relative_path
    data = bytearray(path.read_bytes())
    at = data.find(b"K\x04", data.find(b"cpu"))  # the persistent id's numel, 4
    assert at > 0
    data[at + 1] = numel
    if truncate:
        payload = data.find(bytes(torch.tensor([1.0, 2.0]).numpy().tobytes()))
        data = data[: payload + 4 * numel]
        info.length = len(data) - info.offset
        (folder / ".metadata").write_bytes(pickle.dumps(md))
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("numel, truncate", [(0, False), (2, True)], ids=["numel-0", "numel-2-cut"])
def test_every_reader_refuses_a_record_short_of_its_tensor(tmp_path, numel, truncate):
    _stock_with_numel(tmp_path, numel, truncate)
    target = {"w": torch.full((4,), -7.0)}
    with pytest.raises(CorruptCheckpointError, match="'w'"):
        swc.load(target, tmp_path)
    assert torch.equal(target["w"], torch.full((4,), -7.0))  # refused before any read
    with pytest.raises(CorruptCheckpointError):
        swc.open_checkpoint(tmp_path).read("w")
    through_dcp = {"w": torch.full((4,), -7.0)}
    with pytest.raises(CheckpointException) as refused:  # DCP wraps what the reader raises
        dcp.load(through_dcp, storage_reader=swc.Reader(tmp_path), no_dist=True)
    assert "fewer than its (4,) torch.float32 elements need (16)" in str(refused.value)
    assert torch.equal(through_dcp["w"], torch.full((4,), -7.0))
