"""Transfers, packing and the agreement rule with ranks as threads (no spawn).

The same engine code as across processes runs here over ThreadedWorld's
in-memory communicator; spawned gloo tests (test_collectives.py) cover the
process-group path itself.
"""

from __future__ import annotations

import pytest
import torch

from shardwise import InvalidTypeError, Layout, LayoutError, ShardedTensor
from shardwise.comm import transfer
from shardwise.testing import shard_of

from .threaded_world import ThreadedRank, ThreadedWorld

FULL = torch.arange(24, dtype=torch.float32).reshape(6, 4)
ROWS = Layout.row_wise((6, 4), [3, 0, 3])  # rank 1 holds nothing
COLS = Layout.column_wise((6, 4), [1, 2, 1])


@pytest.fixture(autouse=True)
def _fresh_staging() -> None:
    transfer.clear_staging_buffers()


def _sharded(comm: ThreadedRank, layout: Layout) -> ShardedTensor:
    shards = shard_of(FULL, layout, comm.rank)
    return ShardedTensor.from_layout(layout, shards, group=comm, rank=comm.rank)


def _redistribute(comm: ThreadedRank, src: Layout, dst: Layout) -> tuple[list, dict, int]:
    stats: dict[str, int] = {}
    out = _sharded(comm, src).redistribute(dst, stats=stats)
    staged = transfer._STAGING.get((torch.device("cpu"), comm.key))
    return out.local_shards(), stats, 0 if staged is None else staged.numel()


def test_rows_to_columns_moves_exactly_the_remote_bytes() -> None:
    world = ThreadedWorld(3)
    results = world.run(_redistribute, ROWS, COLS)
    for rank, (shards, _, _) in enumerate(results):
        assert [s.tolist() for s in shards] == [s.tolist() for s in shard_of(FULL, COLS, rank)]
    # rank 0 sends rows 0-2 of columns 1-3 (9 floats) and gets rows 3-5 of column 0 (3);
    # rank 1 holds nothing and gets columns 1-2 (12); rank 2 mirrors rank 0.
    assert [r[1] for r in results] == [
        {"bytes_sent": 36, "bytes_received": 12},
        {"bytes_sent": 0, "bytes_received": 48},
        {"bytes_sent": 36, "bytes_received": 12},
    ]
    # Packing: several peers go through the staging buffer; one contiguous peer does not.
    assert [r[2] for r in results] == [36, 48, 36]
    assert world.calls == ["all_gather_object", "all_to_all_single"]


def test_one_contiguous_peer_needs_no_staging() -> None:
    src, dst = Layout.row_wise((4, 3), [2, 2]), Layout.row_wise((4, 3), [1, 3])
    full = torch.arange(12, dtype=torch.float64).reshape(4, 3)

    def body(comm: ThreadedRank) -> tuple[list, dict, int]:
        st = ShardedTensor.from_layout(
            src, shard_of(full, src, comm.rank), group=comm, rank=comm.rank
        )
        stats: dict[str, int] = {}
        out = st.redistribute(dst, stats=stats)
        staged = transfer._STAGING.get((torch.device("cpu"), comm.key))
        return [s.tolist() for s in out.local_shards()], stats, staged

    results = ThreadedWorld(2).run(body)
    assert [r[0] for r in results] == [[full[:1].tolist()], [full[1:].tolist()]]
    assert [r[1] for r in results] == [
        {"bytes_sent": 24, "bytes_received": 0},
        {"bytes_sent": 0, "bytes_received": 24},
    ]
    assert [r[2] for r in results] == [None, None]


def test_a_rank_with_another_target_fails_every_rank_before_any_transfer() -> None:
    world = ThreadedWorld(3)

    def body(comm: ThreadedRank) -> object:
        dst = Layout.column_wise((6, 4), [2, 1, 1]) if comm.rank == 1 else COLS
        return _redistribute(comm, ROWS, dst)

    results = world.run(body)
    assert [type(r) for r in results] == [LayoutError] * 3
    assert {str(r) for r in results} == {
        "ranks disagree on redistribute: ranks [1] passed a different source layout, target "
        "layout, dtype or argument than rank 0; every rank must pass the same"
    }
    assert world.calls == ["all_gather_object"]  # no rank reached the all_to_all


def test_a_rank_passing_no_layout_fails_every_rank_naming_it() -> None:
    world = ThreadedWorld(3)

    def body(comm: ThreadedRank) -> object:
        return _redistribute(comm, ROWS, "columns" if comm.rank == 2 else COLS)  # type: ignore[arg-type]

    results = world.run(body)
    assert [type(r) for r in results] == [InvalidTypeError] * 3
    assert {str(r) for r in results} == {"rank 2: redistribute needs a shardwise.Layout, got str"}
    assert world.calls == ["all_gather_object"]
