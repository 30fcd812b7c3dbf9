"""A rank that dies mid-job makes the others fail with an error, not hang.

The knob is the process group's timeout (`init_process_group(timeout=...)`);
gloo usually notices a dead peer at once (connection closed).
"""

from __future__ import annotations

import os
import time

import pytest

from shardwise import Layout, ShardedTensor
from shardwise.testing import RankFailure, run_ranks

pytestmark = pytest.mark.spawned

# Measured on 2 shared cores (33 runs, the three ops): the survivor raised 0.002-0.10 s
# after its peer died (gloo sees the closed connection). 1 s is 10x the slowest; the
# harness (and the process group's own timeout, 35 s) only catches a hang.
BUDGET_S = 1.0
HARNESS_TIMEOUT_S = 40


def _die_then(rank: int, world: int, op: str, folder: str) -> tuple[str, float]:
    import shardwise.checkpoint as swc

    state = ShardedTensor.zeros(Layout.chunked((64, 8), 0, world))
    if rank == 1:
        os._exit(3)  # dies without a word, mid-job
    start = time.monotonic()
    try:
        if op == "redistribute":
            state.redistribute(Layout.chunked((64, 8), 1, world))
        elif op == "full_tensor":
            state.full_tensor()
        else:
            swc.load({"w": state}, folder)
    except Exception as e:  # noqa: BLE001
        return type(e).__name__, time.monotonic() - start
    return "no error", time.monotonic() - start


def _save(rank: int, world: int, folder: str) -> None:
    import shardwise.checkpoint as swc

    swc.save({"w": ShardedTensor.zeros(Layout.chunked((64, 8), 0, world))}, folder)


@pytest.mark.parametrize("op", ["redistribute", "full_tensor", "load"])
def test_survivors_fail_promptly(op, tmp_path):
    run_ranks(_save, 2, str(tmp_path / "ckpt"), timeout=HARNESS_TIMEOUT_S)
    results = run_ranks(
        _die_then, 2, op, str(tmp_path / "ckpt"), timeout=HARNESS_TIMEOUT_S, allow_dead=True
    )
    assert isinstance(results[1], RankFailure)
    kind, seconds = results[0]
    assert kind != "no error" and seconds < BUDGET_S, results[0]
