"""Port of the storage-bound tests of PyTorch's test/distributed/checkpoint/test_planner.py
(torch 2.13 era).

Only `TestLoadPlanner` goes through storage (dcp.save / dcp.load with a
`checkpoint_id`); it runs here in one process, as upstream does, with DCP's
FileSystemWriter / FileSystemReader swapped for `shardwise.checkpoint.Writer` /
`Reader`, and once more through `swc.save` / `swc.load`. Every upstream
assertion is kept. In the swc forms `strict=False` stands for
`DefaultLoadPlanner(allow_partial_load=True)` and the error may be shardwise's
own `CheckpointMismatchError`, but it must name the offending key.

Not ported (pure planner logic, no storage involved): TestSavePlan (test_local_plan,
test_local_plan_with_caching, test_global_plan, test_dedup_plans,
test_global_plan_with_caching, test_finish_plan_with_caching, test_local_load_plan,
test_load_with_resharding, test_load_with_world_size_diff_by_one), TestPlannerHelpers
(test_create_read_item_from_chunks, test_merge_delta_local_plans,
test_compare_save_plans) and TestValidateGlobalPlan (test_non_overlapping_chunks,
test_detect_overlapping_chunks).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION

import shardwise.checkpoint as swc
from shardwise.errors import CheckpointMismatchError

from .harness import STOCK, Reader, by_form, ignore_user_warnings, save_as

pytestmark = ignore_user_warnings


def _load(form: str, state_dict: dict, path: Path, allow_partial_load: bool = False) -> None:
    if form == "Writer/Reader" or STOCK:
        dcp.load(
            state_dict=state_dict,
            storage_reader=Reader(path),
            planner=DefaultLoadPlanner(allow_partial_load=allow_partial_load),
        )
    else:
        swc.load(state_dict, path, strict=not allow_partial_load)


@by_form
def test_strict(tmp_path: Path, form: str) -> None:
    # upstream: test_planner.py :: test_strict
    original_module = nn.Linear(2, 2)
    save_as(form, {"module": original_module}, tmp_path)

    new_module = nn.Linear(2, 2)
    new_module.extra_param = nn.Parameter(torch.randn(2, 2))
    extra = new_module.extra_param.detach().clone()
    _load(form, {"module": new_module}, tmp_path, allow_partial_load=True)
    # shardwise extra: the partial load loaded every stored key and left the missing one
    # as it was (upstream checks only that it does not raise)
    assert torch.equal(new_module.weight, original_module.weight)
    assert torch.equal(new_module.bias, original_module.bias)
    assert torch.equal(new_module.extra_param, extra)

    if form == "Writer/Reader":
        with pytest.raises(CheckpointException, match="Missing key in checkpoint"):
            _load(form, {"module": new_module}, tmp_path, allow_partial_load=False)
    else:
        with pytest.raises(
            (CheckpointException, CheckpointMismatchError), match=r"module\.extra_param"
        ):
            _load(form, {"module": new_module}, tmp_path, allow_partial_load=False)


@by_form
def test_load_different_sizes_throws(tmp_path: Path, form: str) -> None:
    # upstream: test_planner.py :: test_load_different_sizes_throws
    original_module = nn.Linear(2, 2)
    save_as(form, {"module": original_module}, tmp_path)

    new_module = nn.Linear(3, 2)
    if form == "Writer/Reader":
        with pytest.raises(CheckpointException, match="Size mismatch"):
            _load(form, {"module": new_module}, tmp_path)
    else:
        with pytest.raises((CheckpointException, CheckpointMismatchError), match=r"module\.weight"):
            _load(form, {"module": new_module}, tmp_path)


@by_form
def test_version_key_in_planner_data(tmp_path: Path, form: str) -> None:
    # upstream: test_planner.py :: test_version_key_in_planner_data
    # (the swc form saves with swc.save and reads with dcp.load + Reader, to see the planner)
    original_module = nn.Linear(2, 2)
    save_as(form, {"module": original_module}, tmp_path)

    new_module = nn.Linear(2, 2)
    planner = DefaultLoadPlanner()
    dcp.load(state_dict={"module": new_module}, storage_reader=Reader(tmp_path), planner=planner)
    assert planner.metadata.version == CURRENT_DCP_VERSION
