"""Megatron-Core 0.19.2 (the real package) <-> shardwise: checkpoints and state dicts.

Megatron's own `dist_checkpointing.save/load` (torch_dist) run on gloo ranks
with the CPU stand-ins of `megatron_harness`. Every value is compared bit for
bit against one global tensor per key.
"""

from __future__ import annotations

import json

import torch

from tests.clients.conftest import require

require("megatron.core.dist_checkpointing")

import pytest  # noqa: E402

import shardwise as sw  # noqa: E402
import shardwise.checkpoint as swc  # noqa: E402
from shardwise import Block, Layout  # noqa: E402
from shardwise.testing import run_ranks  # noqa: E402

pytestmark = pytest.mark.spawned

SHAPES = {
    "tp.weight": (8, 6),
    "layers.weight": (4, 3, 5),
    "uneven.weight": (10, 3),
    "multi": (12, 2),
    "bias": (4,),
}
COMMON = {"iteration": 7, "args": {"lr": 0.5, "name": "gpt"}}


def full(key: str) -> torch.Tensor:
    """The global value of `key`, the same in every process."""
    g = torch.Generator().manual_seed(sum(map(ord, key)))
    t = torch.randn(SHAPES[key], generator=g)
    return t.to(torch.bfloat16) if key == "bias" else t


def _megatron() -> object:
    from tests.clients.megatron_harness import patch_for_cpu

    patch_for_cpu()
    import megatron.core.dist_checkpointing as mdc

    return mdc


def _mcore_sd(rank: int, layout: str, empty: bool = False) -> dict:
    """A Megatron sharded state dict on 2 ranks, `layout` "a" (the save) or "b" (a reload):
    TP splits, stacked layers (prepend_axis_num, several pieces per rank), uneven rows
    (axis_fragmentations=None), a key rank 1 does not hold, a replicated bf16 bias."""
    from megatron.core.dist_checkpointing import ShardedObject, ShardedTensor

    def data(key: str, sl: tuple) -> torch.Tensor:
        t = full(key)[sl].clone()
        return torch.full_like(t, -1) if empty else t

    def uneven(key: str, lo: int, n: int) -> ShardedTensor:
        shape = SHAPES[key]
        return ShardedTensor(
            key,
            data(key, (slice(lo, lo + n),)),
            full(key).dtype,
            (n, *shape[1:]),
            shape,
            (lo,) + (0,) * (len(shape) - 1),
            None,
        )

    axis = 1 if layout == "a" else 0
    half = SHAPES["tp.weight"][axis] // 2
    tp_slice = (
        (slice(None), slice(rank * half, (rank + 1) * half))
        if axis
        else (slice(rank * half, (rank + 1) * half),)
    )
    sd = {
        "tp": {
            "weight": ShardedTensor.from_rank_offsets(
                "tp.weight", data("tp.weight", tp_slice), (axis, rank, 2)
            )
        }
    }
    layers = [2 * rank, 2 * rank + 1] if layout == "a" else [rank, rank + 2]
    sd["decoder"] = {
        f"layers.{i}.weight": ShardedTensor.from_rank_offsets(
            "layers.weight", data("layers.weight", (i,)), (0, i, 4), prepend_axis_num=1
        )
        for i in layers
    }
    rows = [(0, 7), (7, 3)] if layout == "a" else [(0, 4), (4, 6)]
    sd["uneven"] = uneven("uneven.weight", *rows[rank])
    multi = {"a": [[(0, 3), (3, 2), (5, 7)], []], "b": [[(0, 5)], [(5, 4), (9, 3)]]}[layout][rank]
    if multi:
        sd["multi"] = [uneven("multi", lo, n) for lo, n in multi]
    sd["bias"] = ShardedTensor.from_rank_offsets(
        "bias", data("bias", (slice(None),)), replica_id=rank
    )
    if layout == "a":
        sd["extra"] = ShardedObject("extra", {"rank": rank}, (2,), (rank,))
        sd.update(COMMON)
    return sd


def _check_mcore(sd: dict) -> list[str]:
    """Keys whose loaded Megatron pieces differ from the global values."""
    from megatron.core.dist_checkpointing import ShardedTensor

    wrong = []
    stack = [sd]
    while stack:
        node = stack.pop()
        items = node.values() if isinstance(node, dict) else node
        for v in items:
            if isinstance(v, (dict, list)):
                stack.append(v)
            elif isinstance(v, ShardedTensor):
                want = full(v.key)[v.global_slice()]
                data = v.data
                if tuple(data.shape) == (1,) * v.prepend_axis_num + tuple(v.local_shape):
                    data = data.view(
                        v.local_shape
                    )  # Megatron's load leaves its prepended-axes view
                if not torch.equal(data, want):
                    wrong.append(v.key)
    return wrong


def _targets(rank: int, ws: int) -> dict[str, sw.ShardedTensor]:
    """shardwise targets of other layouts: uneven rows with an empty rank, columns, chunks."""
    layouts = {
        "tp.weight": Layout.row_wise(SHAPES["tp.weight"], [5, 0, 3][:ws] if ws == 3 else [8]),
        "layers.weight": Layout.chunked(SHAPES["layers.weight"], 2, ws),
        "uneven.weight": Layout.column_wise(
            SHAPES["uneven.weight"], [1, 2, 0][:ws] if ws == 3 else [3]
        ),
        "multi": Layout.chunked(SHAPES["multi"], 0, ws),
        "bias": Layout.replicated(SHAPES["bias"], ws),
    }
    return {k: sw.ShardedTensor.full(lay, -7.0, dtype=full(k).dtype) for k, lay in layouts.items()}


def _wrong(targets: dict[str, sw.ShardedTensor]) -> list[str]:
    return [
        k
        for k, st in targets.items()
        if not all(
            torch.equal(s, full(k)[b.slices()]) for s, b in zip(st.local_shards(), st.local_blocks)
        )
    ]


# -- rank bodies ---------------------------------------------------------------------------


def _megatron_save(rank: int, ws: int, path: str) -> None:
    mdc = _megatron()
    mdc.save(_mcore_sd(rank, "a"), path)


def _megatron_load(rank: int, ws: int, path: str) -> tuple[list[str], object]:
    mdc = _megatron()
    sd = _mcore_sd(rank, "b", empty=True)
    loaded = mdc.load(sd, path)
    return _check_mcore(sd), {k: loaded.get(k) for k in COMMON}


def _swc_load_then_save_for_megatron(rank: int, ws: int, path: str, out: str) -> list[str]:
    targets = _targets(rank, ws)
    swc.load(targets, path, strict=True)  # Megatron's common_state / extra objects do not count
    wrong = _wrong(targets)
    swc.save({**targets, **COMMON}, out, megatron=True)
    return wrong


def _adapters(rank: int, ws: int, path: str, out: str) -> dict:
    """Megatron objects straight through swc.load / swc.save, and both conversions."""
    _megatron()
    from megatron.core.dist_checkpointing import ShardedTensor
    from megatron.core.dist_checkpointing.strategies.checkpointable import (
        CheckpointableShardedTensor,
        LocalShardsContainer,
    )

    from shardwise.interop.megatron import to_megatron, to_shardwise

    result: dict = {}
    # 1. Megatron pieces (the reload layout, garbage data; one piece's data left None), keyed by Megatron key
    sd = _mcore_sd(rank, "b", empty=True)
    flat = {"tp.weight": sd["tp"]["weight"], "uneven.weight": sd["uneven"], "bias": sd["bias"]}
    flat["bias"].data = None  # Megatron's placeholder for "allocate on load"
    swc.load(flat, path)
    result["pieces"] = _check_mcore(flat)
    # 2. DCP wrappers, as Megatron's torch_dist strategy builds them: placeholder dtype float32
    layer_pieces = list(sd["decoder"].values())
    wrappers = {
        "layers.weight": LocalShardsContainer(
            [CheckpointableShardedTensor.from_sh_ten(p) for p in layer_pieces]
        ),
        "bias": CheckpointableShardedTensor.from_sh_ten(
            ShardedTensor.from_rank_offsets(
                "bias", torch.zeros(4, dtype=torch.bfloat16), replica_id=rank
            )
        ),
    }
    assert wrappers["bias"].dtype == torch.float32  # the placeholder swc.load must not trust
    swc.load(wrappers, path)
    result["wrappers"] = _check_mcore(layer_pieces) + _check_mcore([wrappers["bias"]._sh_ten])
    # 3. to_shardwise shares storage; to_megatron gives it back over the same storage
    st = to_shardwise(layer_pieces)
    result["shared"] = [s.data_ptr() for s in st.local_shards()] == [
        p.data.data_ptr() for p in layer_pieces
    ]
    back = to_megatron({"layers.weight": st}, prepend_axis_num=1)["layers.weight"]
    result["back"] = [
        (tuple(p.global_offset), p.prepend_axis_num, p.data.data_ptr(), p.axis_fragmentations)
        for p in back
    ] == [(tuple(p.global_offset), 1, p.data.data_ptr(), (4, 1, 1)) for p in layer_pieces]
    replicated = to_megatron({"bias": to_shardwise(wrappers["bias"])})["bias"]
    result["replica_id"] = replicated.replica_id
    # 4. swc.save of Megatron's pieces (main replicas only written), Megatron-readable, read offline
    save_sd = _mcore_sd(rank, "a")
    save_sd["iteration"] += (
        rank  # ranks disagree: rank 0's common state is the one kept, as Megatron's
    )
    swc.save(save_sd, out, megatron=True)
    # 5. overlapping pieces: the same error on every rank
    bad = ShardedTensor(
        "bad", torch.zeros(3, 2), torch.float32, (3, 2), (5, 2), (rank * 2, 0), None
    )
    try:
        to_shardwise(bad)
    except sw.LayoutError as e:
        result["error"] = type(e).__name__
    return result


def _swc_load_nested(rank: int, ws: int, path: str) -> tuple[list[str], list[str]]:
    """Megatron's own nesting (dict paths that are not the Megatron keys, other entries
    on each rank): loaded by Megatron key, with or without `megatron=True`."""
    _megatron()
    sd = _mcore_sd(rank, "b", empty=True)
    swc.load(sd, path)
    plain = _check_mcore(sd)
    sd = _mcore_sd(rank, "b", empty=True)
    swc.load(sd, path, megatron=True)
    return plain, _check_mcore(sd)


# -- tests ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def megatron_ckpt(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("megatron") / "ckpt"
    path.mkdir()
    run_ranks(_megatron_save, 2, str(path), timeout=90)
    return str(path)


def test_megatron_checkpoint_offline(megatron_ckpt: str) -> None:
    info = swc.inspect(megatron_ckpt)
    assert {t.key: t.shape for t in info.tensors} == SHAPES
    assert {t.key: t.chunks for t in info.tensors} == {
        "tp.weight": 2,
        "layers.weight": 4,
        "uneven.weight": 2,
        "multi": 3,
        "bias": 1,
    }
    assert sorted(info.objects) == ["common_state/shard_0_1", "extra/shard_0_2", "extra/shard_1_2"]
    assert swc.verify(megatron_ckpt) == []
    for key in SHAPES:
        assert torch.equal(swc.read_tensor(megatron_ckpt, key), full(key)), key
    region = Block((1, 2, 1), (2, 1, 3))
    assert torch.equal(
        swc.read_tensor(megatron_ckpt, "layers.weight", region),
        full("layers.weight")[region.slices()],
    )
    from shardwise.checkpoint.megatron import read_common_state

    assert read_common_state(megatron_ckpt) == COMMON


def _swc_load_one_rank(rank: int, ws: int, path: str) -> list[str]:
    targets = _targets(rank, ws)
    swc.load(targets, path, strict=True)
    return _wrong(targets)


def test_swc_load_megatron_checkpoint_on_one_rank(megatron_ckpt: str) -> None:
    assert run_ranks(_swc_load_one_rank, 1, megatron_ckpt, timeout=60) == [[]]


def test_megatron_2_to_shardwise_3_to_megatron_2(megatron_ckpt: str, tmp_path) -> None:
    out = str(tmp_path / "sw")
    assert run_ranks(_swc_load_then_save_for_megatron, 3, megatron_ckpt, out, timeout=90) == [
        [],
        [],
        [],
    ]
    assert (tmp_path / "sw" / "metadata.json").exists() and swc.verify(out) == []
    results = run_ranks(_megatron_load, 2, out, timeout=90)
    assert results == [([], COMMON), ([], COMMON)]


def test_megatron_objects_through_swc_load_and_save(megatron_ckpt: str, tmp_path) -> None:
    out = str(tmp_path / "from_pieces")
    results = run_ranks(_adapters, 2, megatron_ckpt, out, timeout=90)
    for rank, r in enumerate(results):
        assert r == {
            "pieces": [],
            "wrappers": [],
            "shared": True,
            "back": True,
            "replica_id": rank,
            "error": "LayoutError",
        }, rank
    for key in SHAPES:  # Megatron's pieces saved by swc: main replicas only, every key whole
        assert torch.equal(swc.read_tensor(out, key), full(key)), key
    from shardwise.checkpoint.megatron import read_common_state

    assert read_common_state(out)["iteration"] == 7
    # and Megatron's own load opens it, into another layout, common state included
    assert run_ranks(_megatron_load, 2, out, timeout=90) == [([], COMMON), ([], COMMON)]


def test_megatron_save_keeps_a_foreign_metadata_json_and_writes_its_own(tmp_path) -> None:
    st = sw.ShardedTensor.from_layout(
        Layout.row_wise((4, 2), [4]), [torch.arange(8.0).reshape(4, 2)]
    )
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "metadata.json").write_text('{"mine": 1}')
    with pytest.raises(FileExistsError, match="metadata.json exists and is not Megatron's"):
        swc.save({"w": st}, foreign, megatron=True)
    assert (foreign / "metadata.json").read_text() == '{"mine": 1}'
    assert sorted(p.name for p in foreign.iterdir()) == ["metadata.json"]

    from megatron.core.dist_checkpointing.mapping import LocalNonpersistentObject, ShardedTensor

    piece = ShardedTensor.from_rank_offsets("p", torch.ones(2))
    with pytest.raises(TypeError, match="'l' is a tuple holding Megatron or shardwise sharded"):
        swc.save({"w": st, "l": (1, piece)}, tmp_path / "mixed", megatron=True)
    assert not (tmp_path / "mixed").exists()

    legacy = tmp_path / "legacy"  # a legacy common.pt would shadow the new common state
    legacy.mkdir()
    torch.save({"step": 1}, legacy / "common.pt")
    with pytest.raises(FileExistsError, match="common.pt exists .a legacy Megatron common state."):
        swc.save({"w": st, "step": 3}, legacy, megatron=True)
    assert sorted(p.name for p in legacy.iterdir()) == ["common.pt"]

    fresh = tmp_path / "fresh"
    swc.save({"w": st, "step": 3, "cache": LocalNonpersistentObject([9])}, fresh, megatron=True)
    assert json.loads((fresh / "metadata.json").read_text()) == {
        "sharded_backend": "torch_dist",
        "sharded_backend_version": 1,
    }
    assert torch.equal(swc.read_tensor(fresh, "w"), torch.arange(8.0).reshape(4, 2))
    from shardwise.checkpoint.megatron import read_common_state

    assert read_common_state(fresh) == {"step": 3}


def test_swc_load_megatron_nesting_by_megatron_key(megatron_ckpt: str) -> None:
    results = run_ranks(_swc_load_nested, 2, megatron_ckpt, timeout=90)
    assert results == [([], []), ([], [])]


def _save_megatrons_dcp_objects(rank: int, ws: int, path: str) -> list[str]:
    """Megatron's own DCP objects (`mcore_to_pyt_state_dict`: legacy torch ShardedTensors for
    stacked layers, Megatron's wrappers, BytesIO for objects), with common values, saved by
    swc.save(megatron=True)."""
    _megatron()
    from megatron.core.dist_checkpointing.strategies.torch import mcore_to_pyt_state_dict

    by_key: dict = {}
    stack = [_mcore_sd(rank, "a")]
    while stack:
        node = stack.pop()
        for v in node.values() if isinstance(node, dict) else node:
            if isinstance(v, (dict, list)):
                stack.append(v)
            elif hasattr(v, "key") and type(v).__name__ == "ShardedTensor":
                by_key.setdefault(v.key, []).append(v)
    pyt = mcore_to_pyt_state_dict(by_key)
    kinds = sorted({type(v).__name__ for v in pyt.values()})
    swc.save({**pyt, **COMMON}, path, megatron=True)
    return kinds


def test_megatrons_dcp_objects_save_as_tensors_with_the_flag(tmp_path) -> None:
    path = tmp_path / "dcp_objects"
    kinds = run_ranks(_save_megatrons_dcp_objects, 2, str(path), timeout=90)
    assert "ShardedTensor" in kinds[0]  # torch's legacy class, for the stacked layers
    info = swc.inspect(str(path))
    assert {t.key: t.shape for t in info.tensors} == SHAPES  # layers.weight among them
    assert sorted(info.objects) == ["common_state/shard_0_1"]
    for key in SHAPES:
        assert torch.equal(swc.read_tensor(str(path), key), full(key)), key
    from shardwise.checkpoint.megatron import read_common_state

    assert read_common_state(path) == COMMON
    # and Megatron opens it into another layout
    assert run_ranks(_megatron_load, 2, str(path), timeout=90) == [([], COMMON)] * 2


def test_a_strided_piece_is_loaded_through_a_copy_and_filled(tmp_path) -> None:
    """One process: a piece whose data is a transposed view (not contiguous) is loaded
    into a contiguous copy and copied back, its base tensor getting the values."""
    from megatron.core.dist_checkpointing import ShardedTensor

    value = torch.arange(12.0).reshape(3, 4)
    swc.save({"w": ShardedTensor.from_rank_offsets("w", value.clone())}, tmp_path / "ck")
    base = torch.full((4, 3), -1.0)
    piece = ShardedTensor.from_rank_offsets("w", base.t())  # strided, (3, 4)
    assert not piece.data.is_contiguous()
    swc.load({"model": {"w": piece}}, tmp_path / "ck")
    assert torch.equal(base.t(), value) and torch.equal(piece.data, value)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_megatron_pieces_on_cuda_save_and_load_in_place(tmp_path) -> None:
    """One process, pieces on the GPU: saved through pinned staging, loaded in place
    into CUDA pieces (a strided one through its copy), bit for bit."""
    from megatron.core.dist_checkpointing import ShardedTensor

    value = torch.arange(12.0).reshape(3, 4)
    swc.save({"w": ShardedTensor.from_rank_offsets("w", value.cuda())}, tmp_path / "ck")
    base = torch.full((4, 3), -1.0, device="cuda")
    piece = ShardedTensor.from_rank_offsets("w", base.t())
    swc.load({"model": {"w": piece}}, tmp_path / "ck")
    assert piece.data.is_cuda and torch.equal(piece.data.cpu(), value)
