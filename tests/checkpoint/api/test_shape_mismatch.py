"""`swc.load(..., shape_mismatch=[...])`: keys whose stored shape may differ load their
overlap (a vocabulary padded to another multiple), the rest left as it is."""

from __future__ import annotations

import pytest
import torch

import shardwise.checkpoint as swc
from shardwise import Block, Layout, ShardedTensor
from shardwise.errors import CheckpointMismatchError


@pytest.fixture
def saved(tmp_path) -> str:
    path = str(tmp_path / "ck")
    swc.save({"emb": torch.arange(18.0).reshape(6, 3), "b": torch.arange(3.0)}, path)
    return path


def test_a_larger_target_loads_the_stored_rows_and_keeps_the_rest(saved) -> None:
    target = torch.full((8, 3), -1.0)
    swc.load({"emb": target}, saved, shape_mismatch=["emb"])
    assert torch.equal(target[:6], torch.arange(18.0).reshape(6, 3))
    assert torch.equal(target[6:], torch.full((2, 3), -1.0))


def test_a_smaller_target_loads_its_part(saved) -> None:
    target = torch.full((4, 2), -1.0)
    swc.load({"emb": target}, saved, shape_mismatch=["emb"])
    assert torch.equal(target, torch.arange(18.0).reshape(6, 3)[:4, :2])


def test_blocks_past_the_stored_shape_are_left_as_they_are(saved) -> None:
    # one rank's blocks: rows 0-3, rows 4-7 (partly stored), rows 8-9 (not stored at all)
    layout = Layout((10, 3), {0: [Block((0, 0), (4, 3)), Block((4, 0), (4, 3)),
                                  Block((8, 0), (2, 3))]})  # fmt: skip
    st = ShardedTensor.full(layout, -1.0, rank=0)
    swc.load({"emb": st}, saved, shape_mismatch=["emb"])
    stored = torch.arange(18.0).reshape(6, 3)
    first, middle, last = st.local_shards()
    assert torch.equal(first, stored[:4])
    assert torch.equal(middle[:2], stored[4:]) and torch.equal(middle[2:], torch.full((2, 3), -1.0))
    assert torch.equal(last, torch.full((2, 3), -1.0))


def test_without_the_option_or_with_another_rank_the_shape_is_refused(saved) -> None:
    target = torch.full((8, 3), -1.0)
    with pytest.raises(CheckpointMismatchError) as info:
        swc.load({"emb": target}, saved)
    assert "'emb' shape (8, 3) here, (6, 3) in the checkpoint" in str(info.value)
    with pytest.raises(CheckpointMismatchError) as info:
        swc.load({"emb": torch.zeros(18)}, saved, shape_mismatch=["emb"])
    assert "'emb' shape (18,) here, (6, 3) in the checkpoint" in str(info.value)
    with pytest.raises(CheckpointMismatchError):  # only the keys named
        swc.load({"emb": target, "b": torch.zeros(4)}, saved, shape_mismatch=["emb"])
    assert torch.equal(target, torch.full((8, 3), -1.0))  # nothing loaded before the refusal
