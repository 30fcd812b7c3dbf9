"""The legacy `torch.distributed._shard` ShardedTensor API (issue 24, points 1-2),
tested against torch's own spec, metadata and ShardedTensor objects."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed._shard import sharded_tensor as torch_st
from torch.distributed._shard.metadata import ShardMetadata
from torch.distributed._shard.sharded_tensor.metadata import TensorProperties
from torch.distributed._shard.sharding_spec import ChunkShardingSpec, EnumerableShardingSpec

import shardwise as sw
import shardwise.checkpoint as swc
from shardwise import (
    Block,
    Layout,
    LayoutError,
    ShardedTensor,
    SingleShardError,
    legacy,
)
from shardwise.testing import run_ranks

pytestmark = pytest.mark.spawned

SHAPE = (5, 4)
FULL = torch.arange(20, dtype=torch.float64).reshape(SHAPE)
ENUM = EnumerableShardingSpec(
    [
        ShardMetadata([0, 0], [2, 4], "rank:1/cpu"),
        ShardMetadata([2, 0], [3, 1], "rank:0/cpu"),
        ShardMetadata([2, 1], [3, 3], "rank:1/cpu"),
    ]
)


def _blocks(md_list) -> dict[int, list[Block]]:
    out: dict[int, list[Block]] = {}
    for m in md_list:
        if 0 not in m.shard_sizes:
            out.setdefault(m.placement.rank(), []).append(Block(m.shard_offsets, m.shard_sizes))
    return out


@pytest.mark.parametrize(
    "spec",
    [
        ChunkShardingSpec(dim=0, placements=["rank:1/cpu", "rank:0/cpu", "rank:2/cpu"]),
        ChunkShardingSpec(dim=-1, placements=[f"rank:{r}/cpu" for r in (3, 2, 1, 0)]),
        # 5 rows in 4 chunks: 2, 2, 1 and an empty one past the end (offset 6)
        ChunkShardingSpec(dim=0, placements=[f"rank:{r}/cpu" for r in range(4)]),
        ENUM,
    ],
    ids=["chunk-permuted", "chunk-last-dim", "chunk-empty-tail", "enumerable"],
)
def test_layout_from_spec_matches_torchs_metadata(spec):
    props = TensorProperties(dtype=torch.float32)
    truth = _blocks(spec.build_metadata(torch.Size(SHAPE), props).shards_metadata)
    layout = Layout.from_sharding_spec(spec, SHAPE, 4)
    assert layout == Layout(SHAPE, truth, 4)
    back = legacy.to_sharding_spec(layout)
    assert type(back) is type(spec)
    assert Layout.from_sharding_spec(back, SHAPE, 4) == layout
    if isinstance(spec, ChunkShardingSpec) and spec.dim == 0:
        assert [str(p) for p in back.placements] == [str(p) for p in spec.placements][:3]


def test_to_sharding_spec_placements_and_refusals():
    layout = Layout.chunked(SHAPE, 1, 2)
    spec = legacy.to_sharding_spec(layout, device=lambda r: f"cuda:{r}")
    assert spec == ChunkShardingSpec(dim=1, placements=["rank:0/cuda:0", "rank:1/cuda:1"])
    with pytest.raises(LayoutError, match="replicas"):
        legacy.to_sharding_spec(Layout.replicated(SHAPE, 2))
    with pytest.raises(LayoutError, match="holes"):
        legacy.to_sharding_spec(Layout(SHAPE, {0: [Block((0, 0), (1, 4))]}, 2, allow_holes=True))
    with pytest.raises(LayoutError, match="outside the world size 1"):
        Layout.from_sharding_spec(ENUM, SHAPE, 1)
    with pytest.raises(TypeError, match="ChunkShardingSpec or EnumerableShardingSpec"):
        Layout.from_sharding_spec(object(), SHAPE, 2)


def _st(layout: Layout, rank: int, data: torch.Tensor = FULL) -> ShardedTensor:
    return ShardedTensor.from_layout(
        layout, [data[b.slices()].clone() for b in layout.blocks_of(rank)], dtype=data.dtype
    )


def _quiet() -> None:
    warnings.simplefilter("ignore")  # the legacy API warns that it is deprecated


def _api(rank: int, world: int) -> list[str]:
    _quiet()
    bad: list[str] = []
    for name, spec in {
        "chunk": ChunkShardingSpec(dim=0, placements=["rank:1/cpu", "rank:0/cpu"]),
        "enum": EnumerableShardingSpec(
            [ShardMetadata(m.shard_offsets, m.shard_sizes, str(m.placement)) for m in ENUM.shards]
        ),
    }.items():
        layout = Layout.from_sharding_spec(spec, SHAPE, world)
        st = _st(layout, rank)
        old = st.to_torch_sharded_tensor()
        if type(old) is not torch_st.ShardedTensor:
            bad.append(f"{name}: {type(old)}")
        if [s.tensor for s in old.local_shards()] != st.local_shards() or any(
            a.tensor is not b for a, b in zip(old.local_shards(), st.local_shards())
        ):
            bad.append(f"{name}: to_torch_sharded_tensor copied")
        # an enumerable spec comes back in rank order: same shards, same layout
        same = st.sharding_spec() == spec or (
            name == "enum"
            and Layout.from_sharding_spec(st.sharding_spec(), SHAPE, world) == layout
            and len(st.sharding_spec().shards) == 3
        )
        if old.sharding_spec() != st.sharding_spec() or not same:
            bad.append(f"{name}: spec {st.sharding_spec()} / {old.sharding_spec()}")
        if st.metadata() != old.metadata():
            bad.append(f"{name}: metadata {st.metadata()} != {old.metadata()}")
        back = sw.from_torch_sharded_tensor(old)
        if back.layout_spec != layout or any(
            a is not b for a, b in zip(back.local_shards(), st.local_shards())
        ):
            bad.append(f"{name}: from_torch_sharded_tensor")
        # gather(dst, out=) as the legacy API: `out` on dst only
        out = torch.zeros(SHAPE, dtype=FULL.dtype) if rank == 1 else None
        ref = torch.zeros(SHAPE, dtype=FULL.dtype) if rank == 1 else None
        got = st.gather(1, out=out)
        old.gather(1, out=ref)
        if rank == 1 and not (got is out and torch.equal(out, FULL) and torch.equal(ref, FULL)):
            bad.append(f"{name}: gather out")
        # reshard(spec) against legacy reshard (chunk only there), same local data
        target = ChunkShardingSpec(dim=1, placements=["rank:0/cpu", "rank:1/cpu"])
        new = st.reshard(target)  # in place, as legacy: `st` itself, in the new layout
        if new is not st or new.layout_spec != Layout.chunked(SHAPE, 1, 2):
            bad.append(f"{name}: reshard not in place")
        if new.sharding_spec() != target or not torch.equal(
            new.local_tensor(), FULL[:, 2 * rank : 2 * rank + 2]
        ):
            bad.append(f"{name}: reshard")
        if name == "chunk" and not torch.equal(
            old.reshard(target).local_tensor(), new.local_tensor()
        ):
            bad.append("legacy reshard differs")
    # 5 rows in 4 chunks on 2 ranks: rank 0 holds rows 0-1 and 4, rank 1 rows 2-3 and
    # an empty chunk at offset 6, past the end (left out of the layout)
    spec = ChunkShardingSpec(dim=0, placements=[f"rank:{r}/cpu" for r in (0, 1, 0, 1)])
    old = torch_st.full(spec, SHAPE, 7.0)
    if sw.from_torch_sharded_tensor(old).layout_spec != Layout(
        SHAPE, {0: [Block((0, 0), (2, 4)), Block((4, 0), (1, 4))], 1: [Block((2, 0), (2, 4))]}
    ):
        bad.append("from_torch_sharded_tensor with an empty chunk")
    try:
        # the enumerable layout puts two shards on rank 1
        _st(Layout.from_sharding_spec(ENUM, SHAPE, world), rank).local_tensor()
        if rank == 1:
            bad.append("local_tensor with two shards")
    except SingleShardError as e:  # also legacy's NotImplementedError
        if rank != 1 or "holds 2 shards" not in str(e) or not isinstance(e, NotImplementedError):
            bad.append(f"local_tensor: {e}")
    return bad


def _creation(rank: int, world: int) -> list[str]:
    _quiet()
    bad: list[str] = []
    spec = ChunkShardingSpec(dim=1, placements=["rank:1/cpu", "rank:0/cpu"])
    for name, ours, theirs in [
        ("zeros", legacy.zeros(spec, 5, 3), torch_st.zeros(spec, 5, 3)),
        (
            "ones",
            legacy.ones(spec, (5, 3), dtype=torch.int32),
            torch_st.ones(spec, (5, 3), dtype=torch.int32),
        ),
        ("full", legacy.full(spec, (5, 3), 2.5), torch_st.full(spec, (5, 3), 2.5)),
        (
            "empty",
            legacy.empty(spec, 5, 3, requires_grad=True),
            torch_st.empty(spec, 5, 3, requires_grad=True),
        ),
        ("rand", legacy.rand(spec, 5, 3), torch_st.rand(spec, 5, 3)),
    ]:
        a, b = ours.local_tensor(), theirs.local_tensor()
        if a.shape != b.shape or a.dtype != b.dtype or ours.requires_grad != theirs.requires_grad:
            bad.append(f"{name}: {a.shape} {a.dtype} vs {b.shape} {b.dtype}")
        if name not in ("empty", "rand") and not torch.equal(a, b):
            bad.append(f"{name}: values")
        if name == "rand" and not (a.min() >= 0 and a.max() < 1 and a.unique().numel() > 1):
            bad.append("rand: values")
        if ours.metadata() != theirs.metadata():
            bad.append(f"{name}: metadata {ours.metadata()} vs {theirs.metadata()}")
    return bad


def _dcp_round_trip(rank: int, world: int, folder: str) -> list[str]:
    _quiet()
    bad: list[str] = []
    # stock DCP saves a legacy ShardedTensor; shardwise loads it in another layout
    rows = ChunkShardingSpec(dim=0, placements=["rank:0/cpu", "rank:1/cpu"])
    old = torch_st.empty(rows, *SHAPE, dtype=FULL.dtype)
    start, n = old.local_shards()[0].metadata.shard_offsets[0], old.local_tensor().shape[0]
    old.local_tensor().copy_(FULL[start : start + n])
    dcp.save({"w": old, "step": torch.tensor(3)}, checkpoint_id=f"{folder}/stock")
    cols = Layout.column_wise(SHAPE, [1, 3], world_size=world)
    target = {"w": ShardedTensor.zeros(cols, dtype=FULL.dtype), "step": torch.tensor(0)}
    swc.load(target, f"{folder}/stock")
    for shard, b in zip(target["w"].local_shards(), target["w"].local_blocks):
        if not torch.equal(shard, FULL[b.slices()]):
            bad.append(f"swc.load of a stock legacy save {b}")
    if target["step"].item() != 3:
        bad.append("step")
    # the reverse: shardwise saves, stock DCP loads into a legacy ShardedTensor
    swc.save({"w": _st(cols, rank)}, f"{folder}/ours")
    into = torch_st.zeros(ENUM_2, *SHAPE, dtype=FULL.dtype)
    dcp.load({"w": into}, checkpoint_id=f"{folder}/ours")
    for s in into.local_shards():
        o, z = s.metadata.shard_offsets, s.metadata.shard_sizes
        if not torch.equal(s.tensor, FULL[o[0] : o[0] + z[0], o[1] : o[1] + z[1]]):
            bad.append(f"dcp.load of a shardwise save {o}")
    return bad


ENUM_2 = EnumerableShardingSpec(
    [
        ShardMetadata([0, 0], [2, 4], "rank:1/cpu"),
        ShardMetadata([2, 0], [3, 1], "rank:0/cpu"),
        ShardMetadata([2, 1], [3, 3], "rank:1/cpu"),
    ]
)


def test_legacy_api_against_torchs_sharded_tensor():
    assert run_ranks(_api, 2, timeout=60) == [[], []]


def test_creation_helpers_match_torchs():
    assert run_ranks(_creation, 2, timeout=60) == [[], []]


def test_round_trip_through_stock_dcp(tmp_path: Path):
    assert run_ranks(_dcp_round_trip, 2, str(tmp_path), timeout=60) == [[], []]


# -- point 2: modules holding sharded parameters -----------------------------------


class _Net(torch.nn.Module):
    """A weight sharded by `layout` (or plain), a plain bias; forward gathers the weight."""

    def __init__(self, layout: Layout | None, rank: int) -> None:
        super().__init__()
        w = torch.linspace(-1, 1, 20, dtype=torch.float64).reshape(SHAPE)
        self.weight = torch.nn.Parameter(_st(layout, rank, w) if layout else w.clone())
        self.bias = torch.nn.Parameter(torch.full((5,), 0.5, dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight.full_tensor() if isinstance(self.weight, ShardedTensor) else self.weight
        return torch.tanh(x @ w.T + self.bias)


def _train(net: _Net, make_opt) -> None:
    opt = make_opt(net.parameters())
    g = torch.Generator().manual_seed(0)
    for _ in range(3):
        x = torch.randn(3, 4, generator=g, dtype=torch.float64)
        opt.zero_grad()
        net(x).pow(2).sum().backward()
        opt.step()


def _modules(rank: int, world: int, folder: str) -> list[str]:
    bad: list[str] = []
    rows = Layout.chunked(SHAPE, 0, world)
    cols = Layout.column_wise(SHAPE, [3, 1], world_size=world)
    net = _Net(rows, rank)
    sd = net.state_dict()
    if sorted(sd) != ["bias", "weight"] or not isinstance(sd["weight"], ShardedTensor):
        bad.append(f"state_dict {sorted(sd)} {type(sd['weight'])}")
    elif sd["weight"].local_shards()[0].data_ptr() != net.weight.local_shards()[0].data_ptr():
        bad.append("state_dict copied the shards")
    # load_state_dict, same layout: values copied into the live shards
    other = _Net(rows, rank)
    with torch.no_grad():
        other.weight.mul_(3)
    shard = net.weight.local_shards()[0]
    net.load_state_dict(other.state_dict())
    if net.weight.local_shards()[0] is not shard or not torch.equal(
        net.weight.full_tensor(), other.weight.full_tensor()
    ):
        bad.append("load_state_dict same layout")
    # another layout through a checkpoint: rows saved, columns loaded
    swc.save(net.state_dict(), f"{folder}/rows")
    in_cols = _Net(cols, rank)
    swc.load(in_cols.state_dict(), f"{folder}/rows")
    if not torch.equal(in_cols.weight.full_tensor(), net.weight.full_tensor()):
        bad.append("swc.load into another layout")
    # training: exactly the values of the same module with a plain weight
    for name, make_opt in {
        "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
        "adam": lambda ps: torch.optim.Adam(ps, lr=0.01, foreach=False),
    }.items():
        for layout in (rows, cols):
            sharded, plain = _Net(layout, rank), _Net(None, rank)
            _train(sharded, make_opt)
            _train(plain, make_opt)
            if not torch.equal(sharded.weight.full_tensor(), plain.weight.detach()):
                bad.append(f"{name} {layout}: weight")
            if not torch.equal(sharded.bias, plain.bias):
                bad.append(f"{name} {layout}: bias")
    return bad


class _LegacyStyle(torch.nn.Module):
    """As legacy code kept sharded weights: a plain attribute plus the two hooks."""

    def __init__(self, layout: Layout, rank: int, scale: float) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(2, 2)
        self.lin.table = _st(layout, rank, FULL * scale)
        self._register_state_dict_hook(legacy.state_dict_hook)
        self._register_load_state_dict_pre_hook(legacy.pre_load_state_dict_hook, True)


def _hooks(rank: int, world: int) -> list[str]:
    bad: list[str] = []
    rows = Layout.chunked(SHAPE, 0, world)
    cols = Layout.column_wise(SHAPE, [1, 3], world_size=world)
    a, b = _LegacyStyle(rows, rank, 1.0), _LegacyStyle(cols, rank, 2.0)
    sd = a.state_dict()
    if sorted(sd) != ["lin.bias", "lin.table", "lin.weight"] or sd["lin.table"] is not a.lin.table:
        bad.append(f"state_dict {sorted(sd)}")
    table = b.lin.table
    result = b.load_state_dict(sd, strict=False)
    if result.unexpected_keys != ["lin.table"]:  # as with the legacy hooks
        bad.append(f"unexpected {result.unexpected_keys}")
    if b.lin.table is not table or b.lin.table.layout_spec != cols:
        bad.append("the attribute was replaced")
    if not torch.equal(b.lin.table.full_tensor(), FULL):
        bad.append("values not loaded across layouts")
    return bad


def test_module_with_sharded_parameters(tmp_path: Path):
    assert run_ranks(_modules, 2, str(tmp_path), timeout=60) == [[], []]


def test_legacy_state_dict_hooks():
    assert run_ranks(_hooks, 2, timeout=60) == [[], []]
