"""Stock DCP's planning on the same per-rank states as `scale_threads`, in one thread.

shardwise's `ShardedTensor` speaks DCP's `_Checkpointable` protocol, so stock's
own planners take each rank's state as it is: `DefaultSavePlanner.set_up_planner`
+ `create_local_plan` on every rank (needed to feed the coordinator), then
`create_global_plan` on all W plans (dedup, `.metadata` build and validation:
the coordinator's work), and `create_default_local_load_plan` against that
`.metadata` for a few sample ranks. Repeated saves use stock's plan caching
(`enable_plan_caching`): a rank compares its plan with its cached one and the
coordinator gets W unusable plans. Not measured: storage planning
(`FileSystemWriter.prepare_*`), the collectives themselves; bytes are the
pickled plans a process group would carry (every rank also reads the whole
`.metadata` on a load).
"""

from __future__ import annotations

import pickle
import statistics
import time
from collections.abc import Callable
from typing import Any

from torch.distributed.checkpoint.default_planner import (
    DefaultSavePlanner,
    create_default_local_load_plan,
)
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner

__all__ = ["stock_load", "stock_save"]


def _size(obj: Any) -> int:
    return len(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))


def _cpu(fn: Callable[[], Any]) -> tuple[float, Any]:
    start = time.thread_time()
    out = fn()
    return time.thread_time() - start, out


def _local_plan(state: dict[str, Any], rank: int, caching: bool = False) -> tuple[float, SavePlan]:
    planner = DefaultSavePlanner(enable_plan_caching=caching)

    def plan() -> SavePlan:
        planner.set_up_planner(state, None, rank == 0)
        return planner.create_local_plan()

    return _cpu(plan)


def stock_save(states: list[dict[str, Any]]) -> tuple[dict[str, dict[str, float]], Metadata]:
    """Stock's first and repeated save planning for W ranks' `states`, and its `.metadata`."""
    local = [_local_plan(state, rank) for rank, state in enumerate(states)]
    plans = [plan for _, plan in local]
    coordinator = DefaultSavePlanner()
    global_s, (global_plans, metadata) = _cpu(lambda: coordinator.create_global_plan(plans))
    local_s = [s for s, _ in local]
    first = {
        "local_max_s": max(local_s),
        "local_median_s": statistics.median(local_s),
        "global_s": global_s,
        "recv_rank0": sum(_size(p) for p in plans[1:]),  # gathered local plans
        "recv_max": max(_size(p) for p in global_plans),  # scattered global plans
        "metadata_bytes": _size(metadata),
    }
    return {"save": first, "save_again": _repeated(states[0], plans)}, metadata


def _repeated(state0: dict[str, Any], plans: list[SavePlan]) -> dict[str, float]:
    """Stock's cached repeated save: rank 0's local compare and the coordinator's reuse."""
    key = DefaultSavePlanner.__name__
    caches = (
        SavePlanner._cached_save_plan,
        SavePlanner._cached_all_plans,
        SavePlanner._cached_global_plan,
        SavePlanner._cached_metadata,
    )
    try:
        SavePlanner._cached_save_plan[key] = plans[0]
        local_s, unchanged = _local_plan(state0, 0, caching=True)
        coordinator = DefaultSavePlanner(enable_plan_caching=True)
        coordinator.create_global_plan(plans)  # hydrates the coordinator's cache
        empty = [unchanged] * len(plans)
        global_s, _ = _cpu(lambda: coordinator.create_global_plan(empty))
    finally:
        for cache in caches:
            cache.pop(key, None)
    return {
        "local_max_s": local_s,
        "local_median_s": local_s,
        "global_s": global_s,
        "recv_rank0": _size(unchanged) * (len(plans) - 1),
        "recv_max": _size(SavePlan([], usable=False)),
    }


def stock_load(targets: dict[int, dict[str, Any]], metadata: Metadata) -> dict[str, float]:
    """`create_default_local_load_plan` for sample ranks' `targets` (rank: state)."""
    seconds = []
    for state in targets.values():
        start = time.thread_time()
        create_default_local_load_plan(state, metadata)
        seconds.append(time.thread_time() - start)
    return {
        "local_max_s": max(seconds),
        "local_median_s": statistics.median(seconds),
        "recv_max": _size(metadata),  # every rank reads the whole `.metadata`
    }
