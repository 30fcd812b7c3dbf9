"""Megatron-Core 0.19.2 state dicts as `sharded_state_dict()` returns them, through plain
`swc.save` / `swc.load` (issue 24, point 4).

Saved on 2 ranks (`_mcore_sd(rank, "a")`: column TP, two stacked layers per rank
under two dict entries, a bias replicated by `replica_id`, a ShardedObject,
common values), loaded on 3 ranks into another TP / sharding (`_mcore_sd3`), with
and without `megatron=True`. Every value is compared exactly with its global value.
"""

from __future__ import annotations

import io

import torch

from tests.clients.conftest import require

require("megatron.core.dist_checkpointing")

import pytest  # noqa: E402

import shardwise as sw  # noqa: E402
import shardwise.checkpoint as swc  # noqa: E402
from shardwise import Layout  # noqa: E402
from shardwise.testing import run_ranks  # noqa: E402
from tests.clients.test_megatron import (  # noqa: E402
    COMMON,
    SHAPES,
    _check_mcore,
    _mcore_sd,
    _megatron,
    _megatron_load,
    full,
)

pytestmark = pytest.mark.spawned


def _mcore_sd3(rank: int) -> dict:
    """A Megatron-shaped state dict on 3 ranks, every piece filled with -1: column TP over
    3, layer 0 and 3 on rank 0 (two entries) and layer 3 again on rank 2 as a replica,
    uneven rows, a list of pieces (none on rank 0), a replicated bias, the ShardedObject
    shard `rank % 2` (rank 2 a replica), and common values to fill."""
    from megatron.core.dist_checkpointing import ShardedObject, ShardedTensor

    def minus(key: str, sl: tuple) -> torch.Tensor:
        return torch.full_like(full(key)[sl], -1)

    def rows(key: str, lo: int, n: int) -> ShardedTensor:
        shape = SHAPES[key]
        return ShardedTensor(
            key, minus(key, (slice(lo, lo + n),)), full(key).dtype, (n, *shape[1:]), shape,
            (lo, 0), None,
        )  # fmt: skip

    sd: dict = {
        "tp": {
            "weight": ShardedTensor.from_rank_offsets(
                "tp.weight",
                minus("tp.weight", (slice(None), slice(2 * rank, 2 * rank + 2))),
                (1, rank, 3),
            )  # fmt: skip
        }
    }
    layers = {0: [(0, 0), (3, 0)], 1: [(1, 0)], 2: [(2, 0), (3, 1)]}[rank]
    sd["decoder"] = {
        f"layers.{i}.weight": ShardedTensor.from_rank_offsets(
            "layers.weight",
            minus("layers.weight", (i,)),
            (0, i, 4),
            replica_id=r,
            prepend_axis_num=1,
        )  # fmt: skip
        for i, r in layers
    }
    sd["uneven"] = rows("uneven.weight", *[(0, 2), (2, 5), (7, 3)][rank])
    multi = [[], [(0, 6)], [(6, 2), (8, 4)]][rank]
    if multi:
        sd["multi"] = [rows("multi", lo, n) for lo, n in multi]
    sd["bias"] = ShardedTensor.from_rank_offsets(
        "bias", minus("bias", (slice(None),)), replica_id=rank
    )
    sd["extra"] = ShardedObject("extra", None, (2,), (rank % 2,), replica_id=rank // 2)
    return sd


def _with_common(sd: dict) -> dict:
    sd["iteration"] = -1
    sd["args"] = {"lr": 0.0, "name": ""}
    return sd


def _save(rank: int, ws: int, path: str, megatron: bool) -> None:
    _megatron()
    swc.save(_mcore_sd(rank, "a"), path, megatron=megatron)


def _load_from_megatron_format(rank: int, ws: int, path: str) -> dict:
    """megatron=True or not, the stored common state is merged in, as Megatron's load
    returns it: placeholders replaced, keys the state dict lacked added."""
    _megatron()
    sd = _with_common(_mcore_sd3(rank))
    swc.load(sd, path, megatron=True)
    result = {"true": (_check_mcore(sd), sd["extra"].data, sd["iteration"], sd["args"])}
    sd = _mcore_sd3(rank)
    swc.load(sd, path)
    result["false"] = (_check_mcore(sd), sd["extra"].data, sd["iteration"], sd["args"])
    return result


@pytest.mark.parametrize("megatron", [False, True], ids=["plain", "megatron"])
def test_a_save_2_ranks_is_megatrons_format_and_loads_on_3(tmp_path, megatron) -> None:
    path = tmp_path / "ck"
    run_ranks(_save, 2, str(path), megatron, timeout=90)
    assert (path / "metadata.json").exists()  # Megatron's format, flag or not
    info = swc.inspect(str(path))
    assert {t.key: t.shape for t in info.tensors} == SHAPES  # by Megatron key
    assert {t.key: t.chunks for t in info.tensors} == {  # main replicas only
        "tp.weight": 2,
        "layers.weight": 4,
        "uneven.weight": 2,
        "multi": 3,
        "bias": 1,
    }
    assert sorted(info.objects) == ["common_state/shard_0_1", "extra/shard_0_2", "extra/shard_1_2"]
    for key in SHAPES:
        assert torch.equal(swc.read_tensor(str(path), key), full(key)), key
    # Megatron's own loader opens it, into another layout, common state included
    assert run_ranks(_megatron_load, 2, str(path), timeout=90) == [([], COMMON)] * 2
    results = run_ranks(_load_from_megatron_format, 3, str(path), timeout=90)
    for rank, r in enumerate(results):
        expected = ([], {"rank": rank % 2}, COMMON["iteration"], COMMON["args"])
        assert r == {"true": expected, "false": expected}, rank


def _shardwise_save(rank: int, ws: int, path: str) -> None:
    """A plain save of shardwise tensors keyed by the Megatron keys, on 2 ranks."""
    layouts = {
        "tp.weight": Layout.row_wise(SHAPES["tp.weight"], [3, 5]),
        "layers.weight": Layout.chunked(SHAPES["layers.weight"], 2, ws),
        "uneven.weight": Layout.column_wise(SHAPES["uneven.weight"], [0, 3]),
        "multi": Layout.replicated(SHAPES["multi"], ws),
        "bias": Layout.replicated(SHAPES["bias"], ws),
    }
    targets = {
        k: sw.ShardedTensor.full(lay, -7.0, dtype=full(k).dtype) for k, lay in layouts.items()
    }
    for key, st in targets.items():
        for shard, block in zip(st.local_shards(), st.local_blocks):
            shard.copy_(full(key)[block.slices()])
    swc.save({**targets, **COMMON}, path)


def test_plain_shardwise_save_into_megatron_shaped_state_dict(tmp_path) -> None:
    path = tmp_path / "sw"
    run_ranks(_shardwise_save, 2, str(path), timeout=90)
    sd_objects = swc.inspect(str(path)).objects
    assert "extra/shard_0_2" not in sd_objects
    results = run_ranks(_load_partial, 3, str(path), timeout=90)
    assert results == [([], COMMON)] * 3


def _load_partial(rank: int, ws: int, path: str) -> tuple[list[str], object]:
    """The 3-rank Megatron shape without its ShardedObject (the save had none)."""
    _megatron()
    sd = _with_common(_mcore_sd3(rank))
    del sd["extra"]
    swc.load(sd, path, megatron=False)
    return _check_mcore(sd), {k: sd[k] for k in COMMON}


def _overwrite_with_an_object_nobody_saves(rank: int, ws: int, path: str) -> tuple[str, str]:
    """Saves a ShardedObject (rank 0 its main replica), then overwrites the checkpoint
    with the same key held by both ranks as replicas 1 and 2: no rank would write it."""
    from megatron.core.dist_checkpointing import ShardedObject, ShardedTensor

    _megatron()

    def state(value: int, replica_id: int) -> dict:
        bias = ShardedTensor.from_rank_offsets("bias", full("bias").clone(), replica_id=rank)
        rng = ShardedObject("rng", {"seed": value}, (1,), (0,), replica_id=replica_id)
        return {"bias": bias, "rng": rng}

    swc.save(state(1, rank), path, megatron=True)
    try:
        swc.save(state(2, rank + 1), path, megatron=True, overwrite=True)
    except sw.ShardMismatchError as e:
        return type(e).__name__, str(e)
    return "saved", ""


def test_overwriting_with_an_object_no_rank_saves_is_refused_and_keeps_the_old_one(
    tmp_path,
) -> None:
    path = tmp_path / "ck"
    results = run_ranks(_overwrite_with_an_object_nobody_saves, 2, str(path), timeout=120)
    message = (
        "Megatron ShardedObject 'rng/shard_0_1' (held by ranks 0, 1, none as replica_id 0): "
        "no rank holds the main replica, and only main replicas are saved; give one rank's "
        "copy replica_id 0 (nothing was saved)"
    )
    assert results == [("ShardMismatchError", message)] * 2
    stored = swc.open_checkpoint(str(path)).object_bytes("rng/shard_0_1")
    assert torch.load(io.BytesIO(stored), weights_only=True) == [{"seed": 1}]
    assert swc.verify(str(path)) == []
