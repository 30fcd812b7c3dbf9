"""Megatron-Core 0.19.2's DistributedOptimizer checkpoints through shardwise, bit for bit
against Megatron's own `dist_checkpointing.save` / `.load`.

The state is a real Megatron job (`megatron_distopt`: bf16 model in Megatron's DDP, its
distributed Adam stepped twice) checkpointed as a training script does: the model's and
the optimizer's `sharded_state_dict()`s and an iteration, the optimizer's as
`dp_reshardable` (its buckets: ints, then dtype-pair keys, lists of buckets of
per-parameter dicts, `LocalNonpersistentObject`s, ShardedObjects) or
`fully_reshardable` (one model-shaped entry per parameter). Saved on 2 ranks (DP 2) by
Megatron or by `swc.save`; each load job loads the checkpoint both ways, Megatron's
`load` and `swc.load` (filled in place), compares what they give (`unwrapped`), then
`optimizer.load_state_dict(...)` as Megatron's training loop does, and compares each
parameter's optimizer state (gathered to model space) with the saved one.
"""

from __future__ import annotations

from typing import Any

from tests.clients.conftest import require

require("megatron.core.dist_checkpointing")

import pytest  # noqa: E402
import torch  # noqa: E402

import shardwise.checkpoint as swc  # noqa: E402
from shardwise.testing import run_ranks  # noqa: E402
from tests.clients.megatron_distopt import (  # noqa: E402
    DP_RESHARDABLE,
    FULLY_RESHARDABLE,
    ITERATION,
    build,
    checkpoint_state,
    clone_tree,
    local_objects,
    model_space_state,
    path_of,
    scramble,
)
from tests.clients.megatron_gpt import at, differences, unwrapped  # noqa: E402

pytestmark = pytest.mark.spawned

# dp_reshardable keeps Megatron's buckets: two, to have a list of them; fully_reshardable
# one (Megatron 0.19.2 misplaces a multi-bucket state itself: megatron_distopt).
BUCKETS = {DP_RESHARDABLE: 2, FULLY_RESHARDABLE: 1}
SAVE_RANKS = 2  # TP 1, DP 2


# -- rank bodies ---------------------------------------------------------------------------


def _save(rank: int, ws: int, writer: str, sharding_type: str, path: str) -> dict[str, Any]:
    """Train on DP 2, save with `writer` ("megatron", "swc", or "swc-mem-efficient": the
    fully_reshardable state gathered on DP rank 0 only); the saved state in model space
    (rank 0's), Megatron's sharded state dict described, and what the default sharding
    type (fully_sharded_model_space) raises."""
    job = build(1, buckets=BUCKETS[sharding_type])
    mem_efficient = writer == "swc-mem-efficient"
    state = checkpoint_state(job, sharding_type, is_loading=False, mem_efficient=mem_efficient)
    described = _describe(state["optimizer"])
    if writer == "megatron":
        import megatron.core.dist_checkpointing as mdc

        mdc.save(state, path)
    else:
        swc.save(state, path)
    try:
        checkpoint_state(job, "fully_sharded_model_space", is_loading=False)
        model_space = "built"
    except Exception as e:
        model_space = f"{type(e).__name__}: {e}"
    return {"saved": model_space_state(job), "described": described, "model_space": model_space}


def _load(rank: int, ws: int, tp: int, sharding_type: str, path: str) -> dict[str, Any]:
    """On TP `tp`, DP ws/tp (a job that stepped once with other gradients): Megatron's load,
    then swc.load of a fresh sharded state dict; what each returned and, after
    `optimizer.load_state_dict`, the optimizer state in model space."""
    import megatron.core.dist_checkpointing as mdc

    job = build(tp, buckets=BUCKETS[sharding_type], steps=1, salt=1)
    result: dict[str, Any] = {"error": None, "diffs": None, "replaced": None, "swc_state": None}

    scramble(job)
    want = clone_tree(mdc.load(checkpoint_state(job, sharding_type, is_loading=True), path))
    job.optimizer.load_state_dict(want["optimizer"])
    result["megatron_state"] = model_space_state(job)

    scramble(job)
    state = checkpoint_state(job, sharding_type, is_loading=True)
    kept = local_objects(state)
    try:
        swc.load(state, path)
    except Exception as e:  # the same on every rank: swc raises collectively
        result["error"] = f"{type(e).__name__}: {e}"
        return result
    live = unwrapped(state)
    result["replaced"] = [path_of(k) for k, obj in kept.items() if at(live, k) is not obj]
    got = clone_tree(live)
    # not saved: each sharded_state_dict() has its own (a padding entry's `step` is
    # uninitialised memory); only their kind is compared, and that swc left them as passed
    result["diffs"] = differences(got, want, skip=frozenset(kept))
    job.optimizer.load_state_dict(got["optimizer"])
    result["swc_state"] = model_space_state(job)
    return result


def _describe(optimizer_sd: dict[str, Any]) -> dict[str, Any]:
    """The structure of the optimizer's sharded state dict: kinds of values by nesting,
    key types, replica_ids."""
    from megatron.core.dist_checkpointing.mapping import (
        LocalNonpersistentObject,
        ShardedObject,
        ShardedTensor,
    )

    def kind(v: Any) -> str:
        for cls in (ShardedTensor, ShardedObject, LocalNonpersistentObject):
            if isinstance(v, cls):
                return cls.__name__
        return type(v).__name__

    param_state = optimizer_sd["param_state"]
    if param_state is None:  # mem-efficient fully_reshardable, DP rank > 0
        return {"top": {k: kind(v) for k, v in optimizer_sd.items()}}
    out: dict[str, Any] = {
        "top": {k: kind(v) for k, v in optimizer_sd.items()},
        "param_state_keys": [k if isinstance(k, str) else type(k).__name__ for k in param_state],
    }
    if optimizer_sd["param_state_sharding_type"] == DP_RESHARDABLE:
        (dtype_key,) = param_state[0]
        buckets = param_state[0][dtype_key]
        out["dtype_key"] = dtype_key
        out["buckets"] = [
            [(e["padding"].unwrap(), {k: kind(v) for k, v in e.items()}) for e in bucket]
            for bucket in buckets
        ]
        out["replica_ids"] = sorted(
            {e["param"].replica_id for bucket in buckets for e in bucket}
            | {param_state["per_bucket_numel"].replica_id, optimizer_sd["optimizer"].replica_id}
        )
        out["per_bucket_numel_unpadded"] = param_state["per_bucket_numel_unpadded"].data
    else:
        out["entries"] = {
            i: {k: (v.key, tuple(v.global_shape), v.replica_id) for k, v in e.items()}
            for i, e in param_state.items()
        }
    return out


# -- fixtures ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """(writer, sharding_type) -> (checkpoint path, what the save returned on rank 0, and
    on every rank), saved on first use."""
    root = tmp_path_factory.mktemp("distopt")
    cache: dict[tuple[str, str], tuple[str, dict[str, Any], list[dict[str, Any]]]] = {}

    def get(writer: str, sharding_type: str) -> tuple[str, dict[str, Any], list[dict[str, Any]]]:
        if (writer, sharding_type) not in cache:
            path = root / f"{writer}_{sharding_type}"
            path.mkdir()  # Megatron's save wants the folder made
            out = run_ranks(_save, SAVE_RANKS, writer, sharding_type, str(path), timeout=90)
            cache[writer, sharding_type] = (str(path), out[0], out)
        return cache[writer, sharding_type]

    return get


def _check_load(
    results: list[dict[str, Any]], saved_state: dict[str, Any], sharding_type: str
) -> None:
    """Every rank: swc.load gave what Megatron's load gave, and after `load_state_dict` the
    optimizer holds the saved main params and Adam moments, as after Megatron's load.

    The per-parameter Adam `step` is compared with the saved one for fully_reshardable
    only: Megatron's dp_reshardable load copies each entry's `step` (torch Adam keeps one
    per parameter; a `LocalNonpersistentObject`, so the loading job's own) back over the
    loaded one, so after it `step` is the loading job's, whoever filled the state."""

    def moments(state: dict[str, Any]) -> dict[str, Any]:
        keep_step = sharding_type == FULLY_RESHARDABLE
        return {
            n: {k: v for k, v in s.items() if keep_step or k != "step"} for n, s in state.items()
        }

    for rank, r in enumerate(results):
        mine = moments(r["megatron_state"])
        assert differences(mine, moments(saved_state)) == [], f"Megatron's own load, rank {rank}"
        assert r["error"] is None, f"rank {rank}: {r['error']}"
        assert r["diffs"] == [], f"rank {rank}: swc.load vs Megatron's load"
        assert r["replaced"] == [], f"rank {rank}: LocalNonpersistentObjects not left as passed"
        assert differences(r["swc_state"], r["megatron_state"]) == [], (
            f"after swc.load, rank {rank}"
        )


# -- tests ---------------------------------------------------------------------------------


def test_megatron_formats_as_the_tests_expect(saved: Any) -> None:
    """What Megatron 0.19.2 hands to a checkpoint (so the tests below cover it)."""
    _, out, _ = saved("megatron", DP_RESHARDABLE)
    d = out["described"]
    assert d["top"] == {
        "optimizer": "ShardedObject",
        "param_state": "dict",
        "param_state_sharding_type": "str",
    }
    assert d["param_state_keys"] == ["per_bucket_numel", "per_bucket_numel_unpadded", "int"]
    assert d["dtype_key"] == (torch.bfloat16, torch.float32)
    per_param = {
        "param": "ShardedTensor",
        "exp_avg": "ShardedTensor",
        "exp_avg_sq": "ShardedTensor",
        "step": "LocalNonpersistentObject",
        "padding": "LocalNonpersistentObject",
    }
    # rank 0 of DP 2 (192 of each 384-long bucket): fc2.bias (8) at 0, padding to 64 (its
    # own entry, the same keys, "step" uninitialised and not saved), fc2.weight's first
    # 128 of 320; bucket 1 likewise with fc1.bias (40) and fc1.weight
    assert d["buckets"] == [[(False, per_param), (True, per_param), (False, per_param)]] * 2
    assert d["replica_ids"] == [(0, 0, 0)]
    assert d["per_bucket_numel_unpadded"] == [{(torch.bfloat16, torch.float32): [384, 384]}]

    assert out["model_space"] == (
        "CheckpointingException: ShardedTensor.flattened_range is not supported."
    )

    _, out, _ = saved("megatron", FULLY_RESHARDABLE)
    d = out["described"]
    assert d["top"] == {
        "optimizer": "dict",
        "param_state": "dict",
        "param_state_sharding_type": "str",
    }
    assert d["entries"][0]["exp_avg"] == (
        "optimizer.state.exp_avg.module.fc2.bias",
        (8,),
        (0, 0, 0),
    )
    assert sorted(e["param"][0] for e in d["entries"].values()) == [
        f"optimizer.state.param.module.{n}"
        for n in ("fc1.bias", "fc1.weight", "fc2.bias", "fc2.weight")
    ]


def test_dp_reshardable_swc_save_loads_in_megatron_and_swc_at_dp2(saved: Any) -> None:
    path, out, _ = saved("swc", DP_RESHARDABLE)
    _check_load(
        run_ranks(_load, 2, 1, DP_RESHARDABLE, path, timeout=90), out["saved"], DP_RESHARDABLE
    )


@pytest.mark.parametrize("dp", [1, 3])
def test_dp_reshardable_swc_save_loads_at_another_dp(saved: Any, dp: int) -> None:
    path, out, _ = saved("swc", DP_RESHARDABLE)
    _check_load(
        run_ranks(_load, dp, 1, DP_RESHARDABLE, path, timeout=90), out["saved"], DP_RESHARDABLE
    )


@pytest.mark.parametrize("dp", [2, 3])
def test_dp_reshardable_megatron_save_swc_load(saved: Any, dp: int) -> None:
    path, out, _ = saved("megatron", DP_RESHARDABLE)
    _check_load(
        run_ranks(_load, dp, 1, DP_RESHARDABLE, path, timeout=90), out["saved"], DP_RESHARDABLE
    )


@pytest.mark.parametrize(
    ("writer", "tp", "dp"),
    [("swc", 1, 2), ("swc", 1, 3), ("swc", 2, 1), ("megatron", 1, 3), ("megatron", 2, 1)],
)
def test_fully_reshardable_loads_into_another_dp_and_tp(
    saved: Any, writer: str, tp: int, dp: int
) -> None:
    path, out, _ = saved(writer, FULLY_RESHARDABLE)
    _check_load(
        run_ranks(_load, tp * dp, tp, FULLY_RESHARDABLE, path, timeout=90),
        out["saved"],
        FULLY_RESHARDABLE,
    )


def test_fully_reshardable_gathered_on_dp_rank_0_only(saved: Any) -> None:
    """`distrib_optim_fully_reshardable_mem_efficient`: DP rank 1's `param_state` is None
    (ranks save different structures); loads as the default save does, on DP 3."""
    path, out, every = saved("swc-mem-efficient", FULLY_RESHARDABLE)
    assert [o["described"]["top"]["param_state"] for o in every] == ["dict", "NoneType"]
    _check_load(
        run_ranks(_load, 3, 1, FULLY_RESHARDABLE, path, timeout=90),
        out["saved"],
        FULLY_RESHARDABLE,
    )


def test_fully_reshardable_checkpoint_is_model_space_offline(saved: Any) -> None:
    """Megatron's fully_reshardable checkpoint read by swc without ranks: each parameter's
    Adam state whole, under Megatron's key, equal to the saved state."""
    path, out, _ = saved("megatron", FULLY_RESHARDABLE)
    for name, state in out["saved"].items():
        for key in ("param", "exp_avg", "exp_avg_sq"):
            got = swc.read_tensor(path, f"optimizer.state.{key}.module.{name}")
            assert differences(got, state[key]) == [], (name, key)
    from shardwise.checkpoint.megatron import read_common_state

    assert read_common_state(path)["iteration"] == ITERATION
