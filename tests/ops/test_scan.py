"""`cumsum`, `cumprod` and `logcumsumexp` along a split dim on 3 gloo ranks: integers
promoted to int64 as torch does (and wrapping alike), `dtype=`, replicas counted once, a
rank holding nothing, several blocks a rank, -inf and zeros carried, exact values where
the join is exact, no fallback."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import shardwise as sw
from shardwise import Block, Layout
from shardwise.ops import FALLBACK_OPS
from shardwise.testing import run_ranks

pytestmark = pytest.mark.spawned

FULL = torch.arange(8 * 3).reshape(8, 3) % 7 - 3
LAYOUTS = {
    "uneven rows": Layout.row_wise((8, 3), [5, 0, 3]),
    # rows 0-1 on ranks 0 and 2 (replicas), rows 2-3 and 6-7 on rank 1, rows 4-5 on rank 0
    "replicas and several blocks": Layout(
        (8, 3),
        {
            0: [Block((0, 0), (2, 3)), Block((4, 0), (2, 3))],
            1: [Block((6, 0), (2, 3)), Block((2, 0), (2, 3))],
            2: [Block((0, 0), (2, 3))],
        },
        3,
    ),
}


def _run(rank: int, world: int) -> dict[str, Any]:
    out = {}
    for name, layout in LAYOUTS.items():
        for op, kind, full, kwargs in (
            ("cumsum", "int", FULL, {}),
            ("cumsum", "int to float64", FULL, {"dtype": torch.float64}),
            ("cumsum", "float32", FULL.float() / 3, {}),
            # int64 products wrap: a carry joined by a wrapping product wraps alike
            ("cumprod", "int", FULL * 1000 + 7, {}),
            ("cumprod", "int32 with a zero", FULL.int(), {}),
            ("cumprod", "float32", FULL.float() / 2, {}),
            ("logcumsumexp", "float64 with -inf", torch.log(FULL.double() + 3), {}),
        ):
            st = sw.ShardedTensor.from_layout(
                layout, [full[b.slices()].clone() for b in layout.blocks_of(rank)], dtype=full.dtype
            )
            FALLBACK_OPS.clear()
            got = getattr(st, op)(0, **kwargs)
            want = getattr(full, op)(0, **kwargs)
            whole = got.full_tensor()
            out[(name, op, kind)] = (
                whole.dtype == want.dtype,
                torch.equal(whole, want)
                if "float" not in kind
                else torch.allclose(whole, want, rtol=1e-6, atol=1e-6, equal_nan=True),
                {str(k): v for k, v in FALLBACK_OPS.items()},
            )
    return out


def test_scans_along_the_split_dim_carry_the_earlier_blocks() -> None:
    per_rank = run_ranks(_run, 3, timeout=120)
    for rank, got in enumerate(per_rank):
        for key, (dtype_ok, equal, fallbacks) in got.items():
            assert dtype_ok and equal, (rank, key)
            assert fallbacks == {}, (rank, key, fallbacks)


# torch accumulates a float scan in a wider type: a carry that overflows or cancels in
# the result's dtype would not come back (found by review: inf where torch recovers)
WIDE = {
    "cumsum float32, cancelling": (torch.tensor([1e8, 1.0, -1e8, 0.0]), "cumsum"),
    "cumsum float32, past the largest float": (torch.tensor([3e38, 3e38, -3e38, 0.0]), "cumsum"),
    "cumsum float16, past the largest half": (
        torch.tensor([6e4, 6e4, -6e4, 0.0]).half(),
        "cumsum",
    ),
    "cumprod float32, past the largest float": (
        torch.tensor([1e30, 1e30, 1e-30, 1.0]),
        "cumprod",
    ),
}


def _wide(rank: int, world: int) -> dict[str, Any]:
    layout = Layout.row_wise((4,), [2, 2])
    out = {}
    for name, (full, op) in WIDE.items():
        shards = [full[b.slices()].clone() for b in layout.blocks_of(rank)]
        st = sw.ShardedTensor.from_layout(layout, shards, dtype=full.dtype)
        out[name] = getattr(st, op)(0).full_tensor()
    return out


def test_scans_carry_in_torchs_accumulation_type() -> None:
    for got in run_ranks(_wide, 2, timeout=60):
        for name, (full, op) in WIDE.items():
            assert torch.equal(got[name], getattr(full, op)(0)), (name, got[name])


def _explicit(rank: int, world: int) -> dict[str, Any]:
    layout = Layout.row_wise((6,), [3, 3])
    cases = {
        # an integer result dtype: no promotion to int64 (one rank raised, the other hung)
        "cumsum int32 dtype=int32": (torch.arange(1, 7, dtype=torch.int32), torch.int32),
        "cumsum bool dtype=int32": (
            torch.tensor([1, 0, 1, 1, 0, 1], dtype=torch.bool),
            torch.int32,
        ),
        "cumprod int64 dtype=int8": (torch.arange(1, 7), torch.int8),
        # int16, which gloo does not send: the carries travel as bytes
        "cumsum int32 dtype=int16": (torch.arange(1, 7, dtype=torch.int32) * 5000, torch.int16),
        # a narrower float: the input rounded to it first, as torch does
        "cumsum float64 dtype=float32": (
            torch.full((6,), 1 + 0.6 * 2.0**-23, dtype=torch.float64),
            torch.float32,
        ),
        "cumprod float64 dtype=float32": (
            1 + torch.arange(6, dtype=torch.float64) / 7,
            torch.float32,
        ),
    }
    out = {}
    for name, (full, dtype) in cases.items():
        op = name.split()[0]
        shards = [full[b.slices()].clone() for b in layout.blocks_of(rank)]
        st = sw.ShardedTensor.from_layout(layout, shards, dtype=full.dtype)
        got = getattr(st, op)(0, dtype=dtype).full_tensor()
        out[name] = torch.equal(got, getattr(full, op)(0, dtype=dtype))
    return out


def test_scans_with_an_explicit_dtype_match_torch() -> None:
    for got in run_ranks(_explicit, 2, timeout=60):
        assert got == dict.fromkeys(got, True) and len(got) == 6, got
