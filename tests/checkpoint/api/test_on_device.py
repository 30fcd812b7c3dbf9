"""The checked paths of a checkpoint (safe objects, record checks, strict types) with
the state on each device: the CUDA forms run wherever a GPU exists, skip elsewhere."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

import shardwise.checkpoint as swc
from shardwise import Block, CheckpointMismatchError, Layout, ShardedTensor

DEVICES = [
    "cpu",
    pytest.param(
        "cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
    ),
]
FULL = torch.arange(96, dtype=torch.float32).reshape(12, 8)
COLS = Layout((12, 8), [[Block((0, 0), (12, 3)), Block((0, 3), (12, 5))]])
ROWS = Layout((12, 8), [[Block((0, 0), (5, 8)), Block((5, 0), (7, 8))]])


def _state(layout: Layout, device: str, fill: bool) -> dict:
    shards = [
        FULL[b.slices()].clone() if fill else torch.zeros(b.sizes) for b in layout.blocks_of(0)
    ]
    return {
        "w": ShardedTensor.from_layout(layout, [s.to(device) for s in shards], rank=0),
        "bias": (torch.arange(8.0) if fill else torch.zeros(8)).to(device),
        "extra": {"step": 7 if fill else 0, "scale": torch.full((2,), 0.5 if fill else 0.0)},
    }


@pytest.mark.parametrize("device", DEVICES)
def test_save_and_load_in_another_layout_on_the_device(device: str, tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    swc.save(_state(COLS, device, fill=True), path)
    target = _state(ROWS, device, fill=False)
    swc.load(target, path)
    got = target["w"].local_shards()
    assert [t.device.type for t in got] == [device, device]
    assert torch.equal(got[0].cpu(), FULL[:5]) and torch.equal(got[1].cpu(), FULL[5:])
    assert torch.equal(target["bias"].cpu(), torch.arange(8.0))
    assert target["extra"]["step"] == 7  # an object, through the weights-only unpickler
    assert torch.equal(target["extra"]["scale"], torch.full((2,), 0.5))
    band = swc.read_tensor(path, "w", Block((2, 1), (6, 4)))
    assert torch.equal(band, FULL[2:8, 1:5])


@pytest.mark.parametrize("device", DEVICES)
def test_dcp_load_with_reader_fills_device_targets(device: str, tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    dcp.save(_state(COLS, device, fill=True), storage_writer=swc.Writer(path))
    target = _state(ROWS, device, fill=False)
    dcp.load(target, storage_reader=swc.Reader(path))
    got = target["w"].local_shards()
    assert torch.equal(got[0].cpu(), FULL[:5]) and torch.equal(got[1].cpu(), FULL[5:])
    assert target["extra"]["step"] == 7


@pytest.mark.parametrize("device", DEVICES)
def test_a_stored_tensor_into_a_python_value_is_refused_untouched(
    device: str, tmp_path: Path
) -> None:
    path = tmp_path / "ckpt"
    swc.save(_state(COLS, device, fill=True), path)
    target = _state(ROWS, device, fill=False)
    target["bias"] = 0  # a tensor in the checkpoint
    with pytest.raises(CheckpointMismatchError, match="'bias'"):
        swc.load(target, path)
    assert all(not t.any() for t in target["w"].local_shards())  # nothing was filled
