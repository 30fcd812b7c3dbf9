"""docs/migrating.md's import swap runs a legacy program unchanged (issue 39).

`tests/legacy/legacy_program.py` is written against the legacy
`torch.distributed._shard.sharded_tensor` API only; it runs on 2 and 3 gloo ranks
once with torch 2.13's module and once with `shardwise.legacy` in its place, and
every value it observed (tensors, metadata, which `except` clause caught what) must
be the same.
"""

from __future__ import annotations

import importlib
from typing import Any

import pytest
import torch

from shardwise.testing import run_ranks
from tests.legacy.compare import differences

pytestmark = pytest.mark.spawned

TORCH = "torch.distributed._shard.sharded_tensor"
OURS = "shardwise.legacy"


def _run_program(rank: int, world: int, module_name: str) -> dict[str, Any]:
    from tests.legacy.legacy_program import program

    return program(importlib.import_module(module_name), rank, world)


@pytest.mark.parametrize("world", [2, 3])
def test_legacy_program_runs_unchanged_after_the_import_swap(world):
    theirs = run_ranks(_run_program, world, TORCH, timeout=60)
    ours = run_ranks(_run_program, world, OURS, timeout=60)
    diff = [d for r in range(world) for d in differences(ours[r], theirs[r], f"rank {r}")]
    assert not diff, "\n".join(diff)


def test_the_comparison_can_fail():
    """`differences` sees a changed value, dtype, container type or missing key."""
    base = {"a": (torch.zeros(2), [1, "x"]), "b": torch.float32}
    assert differences(base, base) == []
    assert differences({"a": (torch.ones(2), [1, "x"]), "b": torch.float32}, base)
    assert differences(
        {"a": (torch.zeros(2, dtype=torch.float64), [1, "x"]), "b": torch.float32}, base
    )
    assert differences({"a": [torch.zeros(2), [1, "x"]], "b": torch.float32}, base)
    assert differences({"a": (torch.zeros(2), [1, "x"])}, base)
    assert differences({"a": (torch.zeros(2), [True, "x"]), "b": torch.float32}, base)
