"""Chunks and objects stored through DCP's stream extensions (`io.read`): a custom
`_extension_registry` is honoured on every read path, and a missing one is named with the
fix (issue 20, point 10)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.testing._internal.distributed.checkpoint_utils import (
    Rot13Example,
    get_test_extension_registry,
)

import shardwise.checkpoint as swc
from shardwise import Block, Layout, ShardedTensor

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


@pytest.mark.parametrize("writer", ["shardwise", "stock"])
@pytest.mark.parametrize("verify", [True, False])
def test_reader_honours_a_custom_extension_on_every_read_path(
    where: str, writer: str, verify: bool
) -> None:
    if writer == "stock" and where.startswith("memory://"):
        pytest.skip("stock FileSystemWriter writes local folders only")
    full = torch.arange(48.0).reshape(6, 8)
    halves = Layout((6, 8), [[Block((0, 0), (3, 8)), Block((3, 0), (3, 8))]])
    saved = {
        "plain": full,  # one chunk, read in parts (below)
        "sharded": ShardedTensor.from_layout(halves, [full[:3], full[3:]], rank=0),
        "meta": {"epoch": 4, "names": ["a", "b"]},
    }
    make = swc.Writer if writer == "shardwise" else dcp.FileSystemWriter
    dcp.save(saved, storage_writer=make(where, _extensions=[Rot13Example()]))
    cols = Layout((6, 8), [[Block((0, 0), (6, 5)), Block((0, 5), (6, 3))]])
    target = {
        "plain": ShardedTensor.from_layout(cols, [torch.zeros(6, 5), torch.zeros(6, 3)], rank=0),
        "sharded": torch.zeros(6, 8),
        "meta": {"epoch": 0, "names": None},
    }
    reader = swc.Reader(where, _extension_registry=get_test_extension_registry(), verify=verify)
    dcp.load(target, storage_reader=reader)
    got = target["plain"].local_shards()
    assert torch.equal(got[0], full[:, :5]) and torch.equal(got[1], full[:, 5:])
    assert torch.equal(target["sharded"], full)
    assert target["meta"] == {"epoch": 4, "names": ["a", "b"]}
    # without the registry the same load names the unknown extension
    with pytest.raises(CheckpointException, match="_extension_registry"):
        dcp.load({"sharded": torch.zeros(6, 8)}, storage_reader=swc.Reader(where))


@pytest.mark.parametrize("writer", ["shardwise", "stock"])
def test_swc_load_and_read_tensor_take_an_extension_registry(writer: str, tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    full = torch.arange(48.0).reshape(6, 8)
    make = swc.Writer if writer == "shardwise" else dcp.FileSystemWriter
    dcp.save(
        {"w": full, "meta": {"epoch": 4}}, storage_writer=make(path, _extensions=[Rot13Example()])
    )
    registry = get_test_extension_registry()
    target = {"w": torch.zeros(6, 8), "meta": {"epoch": 0}}
    swc.load(target, path, extension_registry=registry)
    assert torch.equal(target["w"], full) and target["meta"] == {"epoch": 4}
    band = swc.read_tensor(path, "w", Block((1, 2), (3, 4)), extension_registry=registry)
    assert torch.equal(band, full[1:4, 2:6])
    # without it: the extension is named, with the fix; not taken for damage
    for call in (
        lambda: swc.load({"w": torch.zeros(6, 8)}, path),
        lambda: swc.read_tensor(path, "w"),
    ):
        with pytest.raises(swc.UnsupportedStorageError, match=r"stream\.rot13.*extension_registry"):
            call()


def test_empty_block_target_of_a_transformed_chunk(tmp_path: Path) -> None:
    """A target rank holding nothing of a key still loads the rest."""
    path = tmp_path / "ckpt"
    dcp.save(
        {"w": torch.arange(6.0)}, storage_writer=swc.Writer(path, _extensions=[Rot13Example()])
    )
    layout = Layout((6,), [[Block((2,), (3,))]], allow_holes=True)
    target = {"w": ShardedTensor.from_layout(layout, [torch.zeros(3)], rank=0)}
    dcp.load(
        target, storage_reader=swc.Reader(path, _extension_registry=get_test_extension_registry())
    )
    assert torch.equal(target["w"].local_shards()[0], torch.tensor([2.0, 3.0, 4.0]))
