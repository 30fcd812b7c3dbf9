"""Collectives with the group's own device: object collectives on the CPU, tensors on CUDA.

On CPU: which group an object collective runs over (gloo groups use
themselves; a group without a CPU backend gets one cached gloo group of its
ranks). With a GPU: one NCCL rank runs every collective on CUDA tensors and
its metadata exchanges take no GPU memory.
"""

from __future__ import annotations

import inspect
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist

import shardwise as sw
from shardwise import Layout, ShardedTensor
from shardwise.comm import communicator as comm_module
from shardwise.comm.communicator import ProcessGroupCommunicator, object_group, timeout_of
from shardwise.testing import free_port, run_ranks, shard_of

pytestmark = pytest.mark.spawned

SHAPE = (9, 8)
_UNSORTED = "sort_ranks" in inspect.signature(dist.new_group).parameters


def _gloo_uses_itself(rank: int, world: int) -> list[Any]:
    sub = dist.new_group([0, 1])
    got = ProcessGroupCommunicator(sub).all_gather_object(("sub", rank))
    return [object_group(None), object_group(sub) is sub, got, len(comm_module._SIDE_GROUPS)]


def test_a_group_with_a_cpu_backend_runs_object_collectives_itself() -> None:
    # gloo registers cpu and cuda, as "cpu:gloo,cuda:nccl" does: torch pickles on the CPU
    want = [None, True, [("sub", 0), ("sub", 1)], 0]
    assert run_ranks(_gloo_uses_itself, 2, timeout=60) == [want, want]


def _as_if_nccl(rank: int, world: int, port: int) -> dict[str, Any]:
    """A gloo world whose groups but side groups claim CUDA only (as NCCL's do);
    counts new_group calls."""
    made: list[bool] = []
    new_group = dist.new_group

    def counted(*args: Any, **kwargs: Any) -> Any:
        made.append(kwargs.get("use_local_synchronization", False))
        return new_group(*args, **kwargs)

    pair = dist.new_group([0, 2])  # made by every rank, before groups claim CUDA
    # rank 2 first (torch 2.13's sort_ranks; before it, every group's ranks are sorted)
    backwards = dist.new_group([2, 0], sort_ranks=False) if _UNSORTED else None
    nccl_like = {dist.group.WORLD, pair, backwards}
    real = dist.ProcessGroup._device_types

    def devices(pg: Any) -> Any:
        return [torch.device("cuda")] if pg in nccl_like else real.fget(pg)  # type: ignore[attr-defined]

    dist.ProcessGroup._device_types = property(devices)  # type: ignore[assignment]
    dist.new_group = counted
    out: dict[str, Any] = {}
    comm = ProcessGroupCommunicator()
    out["world"] = [comm.all_gather_object(("w", rank)), comm.all_gather_object(rank * 2)]
    side = object_group(None)
    out["side"] = [side is not None, side is object_group(None), dist.get_backend(side)]
    out["timeout"] = timeout_of(side) == timeout_of(dist.group.WORLD) != timedelta(minutes=30)
    if rank != 1:  # rank 1 is outside: it takes no part in making these
        out["pair"] = ProcessGroupCommunicator(pair).all_gather_object(rank * 10)
        if backwards is not None:
            out["backwards"] = ProcessGroupCommunicator(backwards).all_gather_object(rank)
    out["made"] = list(made)
    # the whole-world side group kept every rank's group count in step: a new group works
    later = new_group([0, 1, 2])
    t = torch.ones(1)
    dist.all_reduce(t, group=later)
    out["later"] = int(t)
    # made again after the process group is torn down and set up anew
    dist.destroy_process_group()
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    nccl_like.add(dist.group.WORLD)
    out["again"] = ProcessGroupCommunicator().all_gather_object(rank + 100)
    out["fresh"] = object_group(None) is not side and len(made) == len(out["made"]) + 1
    return out


def test_a_group_without_a_cpu_backend_gathers_objects_over_one_cached_gloo_group() -> None:
    results = run_ranks(_as_if_nccl, 3, free_port(), timeout=60)
    for rank, out in enumerate(results):
        assert out["world"] == [[("w", 0), ("w", 1), ("w", 2)], [0, 2, 4]]
        assert out["side"] == [True, True, "gloo"]
        assert out["timeout"] is True  # the group's own (run_ranks sets it), not gloo's 30 min
        if rank != 1:
            assert out["pair"] == [0, 20]
            if _UNSORTED:
                assert out["backwards"] == [2, 0]  # group rank order, not global
            # whole world: an ordinary group; the smaller ones: local synchronisation
            assert out["made"] == ([False, True, True] if _UNSORTED else [False, True])
        else:
            assert out["made"] == [False]
        assert out["later"] == 3
        assert out["again"] == [100, 101, 102]
        assert out["fresh"] is True


def _layouts() -> tuple[Layout, Layout]:
    """Uneven layouts with several blocks on the one rank."""
    rows = Layout.row_wise(SHAPE, [2, 4, 3], ranks=[0, 0, 0], world_size=1)
    cols = Layout.column_wise(SHAPE, [3, 1, 4], ranks=[0, 0, 0], world_size=1)
    return rows, cols


def _same(got: Any, want: Any, what: str) -> list[str]:
    """What is wrong with `got` (a tensor or list of tensors): not on CUDA, or not `want`."""
    pairs = list(zip(got, want)) if isinstance(got, list) else [(got, want)]
    if isinstance(got, list) and len(got) != len(want):
        return [f"{what}: {len(got)} shards, want {len(want)}"]
    bad = [f"{what}: on {g.device}" for g, _ in pairs if g.device.type != "cuda"]
    bad += [f"{what}: wrong values" for g, w in pairs if not torch.equal(g.cpu(), w.cpu())]
    return bad


def _nccl_rank(rank: int, world: int) -> list[str]:
    dev = torch.device("cuda", rank)
    full = torch.arange(SHAPE[0] * SHAPE[1], dtype=torch.float32, device=dev).reshape(SHAPE)
    rows, cols = _layouts()
    bad: list[str] = []
    shards = shard_of(full, rows, rank)
    st = ShardedTensor.from_local_shards(shards, [b.offsets for b in rows.blocks_of(rank)])
    bad += [] if st.layout_spec == rows else ["from_local_shards: another layout"]
    bad += _same(st.local_shards(), shards, "from_local_shards")
    moved = st.redistribute(cols)
    bad += _same(moved.local_shards(), shard_of(full, cols, rank), "redistribute")
    bad += _same(moved.full_tensor(), full, "full_tensor")
    bad += _same(moved.gather(0), full, "gather")
    spread = sw.distribute(full, cols)
    bad += _same(spread.local_shards(), shard_of(full, cols, rank), "distribute")
    bad += [] if sw.equal(st, spread) else ["equal: False for equal tensors"]
    bad += (
        []
        if not sw.equal(st, sw.distribute(full + 1, cols))
        else ["equal: True for different tensors"]
    )
    # the tensor collective itself on the NCCL group (one rank: to itself)
    send = torch.arange(10, dtype=torch.uint8, device=dev)
    recv = torch.zeros(10, dtype=torch.uint8, device=dev)
    ProcessGroupCommunicator().all_to_all_single(recv, send, [10], [10]).wait()
    bad += _same(recv, send, "all_to_all_single")
    c10d = torch.ops._c10d_functional
    name = dist.distributed_c10d._get_default_group().group_name
    gathered = c10d.wait_tensor(c10d.all_gather_into_tensor(moved, 1, name))
    # the shards flat, as rows of the first shard's trailing shape (see ops/builtin.py)
    flat = torch.cat([s.reshape(-1) for s in moved.local_shards()]).view(-1, 3)
    bad += _same(gathered, flat, "functional all_gather_into_tensor")
    side = object_group(None)
    bad += [] if dist.get_backend(side) == "gloo" else [f"object group: {dist.get_backend(side)}"]
    bad += _object_collectives_take_no_gpu_memory(rank)
    return bad


def _object_collectives_take_no_gpu_memory(rank: int) -> list[str]:
    obj = bytes(range(256)) * 4096  # 1 MiB
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    got = ProcessGroupCommunicator().all_gather_object(obj)
    bad = [] if got == [obj] else ["all_gather_object: wrong values"]
    grown = torch.cuda.max_memory_allocated() - base
    bad += [] if grown == 0 else [f"all_gather_object: GPU memory peaked {grown} bytes higher"]
    # the measurement can see it: torch's own object collective on NCCL pickles into the GPU
    torch.cuda.reset_peak_memory_stats()
    dist.all_gather_object([None], obj)
    stock = torch.cuda.max_memory_allocated() - base
    bad += [] if stock >= len(obj) else [f"stock all_gather_object peaked only {stock} bytes"]
    return bad


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_collectives_on_cuda_tensors_over_nccl() -> None:
    assert run_ranks(_nccl_rank, 1, backend="nccl", timeout=120) == [[]]
