"""`Stager` (`staging`): buffers kept between calls, exact values through every copy path,
the state's structure mirrored, wrappers (ShardedTensor, DTensor) reused while they match."""

from __future__ import annotations

import threading
from collections import namedtuple

import pytest
import torch

from shardwise import Block, Layout, ShardedTensor
from shardwise.checkpoint.engine.staging import Stager

from .stagers import cycle, pooled, stagers


def _sharded(values: torch.Tensor) -> ShardedTensor:
    layout = Layout.chunked(tuple(values.shape), 0, 2)
    return ShardedTensor.from_layout(
        layout, [values[b.slices()].clone() for b in layout.blocks_of(0)], rank=0
    )


def _kept(stager: Stager) -> dict:
    """The buffers the stager keeps for its next `stage`, by path."""
    assert stager._kept is not None, "a save holds the buffers"
    return stager._kept.tensors


def _ptrs(stager: Stager) -> dict:
    return {k: b.data_ptr() for k, b in _kept(stager).items()}


@pytest.mark.parametrize("stager", stagers(), ids=["default", "one-thread", "pooled"])
def test_buffers_are_reused_across_calls_and_hold_the_new_values(stager):
    def state(step: float) -> dict:
        return {
            "w": torch.full((64, 33), step),
            "big": torch.full((300_001,), step),
            "sharded": _sharded(torch.full((8, 5), step)),
            "nested": {"list": [torch.full((3,), step), (torch.full((2, 2), step),)]},
        }

    first = cycle(stager, state(1.0))
    ptrs = _ptrs(stager)
    assert len(ptrs) == 5
    second = cycle(stager, state(2.0))
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
    cycle(stager, {"x": torch.ones(4)})
    before = _kept(stager)[("x",)]
    staged = cycle(stager, {"x": torch.ones(5)})
    assert staged["x"].shape == (5,) and _kept(stager)[("x",)] is staged["x"]
    staged = cycle(stager, {"x": torch.ones(5, dtype=torch.float64)})
    assert staged["x"].dtype == torch.float64
    assert _kept(stager)[("x",)] is not before


@pytest.mark.parametrize("stager", stagers(), ids=["default", "one-thread", "pooled"])
def test_non_contiguous_and_offset_sources(stager):
    base = torch.arange(40 * 70, dtype=torch.float32).reshape(40, 70)
    state = {
        "transposed": base.t(),
        "strided": base[::3, 1::2],
        "offset": base.reshape(-1)[17:],  # contiguous, not at its storage's start
        "expanded": torch.arange(5.0).expand(4, 5),
    }
    for _ in range(2):
        staged = cycle(stager, state)
        for k, v in state.items():
            assert torch.equal(staged[k], v), k
            assert staged[k].is_contiguous()
        base.add_(0.5)


@pytest.mark.parametrize("stager", stagers(), ids=["default", "one-thread", "pooled"])
def test_conjugate_and_negative_views_are_resolved(stager):
    z = torch.complex(torch.arange(6.0), torch.ones(6))
    state = {"conj": z.conj(), "neg": z.conj().imag}  # a conj bit and a neg bit
    assert state["conj"].is_conj() and state["neg"].is_neg()
    staged = cycle(stager, state)
    assert torch.equal(staged["conj"], z.conj().resolve_conj())
    assert torch.equal(staged["neg"], -torch.ones(6))


@pytest.mark.parametrize("stager", stagers(), ids=["default", "one-thread", "pooled"])
def test_empty_tensors(stager):
    state = {"empty": torch.empty(0, 5), "scalar": torch.tensor(3.5), "bf16": torch.empty(0)}
    state["bf16"] = state["bf16"].to(torch.bfloat16)
    for _ in range(2):
        staged = cycle(stager, state)
        assert staged["empty"].shape == (0, 5)
        assert staged["bf16"].shape == (0,) and staged["bf16"].dtype == torch.bfloat16
        assert staged["scalar"].shape == () and float(staged["scalar"]) == 3.5


@pytest.mark.parametrize("stager", stagers(), ids=["default", "one-thread", "pooled"])
def test_modifying_the_source_after_stage_leaves_the_staged_copy(stager):
    param = torch.nn.Parameter(torch.full((1000, 70), 1.0))
    small = torch.full((16,), 1.0)
    sharded = _sharded(torch.full((6, 4), 1.0))
    extra = {"step": 1, "names": ["a"]}
    state = {"param": param, "small": small, "sharded": sharded, "extra": extra}
    staged = cycle(stager, state)
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
    staged = cycle(Stager(), state)
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
    first = cycle(stager, {"s": st})["s"]
    assert cycle(stager, {"s": st})["s"] is first  # same buffers, same metadata
    other = _sharded(torch.arange(16.0).reshape(8, 2))  # new shape: new buffers, new wrapper
    staged = cycle(stager, {"s": other})["s"]
    assert staged is not first and staged.shape == (8, 2)
    assert torch.equal(staged.local_shards()[0], other.local_shards()[0])


def test_many_small_tensors():
    state = {f"t{i}": torch.full((8, 128), float(i)) for i in range(2000)}
    stager = Stager()
    cycle(stager, state)
    for t in state.values():
        t.add_(1)
    staged = cycle(stager, state)
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
    stager = pooled(threads=2)
    first = cycle(stager, {"dt": dt})["dt"]
    dt._local_tensor.add_(1)
    assert torch.equal(first.to_local(), full)  # the staged copy did not follow its source
    second = cycle(stager, {"dt": dt})["dt"]
    assert second is first  # the same wrapper around the same buffer
    assert torch.equal(second.to_local(), full + 1)
    assert isinstance(second, DTensor) and second.shape == full.shape
    assert second.placements == dt.placements and second.device_mesh is mesh
    other = distribute_tensor(torch.zeros(64, 6, dtype=torch.bfloat16), mesh, (Shard(1),))
    third = cycle(stager, {"dt": other})["dt"]  # other placements: a new wrapper
    assert third is not first and third.placements == other.placements
    assert torch.equal(third.to_local(), torch.zeros(64, 6, dtype=torch.bfloat16))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_values_are_kept_for_the_save_to_copy():
    """The snapshot copies host values only: CUDA values (plain, sharded) stay where they
    are, and their devices are listed for the caller to mark its streams."""
    stager = Stager()
    src = torch.randn(1 << 20, device="cuda")
    st = ShardedTensor.from_layout(
        Layout((4,), [[Block((0,), (4,))]]), [torch.zeros(4, device="cuda")], rank=0
    )
    staged = stager.stage({"x": src, "st": st, "host": torch.ones(3)})
    assert staged.state["x"] is src and staged.state["st"] is st
    assert staged.cuda_devices == {src.get_device()}
    host = staged.state["host"]
    assert host.data_ptr() != 0 and torch.equal(host, torch.ones(3))
    assert stager.nbytes == 0  # held by the save until released
    stager.release(staged)
    assert stager.nbytes == 12  # one buffer, for the host value


def test_two_saves_in_flight_never_share_buffers():
    """A second `stage` before the first save released its buffers gets buffers of its
    own: writing it leaves the first save's bytes as they were staged."""
    stager = Stager()
    first = stager.stage({"m": {"t": torch.full((4,), 2.0)}, "big": torch.full((300_001,), 2.0)})
    second = stager.stage({"m": {"t": torch.full((4,), 1.0)}, "big": torch.full((300_001,), 1.0)})
    assert torch.equal(first.state["m"]["t"], torch.full((4,), 2.0))
    assert bool((first.state["big"] == 2.0).all())
    assert torch.equal(second.state["m"]["t"], torch.full((4,), 1.0))
    assert first.buffers is not second.buffers
    assert first.state["m"]["t"].data_ptr() != second.state["m"]["t"].data_ptr()
    stager.release(first)
    third = stager.stage({"m": {"t": torch.full((4,), 3.0)}, "big": torch.full((300_001,), 3.0)})
    assert third.buffers is first.buffers  # released: reused, not allocated again
    assert torch.equal(second.state["m"]["t"], torch.full((4,), 1.0))  # still held, untouched


def test_concurrent_stages_from_threads_keep_their_own_values():
    stager = Stager(threads=2)
    results: dict[int, object] = {}
    start = threading.Barrier(4)

    def save(i: int) -> None:
        start.wait()
        for _ in range(20):
            staged = stager.stage({"x": torch.full((1 << 18,), float(i)), "s": torch.full((3,), i)})
            results[i] = (
                bool((staged.state["x"] == i).all()) and staged.state["s"].tolist() == [i] * 3
            )
            if not results[i]:
                return
            stager.release(staged)

    threads = [threading.Thread(target=save, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert results == {0: True, 1: True, 2: True, 3: True}


def test_a_failed_stage_keeps_the_buffers_for_the_next():
    stager = Stager()
    cycle(stager, {"x": torch.ones(8)})
    kept = _kept(stager)[("x",)]

    class Unpicklable:
        def __deepcopy__(self, memo: dict) -> None:
            raise RuntimeError("no copy")

    with pytest.raises(RuntimeError, match="no copy"):
        stager.stage({"x": torch.ones(8), "bad": Unpicklable()})
    assert _kept(stager)[("x",)] is kept
