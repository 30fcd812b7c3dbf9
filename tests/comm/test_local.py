"""`from_local` on real ranks: good input builds the right layout; bad input on one
rank raises the same error on every rank, naming that rank, and the group still works."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist

import shardwise as sw
from shardwise import Block, InvalidTypeError, Layout
from shardwise.testing import run_ranks
from tests.comm.refusal import refuse

pytestmark = pytest.mark.spawned

WORLD = 3
SHAPE = (9, 4)
ROWS = Layout.row_wise(SHAPE, [3, 3, 3])


def _piece(
    rank: int, rows: int = 3, cols: int = 4, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    return torch.full((rows, cols), float(rank), dtype=dtype)


def _bad(rank: int, good: Any, bad: Any) -> Any:
    return bad if rank == 1 else good


# case -> (rank -> the call, exception type); rank 1 is the faulty rank in every case
CASES: dict[str, tuple[Callable[[int], Any], type]] = {
    "layout-wrong-shape": (
        lambda r: sw.from_local(_piece(r, rows=_bad(r, 3, 2)), ROWS),
        sw.ShardMismatchError,
    ),
    "layout-wrong-ndim": (
        lambda r: sw.from_local(_bad(r, _piece(r), torch.zeros(3, 4, 1)), ROWS),
        sw.ShardMismatchError,
    ),
    "layout-dtype": (
        lambda r: sw.from_local(_piece(r, dtype=_bad(r, torch.float32, torch.float64)), ROWS),
        InvalidTypeError,
    ),
    "layout-not-a-tensor": (
        lambda r: sw.from_local(_bad(r, _piece(r), [[1.0] * 4] * 3), ROWS),
        InvalidTypeError,
    ),
    "layout-sharded-tensor": (
        lambda r: sw.from_local(_bad(r, _piece(r), sw.ShardedTensor.zeros(ROWS)), ROWS),
        InvalidTypeError,
    ),
    "layout-differs": (
        lambda r: sw.from_local(
            _piece(r, rows=_bad(r, 3, 4)), _bad(r, ROWS, Layout.row_wise((10, 4), [3, 4, 3]))
        ),
        sw.LayoutError,
    ),
    "layout-world-size": (
        lambda r: sw.from_local(_piece(r), _bad(r, ROWS, Layout.row_wise(SHAPE, [3, 6]))),
        sw.ShardMismatchError,
    ),
    "layout-not-a-layout": (
        lambda r: sw.from_local(_piece(r), _bad(r, ROWS, "rows")),
        InvalidTypeError,
    ),
    "layout-two-blocks": (
        lambda r: sw.from_local(
            _piece(r, rows=[3, 3, 0][r]),
            Layout.row_wise(SHAPE, [3, 3, 3], ranks=[0, 1, 1], world_size=3),
        ),
        sw.ShardMismatchError,
    ),
    "layout-empty-rank-with-data": (
        lambda r: sw.from_local(_piece(r, rows=[6, 2, 3][r]), Layout.row_wise(SHAPE, [6, 0, 3])),
        sw.ShardMismatchError,
    ),
    "mixed-forms": (lambda r: sw.from_local(_piece(r), _bad(r, ROWS, 0)), sw.LayoutError),
    "dim-out-of-range": (
        lambda r: sw.from_local(_piece(r), _bad(r, 0, 2), "infer"),
        sw.LayoutError,
    ),
    "dim-not-an-int": (
        lambda r: sw.from_local(_piece(r), _bad(r, 0, 0.5), "infer"),
        InvalidTypeError,
    ),
    "dim-zero-d-tensor": (
        lambda r: sw.from_local(_bad(r, _piece(r), torch.tensor(1.0)), 0, "infer"),
        sw.LayoutError,
    ),
    "infer-other-dims": (
        lambda r: sw.from_local(_piece(r, cols=_bad(r, 4, 5)), 0, "infer"),
        sw.ShardMismatchError,
    ),
    "infer-wrong-ndim": (
        lambda r: sw.from_local(_bad(r, _piece(r), torch.zeros(3, 4, 1)), 0, "infer"),
        sw.ShardMismatchError,
    ),
    "infer-dtype": (
        lambda r: sw.from_local(_piece(r, dtype=_bad(r, torch.float32, torch.int64)), 0, "infer"),
        InvalidTypeError,
    ),
    "infer-not-a-tensor": (
        lambda r: sw.from_local(_bad(r, _piece(r), None), 0, "infer"),
        InvalidTypeError,
    ),
    "chunk-other-dims": (
        lambda r: sw.from_local(_piece(r, cols=_bad(r, 4, 3)), 0, "chunk"),
        sw.ShardMismatchError,
    ),
    "bad-mode": (
        lambda r: sw.from_local(_piece(r), 0, _bad(r, "infer", "even")),
        sw.InvalidArgumentError,
    ),
    "sizes-sum-wrong": (
        lambda r: sw.from_local(_piece(r), 0, _bad(r, [3, 3, 3], [3, 3, 4])),
        sw.LayoutError,
    ),
    "sizes-not-this-tensor": (
        lambda r: sw.from_local(_piece(r), 0, _bad(r, [3, 3, 3], [3, 4, 2])),
        sw.ShardMismatchError,
    ),
    "sizes-length": (
        lambda r: sw.from_local(_piece(r), 0, _bad(r, [3, 3, 3], [3, 6])),
        sw.ShardMismatchError,
    ),
    "sizes-negative": (
        lambda r: sw.from_local(_piece(r), 0, _bad(r, [3, 3, 3], [6, 3, -3])),
        sw.LayoutError,
    ),
    "sizes-not-ints": (
        lambda r: sw.from_local(_piece(r), 0, _bad(r, [3, 3, 3], [3, "3", 3])),
        InvalidTypeError,
    ),
    "sizes-other-dims": (
        lambda r: sw.from_local(_piece(r, cols=_bad(r, 4, 5)), 0, [3, 3, 3]),
        sw.ShardMismatchError,
    ),
}


def _bad_case(rank: int, world: int, case: str) -> tuple[str, str, float]:
    return refuse(CASES[case][0], rank)


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_on_one_rank_raises_the_same_error_everywhere(case):
    results = run_ranks(_bad_case, WORLD, case, timeout=30)  # a hang fails in 30 s
    assert len(set(results)) == 1, results  # same type and message on every rank
    name, message, total = results[0]
    assert name == CASES[case][1].__name__, results[0]
    assert (
        message.startswith("rank 1: ") and "rank 0:" not in message and "rank 2:" not in message
    ), message
    assert total == WORLD


def _chunk_not_chunked(rank: int, world: int) -> tuple[str, str]:
    try:
        sw.from_local(_piece(rank, rows=[3, 4, 3][rank]), 0, "chunk")  # torch.chunk(10, 3): 4, 4, 2
    except sw.LayoutError as e:
        dist.barrier()
        return type(e).__name__, str(e)
    return "no error", ""


def test_chunk_pattern_mismatch_names_every_rank_off_the_pattern():
    results = run_ranks(_chunk_not_chunked, WORLD, timeout=30)
    assert len(set(results)) == 1, results
    name, message = results[0]
    assert name == "LayoutError" and "torch.chunk" in message
    assert "rank 0" in message and "rank 2" in message and "rank 1:" not in message


def _good(rank: int, world: int) -> list[str]:
    full = torch.arange(36, dtype=torch.float32).reshape(SHAPE)
    bad = []
    built = {
        "layout": sw.from_local(full[3 * rank : 3 * rank + 3].clone(), ROWS),
        "layout-unchecked": sw.from_local(
            full[3 * rank : 3 * rank + 3].clone(), ROWS, run_check=False
        ),
        "infer": sw.from_local(full[3 * rank : 3 * rank + 3].clone(), 0, "infer"),
        "chunk": sw.from_local(full[3 * rank : 3 * rank + 3].clone(), -2, "chunk"),
        "sizes": sw.from_local(full[3 * rank : 3 * rank + 3].clone(), 0, [3, 3, 3]),
        "sizes-unchecked": sw.from_local(
            full[3 * rank : 3 * rank + 3].clone(), 0, (3, 3, 3), run_check=False
        ),
    }
    for name, st in built.items():
        if st.layout_spec != ROWS or not torch.equal(st.full_tensor(), full):
            bad.append(f"rank {rank} {name}: {st.layout_spec}")
    # uneven, with an empty rank that passes an empty piece
    sizes = [5, 0, 4]
    start = sum(sizes[:rank])
    st = sw.from_local(full[:, :3][start : start + sizes[rank]].clone(), 0, "infer")
    if st.layout_spec != Layout.row_wise((9, 3), sizes) or not torch.equal(
        st.full_tensor(), full[:, :3]
    ):
        bad.append(f"rank {rank} uneven infer: {st.layout_spec}")
    return bad


def test_good_input_builds_the_layout_on_every_form():
    assert run_ranks(_good, WORLD, timeout=60) == [[]] * WORLD


def test_one_process_without_a_group():
    layout = Layout((4, 2), {0: [Block((0, 0), (4, 2))]})
    st = sw.from_local(torch.ones(4, 2), layout)
    assert tuple(st.shape) == (4, 2) and st.rank == 0
    assert sw.from_local(torch.ones(4, 2), 1, "infer").layout_spec == layout
    with pytest.raises(sw.ShardMismatchError, match="rank 0: its tensor has shape"):
        sw.from_local(torch.ones(3, 2), layout)
    with pytest.raises(sw.ShardMismatchError, match="sharding_shapes gives it 3"):
        sw.from_local(torch.ones(4, 2), 0, [3])
