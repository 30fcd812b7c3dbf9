"""`Stager`: buffers kept between calls, exact values through every copy path
(batched small copies, ranges copied by the thread pool, per-tensor fallbacks)."""

from __future__ import annotations

import threading
import time
from collections import namedtuple

import pytest
import torch

from shardwise import Layout, ShardedTensor
from shardwise.checkpoint.engine import copies
from shardwise.checkpoint.engine.copies import _pieces
from shardwise.checkpoint.engine.staging import Stager


def _pooled(threads: int = 3, piece: int = 4096) -> Stager:
    """A stager that sends every contiguous CPU tensor to its pool, in small pieces."""
    stager = Stager(threads=threads)
    stager._pool_min_bytes = 0
    stager._min_piece_bytes = piece
    return stager


def _stagers() -> list[Stager]:
    return [Stager(), Stager(threads=1), _pooled()]


def _sharded(values: torch.Tensor) -> ShardedTensor:
    layout = Layout.chunked(tuple(values.shape), 0, 2)
    return ShardedTensor.from_layout(
        layout, [values[b.slices()].clone() for b in layout.blocks_of(0)], rank=0
    )


def _ptrs(stager: Stager) -> dict:
    return {k: b.data_ptr() for k, b in stager._buffers.items()}


@pytest.mark.parametrize("stager", _stagers(), ids=["default", "one-thread", "pooled"])
def test_buffers_are_reused_across_calls_and_hold_the_new_values(stager):
    def state(step: float) -> dict:
        return {
            "w": torch.full((64, 33), step),
            "big": torch.full((300_001,), step),
            "sharded": _sharded(torch.full((8, 5), step)),
            "nested": {"list": [torch.full((3,), step), (torch.full((2, 2), step),)]},
        }

    first = stager.stage(state(1.0))
    ptrs = _ptrs(stager)
    assert len(ptrs) == 5
    second = stager.stage(state(2.0))
    assert _ptrs(stager) == ptrs  # no reallocation
    assert second["w"].data_ptr() == first["w"].data_ptr()
    assert second["sharded"].local_shards()[0].data_ptr() == ptrs[("sharded", 0)]
    for t in (
        second["w"],
        second["big"],
        second["sharded"].local_shards()[0],
        second["nested"]["list"][0],
        second["nested"]["list"][1][0],
    ):
        assert bool((t == 2.0).all())


def test_a_new_shape_or_dtype_gets_a_new_buffer():
    stager = Stager()
    stager.stage({"x": torch.ones(4)})
    before = stager._buffers[("x",)]
    staged = stager.stage({"x": torch.ones(5)})
    assert staged["x"].shape == (5,) and stager._buffers[("x",)] is staged["x"]
    staged = stager.stage({"x": torch.ones(5, dtype=torch.float64)})
    assert staged["x"].dtype == torch.float64
    assert stager._buffers[("x",)] is not before


@pytest.fixture(params=[1, 2], ids=["torch-1-thread", "torch-2-threads"])
def torch_threads(request):
    """Runs a test with torch on 1 thread (workers copy with copy_) and on 2 (memcpy)."""
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    try:
        yield request.param
    finally:
        torch.set_num_threads(before)


def test_chunked_threaded_copy_of_a_size_not_a_multiple_of_the_piece_count(
    monkeypatch, torch_threads
):
    copied_by: set[int] = set()
    primitives: set[bool] = set()
    copy_range = copies._copy_range

    def recording(dst, src, start, n, memcpy):
        copied_by.add(threading.get_ident())
        primitives.add(memcpy)
        time.sleep(0.002)  # lets every worker take pieces
        copy_range(dst, src, start, n, memcpy)

    monkeypatch.setattr(copies, "_copy_range", recording)
    stager = _pooled(threads=3, piece=1 << 16)
    src = torch.randn(1_000_003)  # 4,000,012 bytes: 61 pieces of 64 KiB and a shorter one
    assert src.nbytes % (1 << 16) != 0
    other = torch.randn(77_777, dtype=torch.float64)  # a second tensor in the same stream
    staged = stager.stage({"x": src, "y": src[1:].clone(), "z": other})
    assert torch.equal(staged["x"], src)
    assert torch.equal(staged["y"], src[1:])
    assert torch.equal(staged["z"], other)
    assert len(copied_by) > 1  # really copied by more than one thread
    assert primitives == {torch_threads > 1}  # memcpy only where copy_ would fork OpenMP
    # and again into the same buffers, with other values
    src.mul_(-3)
    again = stager.stage({"x": src, "y": src[1:].clone(), "z": other})
    assert again["x"].data_ptr() == staged["x"].data_ptr()
    assert torch.equal(again["x"], src)
    assert torch.equal(again["y"], src[1:])


def test_default_threads_split_a_large_tensor():
    stager = Stager(threads=2)
    src = torch.randn(3, 1 << 20)  # 12 MiB, over the pool threshold
    for _ in range(2):
        src.add_(1)
        assert torch.equal(stager.stage({"x": src})["x"], src)
    stager.close()
    assert torch.equal(stager.stage({"x": src})["x"], src)  # a closed pool restarts


def test_one_thread_uses_no_pool():
    stager = Stager(threads=1)
    src = torch.randn(3, 1 << 20)
    assert torch.equal(stager.stage({"x": src})["x"], src)
    assert not stager._copy_pool.started


def test_pieces_cover_every_byte_once():
    views = [torch.empty(n, dtype=torch.uint8) for n in (10, 0, 7, 25)]
    copies = [(v, v) for v in views]
    pieces = _pieces(copies, 8)
    assert [sum(n for *_, n in p) for p in pieces] == [8, 8, 8, 8, 8, 2]
    covered = []
    for piece in pieces:
        for dst, src, start, n in piece:
            assert n > 0 and dst is src
            covered += [(id(dst), start + i) for i in range(n)]
    assert covered == [(id(v), i) for v in views for i in range(v.numel())]


@pytest.mark.parametrize("stager", _stagers(), ids=["default", "one-thread", "pooled"])
def test_non_contiguous_and_offset_sources(stager):
    base = torch.arange(40 * 70, dtype=torch.float32).reshape(40, 70)
    state = {
        "transposed": base.t(),
        "strided": base[::3, 1::2],
        "offset": base.reshape(-1)[17:],  # contiguous, not at its storage's start
        "expanded": torch.arange(5.0).expand(4, 5),
    }
    for _ in range(2):
        staged = stager.stage(state)
        for k, v in state.items():
            assert torch.equal(staged[k], v), k
            assert staged[k].is_contiguous()
        base.add_(0.5)


@pytest.mark.parametrize("stager", _stagers(), ids=["default", "one-thread", "pooled"])
@pytest.mark.parametrize(
    "dtype", [torch.bfloat16, torch.float16, torch.int8, torch.bool, torch.complex64]
)
def test_dtypes_copy_exactly(stager, dtype, torch_threads):
    g = torch.Generator().manual_seed(0)
    raw = torch.randn(1 << 19, generator=g)  # 512k values
    if dtype is torch.bool:
        src = raw > 0
    elif dtype is torch.int8:
        src = (raw * 50).to(torch.int8)
    elif dtype is torch.complex64:
        src = torch.complex(raw, -raw)
    else:
        src = raw.to(dtype)
    staged = stager.stage({"x": src, "small": src[:7]})
    assert staged["x"].dtype == dtype
    assert torch.equal(staged["x"].view(torch.uint8), src.view(torch.uint8))  # bit for bit
    assert torch.equal(staged["small"], src[:7])


@pytest.mark.parametrize("stager", _stagers(), ids=["default", "one-thread", "pooled"])
def test_conjugate_and_negative_views_are_resolved(stager):
    z = torch.complex(torch.arange(6.0), torch.ones(6))
    state = {"conj": z.conj(), "neg": z.conj().imag}  # a conj bit and a neg bit
    assert state["conj"].is_conj() and state["neg"].is_neg()
    staged = stager.stage(state)
    assert torch.equal(staged["conj"], z.conj().resolve_conj())
    assert torch.equal(staged["neg"], -torch.ones(6))


@pytest.mark.parametrize("stager", _stagers(), ids=["default", "one-thread", "pooled"])
def test_empty_tensors(stager):
    state = {"empty": torch.empty(0, 5), "scalar": torch.tensor(3.5), "bf16": torch.empty(0)}
    state["bf16"] = state["bf16"].to(torch.bfloat16)
    for _ in range(2):
        staged = stager.stage(state)
        assert staged["empty"].shape == (0, 5)
        assert staged["bf16"].shape == (0,) and staged["bf16"].dtype == torch.bfloat16
        assert staged["scalar"].shape == () and float(staged["scalar"]) == 3.5


@pytest.mark.parametrize("stager", _stagers(), ids=["default", "one-thread", "pooled"])
def test_modifying_the_source_after_stage_leaves_the_staged_copy(stager):
    param = torch.nn.Parameter(torch.full((1000, 70), 1.0))
    small = torch.full((16,), 1.0)
    sharded = _sharded(torch.full((6, 4), 1.0))
    extra = {"step": 1, "names": ["a"]}
    state = {"param": param, "small": small, "sharded": sharded, "extra": extra}
    staged = stager.stage(state)
    with torch.no_grad():
        param.fill_(-1)
    small.fill_(-1)
    sharded.local_shards()[0].fill_(-1)
    extra["step"] = -1
    extra["names"].append("b")
    assert bool((staged["param"] == 1).all()) and bool((staged["small"] == 1).all())
    assert bool((staged["sharded"].local_shards()[0] == 1).all())
    assert staged["extra"] == {"step": 1, "names": ["a"]}
    assert type(staged["param"]) is torch.Tensor
    assert not staged["param"].requires_grad and staged["param"].grad_fn is None


def test_structure_is_mirrored():
    Point = namedtuple("Point", "x y")

    class Opaque:
        def __init__(self) -> None:
            self.t = torch.ones(2)

    opaque = Opaque()
    state = {
        "list": [torch.ones(2), 3],
        "tuple": (torch.ones(1), "s"),
        "named": Point(torch.ones(1), 2),
        "opaque": opaque,
        "sharded": _sharded(torch.arange(12.0).reshape(6, 2)),
        1: {"inner": torch.zeros(3)},
    }
    staged = Stager().stage(state)
    assert type(staged["list"]) is list and staged["list"][1] == 3
    assert type(staged["tuple"]) is tuple and staged["tuple"][1] == "s"
    assert type(staged["named"]) is Point and staged["named"].y == 2
    assert staged["named"].x is not state["named"].x  # deep-copied
    assert isinstance(staged["opaque"], Opaque) and staged["opaque"] is not opaque
    assert staged["opaque"].t is not opaque.t
    st = staged["sharded"]
    assert isinstance(st, ShardedTensor) and st.layout_spec == state["sharded"].layout_spec
    assert st.device == torch.device("cpu") and st.rank == 0
    assert torch.equal(st.local_shards()[0], state["sharded"].local_shards()[0])
    assert torch.equal(staged[1]["inner"], torch.zeros(3))


def test_sharded_wrappers_are_reused_only_while_they_match():
    stager = Stager()
    st = _sharded(torch.arange(8.0).reshape(4, 2))
    first = stager.stage({"s": st})["s"]
    assert stager.stage({"s": st})["s"] is first  # same buffers, same metadata
    other = _sharded(torch.arange(16.0).reshape(8, 2))  # new shape: new buffers, new wrapper
    staged = stager.stage({"s": other})["s"]
    assert staged is not first and staged.shape == (8, 2)
    assert torch.equal(staged.local_shards()[0], other.local_shards()[0])


def test_many_small_tensors():
    state = {f"t{i}": torch.full((8, 128), float(i)) for i in range(2000)}
    stager = Stager()
    stager.stage(state)
    for t in state.values():
        t.add_(1)
    staged = stager.stage(state)
    assert all(torch.equal(staged[k], v) for k, v in state.items())


def test_threads_must_be_positive():
    with pytest.raises(ValueError):
        Stager(threads=0)


@pytest.fixture
def one_rank_group():
    """A world of one (this process, gloo over an in-memory store), for DTensors."""
    import torch.distributed as dist

    if dist.is_initialized():
        yield
        return
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_dtensor(one_rank_group):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (1,))
    full = torch.arange(64 * 6, dtype=torch.bfloat16).reshape(64, 6)
    dt = distribute_tensor(full.clone(), mesh, (Shard(0),))
    stager = _pooled(threads=2)
    first = stager.stage({"dt": dt})["dt"]
    dt._local_tensor.add_(1)
    assert torch.equal(first.to_local(), full)  # the staged copy did not follow its source
    second = stager.stage({"dt": dt})["dt"]
    assert second is first  # the same wrapper around the same buffer
    assert torch.equal(second.to_local(), full + 1)
    assert isinstance(second, DTensor) and second.shape == full.shape
    assert second.placements == dt.placements and second.device_mesh is mesh
    other = distribute_tensor(torch.zeros(64, 6, dtype=torch.bfloat16), mesh, (Shard(1),))
    third = stager.stage({"dt": other})["dt"]  # other placements: a new wrapper
    assert third is not first and third.placements == other.placements
    assert torch.equal(third.to_local(), torch.zeros(64, 6, dtype=torch.bfloat16))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_sources_go_to_pinned_buffers():
    stager = Stager()
    src = torch.randn(1 << 20, device="cuda")
    small = torch.randn(10, device="cuda", dtype=torch.bfloat16)
    staged = stager.stage({"x": src, "small": small})
    stager.synchronize()
    assert staged["x"].is_pinned() and staged["x"].device.type == "cpu"
    assert torch.equal(staged["x"], src.cpu()) and torch.equal(staged["small"], small.cpu())
