"""Issue 20 across ranks: ranks that disagree on `trust_objects` all refuse, and the
crafted object never runs (a spawned test, kept apart so the quick run leaves it out)."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

import shardwise.checkpoint as swc
from shardwise.testing import run_ranks

from .test_untrusted_more import _Payload

pytestmark = pytest.mark.spawned


def _load_trusting_on_rank_1(rank: int, world: int, path: str, marker: str) -> tuple[str, str]:
    target: dict[str, Any] = {"w": torch.zeros(2), "opt": {"groups": [{"fn": None}]}}
    try:
        swc.load(target, path, trust_objects=rank == 1)
    except Exception as e:  # noqa: BLE001 - compared across ranks
        return type(e).__name__, str(e)
    return "no error", ""


def test_ranks_that_disagree_on_trust_objects_all_refuse_and_nothing_runs(tmp_path):
    marker = str(tmp_path / "PWNED")
    swc.save({"w": torch.ones(2), "opt": {"groups": [{"fn": _Payload(marker)}]}}, tmp_path / "c")
    results = run_ranks(_load_trusting_on_rank_1, 2, str(tmp_path / "c"), marker, timeout=60)
    for kind, message in results:
        assert (
            kind == "ArgumentMismatchError"
            and "trust_objects" in message
            and "ranks [1]" in message
        )
    assert not os.path.exists(marker)


def _async_save_result(rank: int, world: int, path: str) -> tuple[str, str]:
    future = swc.async_save({"w": torch.full((4,), float(rank))}, path, overwrite=True)
    try:
        future.result(timeout=30)
    except Exception as e:  # noqa: BLE001 - compared across ranks
        return type(e).__name__, str(e)
    return "no error", ""


def test_async_save_while_another_save_holds_the_lease_fails_every_rank(tmp_path):
    from shardwise.checkpoint.io.lease import Lease
    from shardwise.storage import open_folder

    path = str(tmp_path / "c")
    swc.save({"w": torch.zeros(4)}, path)
    holder = Lease(open_folder(path)).acquire()  # another save, alive in this process
    try:
        results = run_ranks(_async_save_result, 2, path, timeout=60)
    finally:
        holder.release()
    for kind, message in results:
        assert kind == "CheckpointBusyError" and f"pid {os.getpid()}" in message, results
    assert torch.equal(swc.read_tensor(path, "w"), torch.zeros(4))  # the last commit stands
