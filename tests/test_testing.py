"""The rank harness itself: results, errors from any rank, and hangs that fail fast."""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist

from shardwise.testing import RanksFailed, free_port, run_ranks

pytestmark = pytest.mark.spawned


def _all_reduce(rank: int, world_size: int, x: int) -> int:
    t = torch.tensor([rank * x])
    dist.all_reduce(t)
    return int(t)


def _rank_one_fails(rank: int, world_size: int) -> int:
    if rank == 1:
        raise KeyError("only on rank 1")
    return rank


def _rank_zero_hangs(rank: int, world_size: int) -> None:
    if rank == 0:
        time.sleep(120)
    dist.barrier()


def test_results_by_rank():
    assert run_ranks(_all_reduce, 3, 10, timeout=60) == [30, 30, 30]


def test_an_error_on_one_rank_is_reported():
    with pytest.raises(RanksFailed) as info:
        run_ranks(_rank_one_fails, 2, timeout=60)
    assert isinstance(info.value.errors[1], KeyError) and 0 not in info.value.errors
    got = run_ranks(_rank_one_fails, 2, timeout=60, return_exceptions=True)
    assert got[0] == 0 and isinstance(got[1], KeyError)


def test_a_hang_fails_within_the_timeout():
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="did not finish"):
        run_ranks(_rank_zero_hangs, 2, timeout=6)
    assert time.monotonic() - start < 20


def test_free_port():
    assert 0 < free_port() < 65536
