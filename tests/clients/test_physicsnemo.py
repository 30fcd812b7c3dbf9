"""PhysicsNeMo 2.2.2 (the real package) <-> shardwise: ShardTensor conversions,
redistribute against PhysicsNeMo's own, and ShardTensors in checkpoints.

Uneven pieces (including ranks holding nothing) on real gloo ranks; every value
is compared bit for bit with PhysicsNeMo's `redistribute` / `full_tensor` or
with the global tensor. Each test spawns its ranks once and checks several
things, to keep the file fast (PhysicsNeMo takes seconds to import per rank).
"""

from __future__ import annotations

from tests.clients.conftest import require

pn = require("physicsnemo.domain_parallel")

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402

import shardwise as sw  # noqa: E402
import shardwise.checkpoint as swc  # noqa: E402
from shardwise import Layout  # noqa: E402
from shardwise.testing import run_ranks  # noqa: E402

pytestmark = pytest.mark.spawned

SHAPE = (7, 6)


def _mesh(shape):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", shape)


def _placements():
    from torch.distributed.tensor import Partial, Replicate, Shard

    return Shard, Replicate, Partial


def _refused(call) -> tuple[str, str]:
    """(error type, message) of `call()`, after checking the group still works."""
    try:
        call()
        outcome = ("returned", "")
    except Exception as e:  # noqa: BLE001 - the test compares what every rank raised
        outcome = (type(e).__name__, str(e))
    ok = torch.ones(1)
    dist.all_reduce(ok)
    assert ok.item() == dist.get_world_size()
    return outcome


def _same_as_physicsnemo(mine, theirs, what: str) -> list[str]:
    """Local tensor, recorded sharding shapes and full tensor all identical."""
    bad = []
    if not torch.equal(mine._local_tensor, theirs._local_tensor):
        bad.append(f"{what}: local tensors differ")
    if mine._spec.sharding_shapes() != theirs._spec.sharding_shapes():
        bad.append(f"{what}: {mine._spec.sharding_shapes()} != {theirs._spec.sharding_shapes()}")
    if not torch.equal(mine.full_tensor(), theirs.full_tensor()):
        bad.append(f"{what}: full tensors differ")
    return bad


def _redistribute_like_physicsnemo(rank: int, world: int, sizes: list[int]) -> list[str]:
    """Shard(0) (uneven `sizes`) -> Shard(1): shardwise's path against ShardTensor.redistribute."""
    from tests.clients.physicsnemo_harness import full, shard_tensor

    Shard, _, _ = _placements()
    mesh, value = _mesh((world,)), full(SHAPE)
    st = shard_tensor(value, mesh, (Shard(0),), {0: sizes})
    ours = sw.from_shard_tensor(st)
    bad = (
        []
        if ours.layout_spec == Layout.row_wise(SHAPE, sizes)
        else [f"layout {ours.layout_spec!r}"]
    )
    if ours.local_shards() and ours.local_shards()[0] is not st._local_tensor:
        bad.append("from_shard_tensor copied the local tensor")
    moved = ours.redistribute(Layout.chunked(SHAPE, 1, world)).to_shard_tensor(mesh, (Shard(1),))
    bad += _same_as_physicsnemo(moved, st.redistribute(mesh, (Shard(1),)), "Shard(0)->Shard(1)")
    back = ours.to_shard_tensor(mesh, (Shard(0),))  # the round trip wraps the very tensor
    if (
        st._local_tensor.numel() and back._local_tensor is not st._local_tensor
    ):  # an empty rank gets a new empty one
        bad.append("to_shard_tensor copied the shard")
    bad += _same_as_physicsnemo(back, st, "round trip")
    if not torch.equal(ours.full_tensor(), value) or not torch.equal(st.full_tensor(), value):
        bad.append("full_tensor")
    return [f"rank {rank}: {b}" for b in bad]


def _two_ranks(rank: int, world: int, path: str) -> list:
    """Conversions, refusals and a checkpoint save of uneven ShardTensors on 2 ranks."""
    from tests.clients.physicsnemo_harness import full, shard_tensor

    Shard, Replicate, Partial = _placements()
    mesh = _mesh((world,))
    bad = _redistribute_like_physicsnemo(rank, world, [5, 2])
    rep = shard_tensor(full(SHAPE, 2), mesh, (Replicate(),), {})
    if sw.from_dtensor(rep).layout_spec != Layout.replicated(
        SHAPE, world
    ):  # from_dtensor delegates
        bad.append("replicated layout")
    # refusals, each the same on every rank
    st = shard_tensor(full(SHAPE), mesh, (Shard(0),), {0: [5, 2]})
    partial = shard_tensor(full(SHAPE), mesh, (Partial(),), {})
    two_blocks = sw.ShardedTensor.zeros(Layout.column_wise(SHAPE, [1, 2, 1, 2], ranks=[0, 1, 0, 1]))
    dt = (
        sw.from_shard_tensor(st)
        .redistribute(Layout.chunked(SHAPE, 0, world))
        .to_dtensor(mesh, (Shard(0),))
    )
    errors = [
        _refused(lambda: sw.from_shard_tensor(partial)),
        _refused(lambda: two_blocks.to_shard_tensor(mesh, (Shard(1),))),
        _refused(lambda: sw.from_shard_tensor(dt)),
        _refused(lambda: sw.from_dtensor(st if rank == 0 else dt)),  # one rank passes another kind
    ]
    state = {
        "a": st,
        "b": shard_tensor(full(SHAPE, 1), mesh, (Shard(1),), {0: [1, 5]}),
        "r": rep,
        "step": 3,
    }
    swc.save(state, path)
    return [bad, errors]


def test_two_ranks_convert_redistribute_refuse_and_save(tmp_path):
    path = str(tmp_path / "ckpt")
    results = run_ranks(_two_ranks, 2, path, timeout=90)
    assert [bad for bad, _ in results] == [[], []]
    errors = results[0][1]
    assert results[1][1] == errors  # the same error on every rank
    kinds = [kind for kind, _ in errors]
    assert kinds == ["LayoutError", "LayoutError", "InvalidTypeError", "InvalidTypeError"]
    assert "Partial" in errors[0][1] and errors[0][1].startswith("rank 0:")
    assert "redistribute first" in errors[1][1]
    assert "from_shard_tensor takes a PhysicsNeMo ShardTensor" in errors[2][1]
    assert errors[3][1].startswith(
        "rank 1: it passed a DTensor but rank 0 passed a PhysicsNeMo ShardTensor"
    )
    # what was written is the global tensor, read offline by shardwise
    from tests.clients.physicsnemo_harness import full

    for key, seed in (("a", 0), ("b", 1), ("r", 2)):
        assert torch.equal(swc.read_tensor(path, key), full(SHAPE, seed)), key
    _load_three_ranks_from(path)


def _three_ranks(rank: int, world: int, path: str) -> list:
    """Redistribute with an empty rank; load the 2-rank checkpoint into other uneven ShardTensors,
    plain ShardedTensors and stock dcp.load; a rank with stale sharding shapes."""
    from tests.clients.physicsnemo_harness import full, shard_tensor

    Shard, Replicate, _ = _placements()
    mesh = _mesh((world,))
    bad = _redistribute_like_physicsnemo(rank, world, [5, 2, 0])
    blank = torch.full(SHAPE, -1.0)
    targets = {
        "a": shard_tensor(blank, mesh, (Shard(1),), {0: [1, 0, 5]}),
        "b": shard_tensor(blank, mesh, (Shard(0),), {0: [2, 2, 3]}),
        "r": shard_tensor(blank, mesh, (Replicate(),), {}),
        "step": 0,
    }
    pointers = {k: v._local_tensor.data_ptr() for k, v in targets.items() if k != "step"}
    swc.load(targets, path)
    for key, seed in (("a", 0), ("b", 1), ("r", 2)):
        st = targets[key]
        if st._local_tensor.data_ptr() != pointers[key]:
            bad.append(f"rank {rank} {key}: not loaded in place")
        if not torch.equal(st.full_tensor(), full(SHAPE, seed)):
            bad.append(f"rank {rank} {key}: loaded values differ")
    if targets["step"] != 3:
        bad.append(f"rank {rank}: step {targets['step']}")
    plain = {"a": sw.ShardedTensor.zeros(Layout.row_wise(SHAPE, [0, 4, 3]))}
    swc.load(plain, path)
    if not torch.equal(plain["a"].full_tensor(), full(SHAPE, 0)):
        bad.append(f"rank {rank}: plain ShardedTensor load")
    stock = {"a": torch.zeros(SHAPE), "b": torch.zeros(SHAPE)}
    dcp.load(stock, checkpoint_id=path)
    if not (torch.equal(stock["a"], full(SHAPE, 0)) and torch.equal(stock["b"], full(SHAPE, 1))):
        bad.append(f"rank {rank}: stock dcp.load")
    # rank 2's spec records rank 0 and 1 as [2, 3] while they hold [3, 2]: a stale spec
    stale = shard_tensor(
        full(SHAPE), mesh, (Shard(0),), {0: [3, 2, 2]}, {0: [2, 3, 2]} if rank == 2 else None
    )
    return [bad, _refused(lambda: sw.from_shard_tensor(stale))]


def _load_three_ranks_from(path: str) -> None:
    results = run_ranks(_three_ranks, 3, path, timeout=90)
    assert [bad for bad, _ in results] == [[], [], []]
    kind, message = results[0][1]
    assert all(r[1] == (kind, message) for r in results)
    assert kind == "LayoutError"
    assert message.startswith(
        "rank 2: its ShardTensor records rank 0's piece as 2 along dimension 0 but rank 0 holds 3"
    )


def _two_d(rank: int, world: int) -> list[str]:
    """A 2x2 mesh: an uneven grid (Shard(0), Shard(1)) and (Replicate(), Shard(1))."""
    from tests.clients.physicsnemo_harness import full, shard_tensor

    Shard, Replicate, _ = _placements()
    mesh, value, bad = _mesh((2, 2)), full(SHAPE), []
    grid = shard_tensor(value, mesh, (Shard(0), Shard(1)), {0: [5, 2], 1: [1, 5]})
    ours = sw.from_shard_tensor(grid)
    if ours.layout_spec != Layout.grid(SHAPE, (2, 2), [[5, 2], [1, 5]]):
        bad.append(f"grid layout {ours.layout_spec!r}")
    back = ours.to_shard_tensor(mesh, (Shard(0), Shard(1)))
    if back._local_tensor is not grid._local_tensor:
        bad.append("grid round trip copied")
    bad += _same_as_physicsnemo(back, grid, "grid round trip")
    half = shard_tensor(value, mesh, (Replicate(), Shard(1)), {1: [4, 2]})
    ours = sw.from_shard_tensor(half)
    left, right = [sw.Block((0, 0), (7, 4))], [sw.Block((0, 4), (7, 2))]
    if ours.layout_spec != Layout(SHAPE, {0: left, 1: right, 2: left, 3: right}):  # replicas
        bad.append(f"replicated rows {ours.layout_spec!r}")
    # PhysicsNeMo keeps the uneven column sizes and chunks the rows: the same target for both
    theirs = half.redistribute(mesh, (Shard(1), Shard(0)))
    target = Layout.grid(SHAPE, (2, 2), [[4, 3], [4, 2]])
    target = Layout(
        SHAPE, {r: target.blocks_of(r % 2 * 2 + r // 2) for r in range(4)}
    )  # mesh dim 0 shards columns
    if sw.from_shard_tensor(theirs).layout_spec != target:
        bad.append(
            f"PhysicsNeMo's 2-D redistribute gave {sw.from_shard_tensor(theirs).layout_spec!r}"
        )
    moved = ours.redistribute(target)
    if not torch.equal(moved.local_shards()[0], theirs._local_tensor):
        bad.append("2-D redistribute differs from PhysicsNeMo's")
    bad += _same_as_physicsnemo(
        moved.to_shard_tensor(mesh, (Shard(1), Shard(0))), theirs, "2-D redistribute"
    )
    return [f"rank {rank}: {b}" for b in bad]


def test_two_d_mesh():
    assert run_ranks(_two_d, 4, timeout=90) == [[]] * 4


class _Module:
    """A Stateful holding an uneven ShardTensor, as a model's state_dict() would."""

    def __init__(self, value) -> None:
        self.value = value
        self.loaded = None

    def state_dict(self) -> dict:
        return {"w": self.value}

    def load_state_dict(self, sd: dict) -> None:
        self.loaded = sd["w"]


def _stateful(rank: int, world: int, path: str) -> list[str]:
    """A Stateful's ShardTensors are adapted on load as on save (dcp.load would see
    an even-chunk DTensor), filled in place, and handed back through load_state_dict."""
    from tests.clients.physicsnemo_harness import full, shard_tensor

    Shard, _, _ = _placements()
    mesh = _mesh((world,))
    swc.save({"m": _Module(shard_tensor(full(SHAPE, 4), mesh, (Shard(0),), {0: [3, 4]}))}, path)
    module = _Module(shard_tensor(torch.zeros(SHAPE), mesh, (Shard(1),), {0: [5, 1]}))
    pointer = module.value._local_tensor.data_ptr()
    swc.load({"m": module}, path)
    bad = []
    if module.loaded is not module.value or module.value._local_tensor.data_ptr() != pointer:
        bad.append("not loaded in place through load_state_dict")
    if not torch.equal(module.value.full_tensor(), full(SHAPE, 4)):
        bad.append("loaded values differ")
    return [f"rank {rank}: {b}" for b in bad]


def test_stateful_shard_tensors_load_in_place(tmp_path):
    assert run_ranks(_stateful, 2, str(tmp_path / "ckpt"), timeout=90) == [[], []]
