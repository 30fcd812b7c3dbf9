"""Port of PyTorch's test/distributed/checkpoint/test_dtensor_checkpoint.py (torch 2.13 era).

Upstream runs on 4 GPUs with DCP's FileSystemWriter / FileSystemReader; here the
same scenario runs on 4 CPU ranks (gloo, DeviceMesh "cpu") with
`shardwise.checkpoint.Writer` / `Reader` swapped in (same constructor
arguments), and once more through `swc.save` / `swc.load`. Every upstream
assertion is kept.

Multi-rank scenarios of a file run in one spawned group of ranks (`harness.py`:
`scenario_results`); upstream's assertions are recorded per rank rather than raised
mid-scenario, so that every rank keeps issuing the same collectives, and each pytest
test reports its own scenario's failures from every rank.

Set SHARDWISE_UPSTREAM_STOCK=1 to run the identical scenarios against DCP's own
storage (a control: a scenario failing there is a test bug, not a shardwise one).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor import zeros as dtensor_zeros

from .harness import Check, bind, load_as, save_as, scenario_results, verdict

pytestmark = pytest.mark.spawned

WORLD_SIZE = 4  # upstream's DTensorTestBase default


# -- the upstream scenario ---------------------------------------------------------

SUBMESH_TENSOR_SIZE = 6


class MyTestModule(torch.nn.Module):
    """Two DTensor parameters on the whole mesh, two on a submesh of the even
    ranks, and extra state (an int and a tensor) through get/set_extra_state."""

    def __init__(
        self,
        sdt: DTensor,
        rdt: DTensor,
        submesh_sdt: DTensor,
        submesh_rdt: DTensor,
        extra_state: int = 1,
        extra_state_tensor: torch.Tensor | None = None,
    ) -> None:
        super().__init__()
        self.sdt = torch.nn.Parameter(sdt)
        self.rdt = torch.nn.Parameter(rdt)
        self.submesh_sdt = torch.nn.Parameter(submesh_sdt)
        self.submesh_rdt = torch.nn.Parameter(submesh_rdt)
        self._extra_state = extra_state
        self._extra_state_tensor = (
            torch.zeros(1) if extra_state_tensor is None else extra_state_tensor
        )

    def get_extra_state(self) -> dict[str, Any]:
        return {"extra_state": self._extra_state, "extra_state_tensor": self._extra_state_tensor}

    def set_extra_state(self, state: dict[str, Any]) -> None:
        self._extra_state = state["extra_state"]
        self._extra_state_tensor = state["extra_state_tensor"]


def create_dtensor_model(tensor_to_shard: torch.Tensor, tensor_to_replicate: torch.Tensor):
    world = dist.get_world_size()
    mesh = DeviceMesh("cpu", list(range(world)))
    sharded_dt = distribute_tensor(tensor_to_shard, mesh, placements=[Shard(0)])
    replicated_dt = distribute_tensor(tensor_to_replicate, mesh, placements=[Replicate()])
    # only the even ranks are part of the submesh
    submesh = DeviceMesh("cpu", [i for i in range(world) if i % 2 == 0])
    submesh_sharded_dt = dtensor_zeros(
        [SUBMESH_TENSOR_SIZE], device_mesh=submesh, placements=[Shard(0)]
    )
    submesh_replicated_dt = dtensor_zeros(
        [SUBMESH_TENSOR_SIZE], device_mesh=submesh, placements=[Replicate()]
    )
    model = MyTestModule(sharded_dt, replicated_dt, submesh_sharded_dt, submesh_replicated_dt)
    return model, sharded_dt, replicated_dt


def distributed_tensor_planner(path: Path, check: Check, form: str) -> None:
    # upstream: test_dtensor_checkpoint.py :: test_distributed_tensor_planner
    rank = dist.get_rank()
    local_tensor = torch.arange(0, 4, dtype=torch.float32)
    local_tensor_2 = torch.arange(4, 8, dtype=torch.float32)
    model, sharded_dt, replicated_dt = create_dtensor_model(local_tensor, local_tensor_2)
    state_dict = model.state_dict()
    save_as(form, state_dict, path, planner=DefaultSavePlanner())

    # re-initialised with other values: the load must bring the saved ones back
    model, _, _ = create_dtensor_model(local_tensor * 10, local_tensor_2 * 10)
    state_dict = model.state_dict()
    load_as(form, state_dict, path, planner=DefaultLoadPlanner())

    for k, v in state_dict.items():
        if k == "sdt":
            check.equal(sharded_dt.to_local(), v.to_local(), "sdt")
        if k == "rdt":
            check.equal(replicated_dt.to_local(), v.to_local(), "rdt")
        if k in ("submesh_sdt", "submesh_rdt"):
            if rank % 2 == 0:
                shard_size = (
                    int(SUBMESH_TENSOR_SIZE / v.device_mesh.size())
                    if k == "submesh_sdt"
                    else SUBMESH_TENSOR_SIZE
                )
                check.equal(torch.Size([shard_size]), v.to_local().size(), f"{k} size")
                check.equal(torch.zeros([shard_size]), v.to_local(), k)
            else:
                check.equal(torch.Size([0]), v.to_local().size(), f"{k} size (not in submesh)")
                check.equal(torch.tensor([]), v.to_local(), f"{k} (not in submesh)")
        if k == "_extra_state":
            check.equal(1, v["extra_state"], "_extra_state.extra_state")
            check.equal(
                torch.tensor([0.0]), v["extra_state_tensor"], "_extra_state.extra_state_tensor"
            )


SCENARIOS: dict[str, Callable[[Path, Check], None]] = {
    "planner[Writer/Reader]": bind(distributed_tensor_planner, "storage"),
    "planner[swc.save/load]": bind(distributed_tensor_planner, "swc"),
}


results = scenario_results("dtensor_checkpoint", __name__, WORLD_SIZE, timeout=120)


def test_distributed_tensor_planner_writer_reader(results) -> None:
    # upstream: test_dtensor_checkpoint.py :: test_distributed_tensor_planner
    # (dcp.save/dcp.load with storage_writer=Writer(path=...), storage_reader=Reader(...))
    verdict(results, "planner[Writer/Reader]")


def test_distributed_tensor_planner_swc_save_load(results) -> None:
    # upstream: test_dtensor_checkpoint.py :: test_distributed_tensor_planner
    # (the same scenario through swc.save(..., overwrite=True) / swc.load)
    verdict(results, "planner[swc.save/load]")
