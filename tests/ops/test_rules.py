"""Every op case on 2 and 4 gloo ranks, every layout: values and gradients equal the same
op on the whole tensor, and ops with rules never fall back."""

from __future__ import annotations

import traceback
from typing import Any

import pytest
import torch

import shardwise as sw
from shardwise.ops import FALLBACK_OPS
from shardwise.testing import run_ranks
from tests.ops.cases import CASES, Case, layout_for

pytestmark = pytest.mark.spawned

WORLDS = (2, 4)


def _inputs(case: Case, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g, dtype=torch.float64) for shape in case.shapes]


def _full(value: Any) -> torch.Tensor:
    return value.full_tensor() if isinstance(value, sw.ShardedTensor) else value


def _run_case(case: Case, kind: str, rank: int, world: int, device: str = "cpu") -> str | None:
    """None when the case matches on this rank, else what differs."""
    fulls = [t.to(device) for t in _inputs(case, seed=len(case.name))]
    # reference on whole tensors
    ref_in = [t.clone().requires_grad_() for t in fulls]
    ref_out = case.fn(*ref_in)
    cot = torch.randn(
        ref_out.shape, generator=torch.Generator().manual_seed(7), dtype=ref_out.dtype
    )
    (ref_out * cot).sum().backward()
    # sharded
    ins = []
    for i, t in enumerate(fulls):
        if i in case.sharded:
            layout = layout_for(kind, tuple(t.shape), world)
            shards = [t[b.slices()].clone() for b in layout.blocks_of(rank)]
            st = sw.ShardedTensor.from_layout(layout, shards, dtype=t.dtype, device=t.device)
            ins.append(st.requires_grad_())
        else:
            ins.append(t.clone().requires_grad_())
    before = sum(FALLBACK_OPS.values())
    out = case.fn(*ins)
    if not isinstance(out, sw.ShardedTensor):
        return f"result is a {type(out).__name__}, not a ShardedTensor"
    got = _full(out)
    (got * cot).sum().backward()
    fell_back = sum(FALLBACK_OPS.values()) - before
    problems = []
    if tuple(got.shape) != tuple(ref_out.shape):
        return f"shape {tuple(got.shape)} != {tuple(ref_out.shape)}"
    same = (
        torch.equal(got, ref_out)
        if case.exact
        else torch.allclose(got, ref_out, rtol=1e-10, atol=1e-12)
    )
    if not same:
        problems.append(f"values differ by {(got - ref_out).abs().max().item()}")
    for i, (x, r) in enumerate(zip(ins, ref_in)):
        if x.grad is None:
            problems.append(f"input {i} has no grad")
            continue
        g = _full(x.grad)
        if isinstance(x, sw.ShardedTensor) is False and isinstance(x.grad, sw.ShardedTensor):
            problems.append(f"plain input {i} got a ShardedTensor grad")
        ok = (
            torch.equal(g, r.grad)
            if case.exact
            else torch.allclose(g, r.grad, rtol=1e-10, atol=1e-12)
        )
        if not ok:
            problems.append(f"grad {i} differs by {(g - r.grad).abs().max().item()}")
    if fell_back and not case.fallback_ok:
        problems.append(f"fell back {fell_back} time(s): {sorted(map(str, FALLBACK_OPS))}")
    return "; ".join(problems) or None


def _all_cases(rank: int, world: int, device: str = "cpu") -> dict[str, str | None]:
    torch.manual_seed(1234)  # identical on every rank: the same cotangents
    if device == "cuda":
        torch.cuda.set_device(rank)
        device = f"cuda:{rank}"
    results: dict[str, str | None] = {}
    for case in CASES:
        for kind in case.layouts:
            key = f"{case.name}[{kind}]"
            FALLBACK_OPS.clear()
            try:
                results[key] = _run_case(case, kind, rank, world, device)
            except Exception as e:  # noqa: BLE001 - reported per case
                # This rank left the collective sequence mid-case: stop, or every later
                # case would pair collectives wrongly (the others time out and stop too).
                results[key] = f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=-3)}"
                return results
    return results


@pytest.fixture(scope="module")
def outcomes() -> dict[int, list[dict[str, str | None]]]:
    return {w: run_ranks(_all_cases, w, timeout=240) for w in WORLDS}


@pytest.fixture(scope="module")
def cuda_outcomes() -> list[dict[str, str | None]]:
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA devices (NCCL ranks)")
    return run_ranks(_all_cases, 2, "cuda", timeout=240, backend="nccl")


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("key", [f"{c.name}[{k}]" for c in CASES for k in c.layouts])
def test_op_matches_the_whole_tensor(outcomes: Any, world: int, key: str) -> None:
    per_rank = outcomes[world]
    failures = {
        r: res.get(key, "not run: an earlier case failed on this rank")
        for r, res in enumerate(per_rank)
        if res.get(key, "") is not None
    }
    assert not failures, f"{key} on {world} ranks: {failures}"


@pytest.mark.parametrize("key", [f"{c.name}[{k}]" for c in CASES for k in c.layouts])
def test_op_matches_the_whole_tensor_on_cuda(cuda_outcomes: Any, key: str) -> None:
    failures = {
        r: res.get(key, "not run: an earlier case failed on this rank")
        for r, res in enumerate(cuda_outcomes)
        if res.get(key, "") is not None
    }
    assert not failures, f"{key} on 2 CUDA ranks: {failures}"
