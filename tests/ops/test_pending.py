"""A reduction along a sharded dimension is combined on first use (DTensor's `Partial`),
on 3 gloo ranks with uneven pieces and a rank that holds nothing: the collectives each
step runs are counted, every value is compared with torch on the whole tensor."""

from __future__ import annotations

import functools
import math
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import Replicate

import shardwise as sw
from shardwise import Layout
from shardwise.testing import run_ranks

pytestmark = pytest.mark.spawned

ROWS = [4, 0, 3]  # rank 1 holds nothing


class _Counted:
    """Counts `dist.all_reduce` calls while installed (the ops call it through `dist`)."""

    def __init__(self) -> None:
        self.calls = 0
        self._real = dist.all_reduce

    def __enter__(self) -> _Counted:
        real = self._real

        @functools.wraps(real)
        def counted(*args: Any, **kwargs: Any) -> Any:
            self.calls += 1
            return real(*args, **kwargs)

        dist.all_reduce = counted
        return self

    def __exit__(self, *exc: Any) -> None:
        dist.all_reduce = self._real


def _inputs(rank: int) -> tuple[torch.Tensor, Any]:
    # eighths: every sum below is exact in float64, whatever the order
    full = torch.arange(42, dtype=torch.float64).reshape(7, 6) / 8 - 2
    layout = Layout.row_wise((7, 6), ROWS)
    x = sw.ShardedTensor.from_layout(
        layout, [full[b.slices()].clone() for b in layout.blocks_of(rank)], dtype=full.dtype
    )
    return full, x


def _sum_and_backward(rank: int, world: int) -> dict[str, Any]:
    full, x = _inputs(rank)
    x.requires_grad_()
    out: dict[str, Any] = {}
    with _Counted() as c:
        loss = x.sum()
        out["pending"] = loss.pending_reduce
        # the placement of its values, which every API returns (to_local() combines)
        out["placements"] = [p == Replicate() for p in loss.placements]
        out["repr"] = "pending='sum'" in repr(loss)
        loss.backward()
    out["all_reduces for sum + backward"] = c.calls
    out["grad"] = torch.equal(x.grad.full_tensor(), torch.ones(7, 6, dtype=torch.float64))
    alias = loss.detach()
    with _Counted() as c:
        value = alias.full_tensor()
        again = loss.full_tensor()
    out["all_reduces for two reads of aliases"] = c.calls
    out["value"] = value.item() == full.sum().item() == again.item()
    out["pending after read"] = loss.pending_reduce
    return out


def test_a_loss_that_is_only_differentiated_combines_nothing() -> None:
    for rank, out in enumerate(run_ranks(_sum_and_backward, 3, timeout=60)):
        assert out == {
            "pending": "sum",
            "placements": [True],
            "repr": True,
            "all_reduces for sum + backward": 0,
            "grad": True,
            "all_reduces for two reads of aliases": 1,
            "value": True,
            "pending after read": None,
        }, f"rank {rank}"


def _linear_ops(rank: int, world: int) -> dict[str, Any]:
    full, x = _inputs(rank)
    out: dict[str, Any] = {}
    with _Counted() as c:
        a, b = x.sum(dim=0), (x * x).mean()
        y = (-(a * 2.0) / 4 + a.sum() * 3).t()
        z = y.view(1, 6)[:, 1:4].unsqueeze(0) - b
    out["kept pending"] = [t.pending_reduce for t in (a, b, y, z)]
    out["all_reduces while kept"] = c.calls
    expect_a = full.sum(dim=0)
    expect_y = -(expect_a * 2.0) / 4 + expect_a.sum() * 3.0
    expect_z = expect_y.view(1, 6)[:, 1:4].unsqueeze(0) - (full * full).mean()
    with _Counted() as c:
        got = z.full_tensor()
    out["one all_reduce to read"] = c.calls
    out["z"] = torch.allclose(got, expect_z, rtol=0, atol=1e-12)
    # a value added to a pending sum would be added once per rank: combined first
    plus = a + 1.0
    out["a + 1"] = (
        plus.pending_reduce,
        torch.allclose(plus.full_tensor(), expect_a + 1, atol=1e-12),
    )
    # a product of two pending sums is not linear in either: combined first
    sq = b * b
    out["b * b"] = (sq.pending_reduce, torch.allclose(sq.full_tensor(), (full * full).mean() ** 2))
    # a value divided by a pending sum: combined first
    inv = 1.0 / a
    out["1 / a"] = (inv.pending_reduce, torch.allclose(inv.full_tensor(), 1.0 / expect_a))
    # integer parts would round before the sum: combined first
    rounded = (x.sum(dim=0) * 10).to(torch.int64)
    out["to int"] = (
        rounded.pending_reduce,
        torch.equal(rounded.full_tensor(), (expect_a * 10).to(torch.int64)),
    )
    return out


def test_ops_linear_in_a_pending_sum_keep_it_and_others_combine_first() -> None:
    for rank, out in enumerate(run_ranks(_linear_ops, 3, timeout=60)):
        assert out == {
            "kept pending": ["sum", "sum", "sum", "sum"],
            "all_reduces while kept": 0,
            "one all_reduce to read": 1,
            "z": True,
            "a + 1": (None, True),
            "b * b": (None, True),
            "1 / a": (None, True),
            "to int": (None, True),
        }, f"rank {rank}"


def _extrema(rank: int, world: int) -> dict[str, Any]:
    full, x = _inputs(rank)
    out: dict[str, Any] = {}
    hi, lo = x.amax(dim=0), x.min()
    out["pending"] = (hi.pending_reduce, lo.pending_reduce)
    flipped = hi.t().unsqueeze(0)  # views commute with a max
    out["view of a max"] = flipped.pending_reduce
    negated = -hi  # the negation of a max is not the max of negations: combined first
    out["-max"] = (negated.pending_reduce, torch.equal(negated.full_tensor(), -full.amax(dim=0)))
    out["max"] = torch.equal(flipped.full_tensor(), full.amax(dim=0).unsqueeze(0))
    out["min"] = lo.full_tensor().item() == full.min().item()
    n = torch.linalg.vector_norm(x, ord=float("inf"))
    out["inf-norm"] = (n.pending_reduce, n.full_tensor().item() == full.abs().max().item())
    two = torch.linalg.vector_norm(x)  # a root of the combined sum: at once
    out["2-norm"] = (two.pending_reduce, torch.allclose(two.full_tensor(), full.norm()))
    v, s = x.var(dim=0), x.std(dim=0)
    out["var"] = (v.pending_reduce, torch.allclose(v.full_tensor(), full.var(dim=0)))
    out["std"] = (s.pending_reduce, torch.allclose(s.full_tensor(), full.std(dim=0)))
    return out


def test_extrema_norms_and_variances() -> None:
    for rank, out in enumerate(run_ranks(_extrema, 3, timeout=60)):
        assert out == {
            "pending": ("max", "min"),
            "view of a max": "max",
            "-max": (None, True),
            "max": True,
            "min": True,
            "inf-norm": ("max", True),
            "2-norm": (None, True),
            "var": ("sum", True),
            "std": (None, True),
        }, f"rank {rank}"


def _reads_and_writes(rank: int, world: int) -> dict[str, Any]:
    full, x = _inputs(rank)
    out: dict[str, Any] = {}
    s = x.sum(dim=0)
    view = s.view(2, 3)  # a view of the parts, taken before the combine
    out["local_shards combines"] = torch.allclose(s.local_shards()[0], full.sum(dim=0))
    with _Counted() as c:
        read = view.full_tensor()
    out["the view reads its base's values"] = (view.pending_reduce, c.calls)
    out["view"] = torch.equal(read, full.sum(dim=0).view(2, 3))
    t = x.sum()
    t.add_(1.0)  # in place: combined, then written
    out["add_"] = (t.pending_reduce, torch.allclose(t.full_tensor(), full.sum() + 1))
    u = x.sum()
    z = torch.zeros_like(u)  # reads only the shape
    out["zeros_like"] = (z.pending_reduce, u.pending_reduce, z.full_tensor().item())
    # printing on one rank alone must not combine (the others would never join)
    v = x.sum()
    if rank == 0:
        repr(v)
        str(v.placements)
    out["after one rank printed"] = v.pending_reduce
    out["item"] = v.item() == full.sum().item()
    return out


def test_reading_combines_printing_does_not() -> None:
    for rank, out in enumerate(run_ranks(_reads_and_writes, 3, timeout=60)):
        assert out == {
            "local_shards combines": True,
            "the view reads its base's values": (None, 0),
            "view": True,
            "add_": (None, True),
            "zeros_like": (None, "sum", 0.0),
            "after one rank printed": "sum",
            "item": True,
        }, f"rank {rank}"


def _weight_gradient(rank: int, world: int) -> dict[str, Any]:
    full, x = _inputs(rank)
    g = torch.Generator().manual_seed(5)
    w = torch.randn(5, 6, generator=g, dtype=torch.float64)
    layout = Layout.replicated((5, 6), world)
    weight = sw.ShardedTensor.from_layout(layout, [w.clone()]).requires_grad_()
    out: dict[str, Any] = {}
    with _Counted() as c:
        for _ in range(2):  # accumulated: pending + pending stays pending
            F.linear(x, weight).sum().backward()
    out["all_reduces for two steps"] = c.calls
    out["grad pending"] = weight.grad.pending_reduce
    out["grad placements"] = [p == Replicate() for p in weight.grad.placements]
    expected_grad = 2 * torch.ones(7, 5, dtype=torch.float64).t() @ full
    opt = torch.optim.SGD([weight], lr=0.5)
    with _Counted() as c:
        opt.step()
    out["all_reduces in the step"] = c.calls
    out["weight"] = torch.allclose(weight.full_tensor(), w - 0.5 * expected_grad, atol=1e-12)
    with _Counted() as c:
        opt.zero_grad()  # set_to_none: the next gradient is a new pending one
        for _ in range(2):
            F.linear(x, weight).sum().backward()
        weight.grad.mul_(0.25)
        scaled = weight.grad.pending_reduce
        snapshot = weight.grad.clone()  # its own parts: zero_ below leaves them
        weight.grad.zero_()
    out["zero_grad, two steps, mul_, zero_"] = (c.calls, scaled, weight.grad.pending_reduce)
    out["zeroed"] = torch.equal(weight.grad.full_tensor(), torch.zeros(5, 6, dtype=torch.float64))
    out["scaled"] = torch.allclose(snapshot.full_tensor(), 0.25 * expected_grad, atol=1e-12)
    return out


def test_a_weight_gradient_is_combined_when_the_optimizer_reads_it() -> None:
    for rank, out in enumerate(run_ranks(_weight_gradient, 3, timeout=60)):
        assert out == {
            "all_reduces for two steps": 0,
            "grad pending": "sum",
            "grad placements": [True],
            "all_reduces in the step": 1,
            "weight": True,
            "zero_grad, two steps, mul_, zero_": (0, "sum", "sum"),
            "zeroed": True,
            "scaled": True,
        }, f"rank {rank}"


def _aliases_and_views(rank: int, world: int) -> dict[str, Any]:
    """Writes through a pending result, its views and its aliases are seen by all of
    them, before and after the combine, as for any tensor and its views."""
    import copy

    full, x = _inputs(rank)
    total = full.sum(dim=0)
    out: dict[str, Any] = {}

    s = x.sum(dim=0)
    v = s.view(2, 3)
    s.full_tensor()
    s.mul_(2)  # after the combine, into the values: the view sees it
    out["base written after combine"] = torch.equal(v.full_tensor().flatten(), 2 * total)

    s = x.sum(dim=0)
    v = s.view(2, 3)
    s.full_tensor()
    v.mul_(2)
    out["view written after combine"] = torch.equal(s.full_tensor(), 2 * total)

    s = x.sum(dim=0)
    v = s.view(2, 3)
    s.add_(s.detach())  # before the combine, into the parts
    out["base written before combine"] = (
        v.pending_reduce,
        torch.equal(v.full_tensor().flatten(), 2 * total),
    )

    s = x.sum(dim=0)
    s[0] = 100.0
    s.select(0, 1).fill_(7.0)
    s[2:4] += 1
    expected = total.clone()
    expected[0], expected[1] = 100.0, 7.0
    expected[2:4] += 1
    out["written through selections"] = torch.equal(s.full_tensor(), expected)

    s = x.sum(dim=0)
    d = s.detach()
    s.full_tensor()
    out["deepcopy of a combined alias"] = torch.equal(copy.deepcopy(d).full_tensor(), total)
    pending_copy = copy.deepcopy(x.sum(dim=0))
    out["deepcopy of a pending one"] = (
        pending_copy.pending_reduce,
        torch.equal(pending_copy.full_tensor(), total),
    )
    return out


def test_writes_through_views_and_aliases_are_seen_by_all() -> None:
    for rank, out in enumerate(run_ranks(_aliases_and_views, 3, timeout=60)):
        assert out == {
            "base written after combine": True,
            "view written after combine": True,
            "base written before combine": ("sum", True),
            "written through selections": True,
            "deepcopy of a combined alias": True,
            "deepcopy of a pending one": ("sum", True),
        }, f"rank {rank}"


def _exactness(rank: int, world: int) -> dict[str, Any]:
    """Ops kept pending only where running them on the parts gives the value exactly."""
    full, x = _inputs(rank)
    out: dict[str, Any] = {}
    # an integer sum of a float sum: each part would be rounded before the sum
    as_int = x.sum().sum(dtype=torch.int64)
    out["sum into int64"] = (as_int.pending_reduce, as_int.item() == int(full.sum().item()))
    # parts that cancel: a downcast of each would lose them (fp16: inf - inf)
    layout = Layout.row_wise((3,), [1, 1, 1])
    part = {0: [70000.5], 1: [-70000.0], 2: [0.0]}[rank]
    y = sw.ShardedTensor.from_layout(layout, [torch.tensor(part, dtype=torch.float64)])
    half = y.sum().to(torch.float16)
    out["downcast"] = (half.pending_reduce, half.item())
    wide = y.sum().to(torch.complex128)
    out["widening"] = (wide.pending_reduce, wide.item() == 0.5)
    # a rank's part is 0 (rank 1 holds nothing): 0 * inf and 0 / 0 are nan
    absolute = x.abs().sum()
    out["* inf"] = (absolute * math.inf).item()
    out["/ 0"] = (absolute / 0.0).item()
    out["var, correction >= count"] = torch.isinf(x.var(dim=0, correction=7).full_tensor()).all()
    scaled = x.abs().sum() * 2  # a fresh one: `absolute` was combined above
    out["* 2"] = (scaled.pending_reduce, scaled.item() == 2 * full.abs().sum().item())
    return out


def test_only_exact_ops_keep_a_result_pending() -> None:
    for rank, out in enumerate(run_ranks(_exactness, 3, timeout=60)):
        assert out == {
            "sum into int64": (None, True),
            "downcast": (None, 0.5),
            "widening": ("sum", True),
            "* inf": math.inf,
            "/ 0": math.inf,
            "var, correction >= count": True,
            "* 2": ("sum", True),
        }, f"rank {rank}"


def _saved(rank: int, world: int, folder: str) -> dict[str, Any]:
    """A pending value in a state dict: only one rank writes a replicated value, but every
    rank combines it while planning (else that rank's read would wait alone)."""
    import torch.distributed.checkpoint as dcp

    from shardwise import checkpoint as swc

    full, x = _inputs(rank)
    out: dict[str, Any] = {}
    state = {"stat": x.mean(dim=0), "x": x}
    swc.save(state, f"{folder}/sw")
    out["swc.save combined"] = state["stat"].pending_reduce
    state = {"stat": x.mean(dim=0), "x": x}
    dcp.save(state, checkpoint_id=f"{folder}/dcp")
    out["dcp.save combined"] = state["stat"].pending_reduce
    target = {"stat": torch.zeros(6, dtype=torch.float64)}
    dcp.load(target, checkpoint_id=f"{folder}/dcp")
    back = {"stat": torch.zeros(6, dtype=torch.float64)}
    swc.load(back, f"{folder}/sw")
    # each part divided by 7 before the sum: equal up to rounding
    out["values"] = torch.allclose(target["stat"], full.mean(dim=0), rtol=0, atol=1e-12) and (
        torch.equal(back["stat"], target["stat"])
    )
    return out


def test_saving_a_pending_value_combines_it_on_every_rank(tmp_path: Any) -> None:
    results = run_ranks(_saved, 3, str(tmp_path), timeout=90)
    for rank, out in enumerate(results):
        assert out == {
            "swc.save combined": None,
            "dcp.save combined": None,
            "values": True,
        }, f"rank {rank}"


def _dtypes_and_views(rank: int, world: int) -> dict[str, Any]:
    """Arithmetic on parts only where it keeps their dtype and range; views that cannot
    view the parts combine first."""
    import pickle

    from shardwise.errors import UsageError

    def one_each(values: dict[int, float], dtype: torch.dtype) -> Any:
        layout = Layout.row_wise((3,), [1, 1, 1])
        return sw.ShardedTensor.from_layout(
            layout, [torch.tensor([values.get(rank, 0)], dtype=dtype)]
        ).sum()

    out: dict[str, Any] = {}
    big = {0: 2**24 + 1, 2: -(2**24)}  # float32 rounds each part, not their sum (1)
    out["int64 to float32"] = one_each(big, torch.int64).float().item()
    out["int64 * 1.0"] = (one_each(big, torch.int64) * 1.0).item()
    out["int64 * 3"] = (lambda t: (t.pending_reduce, t.item()))(one_each(big, torch.int64) * 3)
    out["int64 + float32 sum"] = (
        one_each(big, torch.int64) + one_each({0: 0.5}, torch.float32)
    ).item()
    half = {0: 40000.0, 2: -39968.0}  # float16 parts overflow when doubled; their sum is 32
    out["float16 * 2"] = (one_each(half, torch.float16) * 2).item()
    out["float16 + itself"] = (lambda t: (t + t).item())(one_each(half, torch.float16))
    out["float16 neg"] = (lambda t: (t.pending_reduce, t.item()))(-one_each(half, torch.float16))
    zero_here = {0: 1.0, 2: 2.0}  # rank 1's part is 0: 0 * inf would be nan
    a, b = one_each(zero_here, torch.float64), one_each(zero_here, torch.float64)
    out["add, alpha=inf"] = torch.add(a, b, alpha=math.inf).item()
    # a view of parts laid out otherwise (a transposed gradient): combined, then reshaped
    full = torch.arange(42, dtype=torch.float64).reshape(7, 2, 3)
    layout = Layout.row_wise((7, 2, 3), [4, 0, 3])
    x = sw.ShardedTensor.from_layout(
        layout, [full[b.slices()].clone() for b in layout.blocks_of(rank)], dtype=full.dtype
    )
    flat = x.sum(0).t().reshape(-1)
    out["t().reshape(-1)"] = torch.equal(flat.full_tensor(), full.sum(0).t().reshape(-1))
    # pickling needs the values: refused while pending (rank 0 alone would wait forever)
    pending = x.sum()
    try:
        pickle.dumps(pending)
        out["pickle"] = "pickled"
    except UsageError as e:
        out["pickle"] = "read it on every rank first" in str(e)
    pending.full_tensor()
    out["pickle once read"] = pickle.loads(pickle.dumps(pending)).item() == full.sum().item()
    return out


def test_arithmetic_keeps_parts_only_in_their_dtype_and_range() -> None:
    for rank, out in enumerate(run_ranks(_dtypes_and_views, 3, timeout=60)):
        assert out == {
            "int64 to float32": 1.0,
            "int64 * 1.0": 1.0,
            "int64 * 3": ("sum", 3),
            "int64 + float32 sum": 1.5,
            "float16 * 2": 64.0,
            "float16 + itself": 64.0,
            "float16 neg": ("sum", -32.0),
            "add, alpha=inf": math.inf,
            "t().reshape(-1)": True,
            "pickle": True,
            "pickle once read": True,
        }, f"rank {rank}"


class _Unpicklable:
    def __reduce__(self) -> Any:
        raise RuntimeError("not on this rank")


def _failed_save(rank: int, world: int, folder: str) -> str:
    """One rank fails to describe its state: every rank raises its error (the pending
    value was combined before, by every rank), none waits in a collective."""
    from shardwise import checkpoint as swc
    from shardwise.errors import InvalidTypeError

    _, x = _inputs(rank)
    state = {"obj": _Unpicklable() if rank == 1 else 1, "stat": x.mean(dim=0)}
    try:
        swc.save(state, folder)
    except InvalidTypeError as e:
        return str(e)
    return "saved"


def test_a_save_one_rank_fails_to_describe_raises_on_every_rank(tmp_path: Any) -> None:
    errors = run_ranks(_failed_save, 3, str(tmp_path / "ckpt"), timeout=60)
    assert all("object 'obj' cannot be pickled" in e for e in errors), errors


def _on_device(rank: int, world: int, kind: str) -> dict[str, Any]:
    """The loss and weight-gradient paths on 2 ranks: gloo on the CPU, or NCCL with one
    GPU each."""
    device = torch.device("cuda", rank) if kind == "cuda" else torch.device("cpu")
    full = torch.arange(42, dtype=torch.float64).reshape(7, 6) / 8 - 2
    layout = Layout.row_wise((7, 6), [4, 3])
    x = sw.ShardedTensor.from_layout(
        layout, [full[b.slices()].to(device) for b in layout.blocks_of(rank)]
    ).requires_grad_()
    w = torch.ones(5, 6, dtype=torch.float64)
    weight = sw.ShardedTensor.from_layout(
        Layout.replicated((5, 6), world), [w.to(device)]
    ).requires_grad_()
    out: dict[str, Any] = {}
    with _Counted() as c:
        loss = F.linear(x, weight).sum()
        pending = loss.pending_reduce
        loss.backward()
    out["pending, all_reduces"] = (pending, weight.grad.pending_reduce, c.calls)
    out["loss"] = loss.full_tensor().item() == (full @ w.t()).sum().item()
    out["grad"] = torch.equal(weight.grad.full_tensor().cpu(), torch.ones(7, 5).double().t() @ full)
    out["device"] = weight.grad.full_tensor().device == device
    return out


@pytest.mark.parametrize("kind", ["cpu", "cuda"])
def test_the_loss_and_weight_gradient_wait_on_each_device(kind: str) -> None:
    if kind == "cuda" and torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA devices (NCCL ranks)")
    backend = "nccl" if kind == "cuda" else "gloo"
    for rank, out in enumerate(run_ranks(_on_device, 2, kind, timeout=120, backend=backend)):
        assert out == {
            "pending, all_reduces": ("sum", "sum", 0),
            "loss": True,
            "grad": True,
            "device": True,
        }, f"rank {rank}"
