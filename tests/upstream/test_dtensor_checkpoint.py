"""Port of PyTorch's test/distributed/checkpoint/test_dtensor_checkpoint.py (torch 2.13 era).

Upstream runs on 4 GPUs with DCP's FileSystemWriter / FileSystemReader; here the
same scenario runs on 4 CPU ranks (gloo, DeviceMesh "cpu") with
`shardwise.checkpoint.Writer` / `Reader` swapped in (same constructor
arguments), and once more through `swc.save` / `swc.load`. Every upstream
assertion is kept.

Multi-rank scenarios of a file run in one spawned group of ranks (`run_scenarios`);
upstream's assertions are recorded per rank rather than raised mid-scenario, so
that every rank keeps issuing the same collectives, and each pytest test reports
its own scenario's failures from every rank.

Set SHARDWISE_UPSTREAM_STOCK=1 to run the identical scenarios against DCP's own
storage (a control: a scenario failing there is a test bug, not a shardwise one).
"""

from __future__ import annotations

import importlib
import os
import re
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import (
    DefaultLoadPlanner,
    DefaultSavePlanner,
    FileSystemReader,
    FileSystemWriter,
)
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor import zeros as dtensor_zeros

import shardwise.checkpoint as swc
from shardwise.testing import run_ranks

WORLD_SIZE = 4  # upstream's DTensorTestBase default
STOCK = os.environ.get("SHARDWISE_UPSTREAM_STOCK") == "1"


# -- harness shared by the tests/upstream ports of this group (imported by the others) --


def Writer(*args: Any, **kwargs: Any) -> Any:
    return (FileSystemWriter if STOCK else swc.Writer)(*args, **kwargs)


def Reader(*args: Any, **kwargs: Any) -> Any:
    return (FileSystemReader if STOCK else swc.Reader)(*args, **kwargs)


def sw_save(state: dict, path: Path) -> None:
    if STOCK:
        dcp.save(state, checkpoint_id=path)
    else:
        swc.save(state, path, overwrite=True)


def sw_load(state: dict, path: Path) -> None:
    if STOCK:
        dcp.load(state, checkpoint_id=path)
    else:
        swc.load(state, path)


# -- soft checks: upstream's assertions, recorded so every rank keeps issuing the same collectives


def assert_equal(expected: Any, actual: Any) -> None:
    """torch TestCase.assertEqual for what these tests compare (tensors, containers, scalars)."""
    if isinstance(expected, torch.Tensor) or isinstance(actual, torch.Tensor):
        torch.testing.assert_close(actual, expected)
    elif isinstance(expected, dict) and isinstance(actual, dict):
        assert set(expected) == set(actual), f"keys differ: {sorted(expected)} vs {sorted(actual)}"
        for k in expected:
            try:
                assert_equal(expected[k], actual[k])
            except AssertionError as e:
                raise AssertionError(f"[{k!r}] {e}") from None
    elif isinstance(expected, (list, tuple)) and isinstance(actual, (list, tuple)):
        assert len(expected) == len(actual), f"lengths differ: {len(expected)} vs {len(actual)}"
        for i, (a, b) in enumerate(zip(expected, actual)):
            try:
                assert_equal(a, b)
            except AssertionError as e:
                raise AssertionError(f"[{i}] {e}") from None
    else:
        assert expected == actual, f"{expected!r} != {actual!r}"


class Check:
    def __init__(self) -> None:
        self.failures: list[str] = []

    def equal(self, expected: Any, actual: Any, what: str) -> None:
        try:
            assert_equal(expected, actual)
        except AssertionError as e:
            self.failures.append(f"{what}: {e}")

    def true(self, cond: Any, what: str) -> None:
        if not cond:
            self.failures.append(f"{what}: not true")

    def raises(self, types: Any, pattern: str, fn: Callable[[], Any], what: str) -> None:
        """assertRaisesRegex: `fn()` must raise one of `types` with `pattern` in its message."""
        try:
            fn()
        except types as e:
            if not re.search(pattern, str(e)):
                self.failures.append(f"{what}: {describe(e)} raised but {pattern!r} not in it")
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
            self.failures.append(
                f"{what}: expected {types} matching {pattern!r}, got {describe(e)}"
            )
        else:
            self.failures.append(f"{what}: expected {types} matching {pattern!r}, nothing raised")


def describe(e: BaseException) -> str:
    """One line for an exception; DCP's CheckpointException shows the ranks' own errors."""
    failures = getattr(e, "failures", None)
    if isinstance(failures, dict) and failures:
        inner = []
        for r, f in sorted(failures.items()):
            exc = getattr(f, "exc", f[0] if isinstance(f, tuple) else f)
            inner.append(f"rank {r}: {type(exc).__name__}: {exc}")
        return f"{type(e).__name__} [" + "; ".join(inner) + "]"
    return f"{type(e).__name__}: {e}"


def bind(fn: Callable[..., None], *args: Any, **kwargs: Any) -> Callable[[Path, Check], None]:
    """A scenario: `fn(path, check, *args, **kwargs)`."""
    return lambda path, check: fn(path, check, *args, **kwargs)


def _dirname(name: str) -> str:
    return re.sub(r"\W+", "_", name)


def run_scenarios(
    rank: int, world: int, module: str, root: str, names: list[str]
) -> dict[str, list[str]]:
    """On every rank: run `module.SCENARIOS[name](folder, check)` for each name, in order
    (`module` may be "package.module:TABLE" for another table than SCENARIOS). A scenario's
    failed checks and exception are reported under its name."""
    module_name, _, table = module.partition(":")
    scenarios = getattr(importlib.import_module(module_name), table or "SCENARIOS")
    out: dict[str, list[str]] = {}
    for name in names:
        check = Check()
        try:
            scenarios[name](Path(root) / _dirname(name), check)
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
            check.failures.append(f"raised {describe(e)}\n{traceback.format_exc()}")
        out[name] = check.failures
    return out


def verdict(results: list[dict[str, list[str]]], name: str) -> None:
    ranks_of: dict[str, list[int]] = {}
    for rank, res in enumerate(results):
        for msg in res[name]:
            ranks_of.setdefault(msg, []).append(rank)
    if ranks_of:
        pytest.fail("\n".join(f"ranks {r}: {m}" for m, r in ranks_of.items()), pytrace=False)


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
    if form == "storage":
        dcp.save(
            state_dict=state_dict, storage_writer=Writer(path=path), planner=DefaultSavePlanner()
        )
    else:
        sw_save(state_dict, path)

    # re-initialised with other values: the load must bring the saved ones back
    model, _, _ = create_dtensor_model(local_tensor * 10, local_tensor_2 * 10)
    state_dict = model.state_dict()
    if form == "storage":
        dcp.load(state_dict=state_dict, storage_reader=Reader(path), planner=DefaultLoadPlanner())
    else:
        sw_load(state_dict, path)

    for k, v in state_dict.items():
        if k == "sdt":
            check.equal(sharded_dt.to_local(), v.to_local(), "sdt")
        if k == "rdt":
            check.equal(replicated_dt.to_local(), v.to_local(), "rdt")
        if k == "submesh_sdt":
            if rank % 2 == 0:
                shard_size = int(SUBMESH_TENSOR_SIZE / v.device_mesh.size())
                check.equal(torch.Size([shard_size]), v.to_local().size(), "submesh_sdt size")
                check.equal(torch.zeros([shard_size]), v.to_local(), "submesh_sdt")
            else:
                check.equal(
                    torch.Size([0]), v.to_local().size(), "submesh_sdt size (not in submesh)"
                )
                check.equal(torch.tensor([]), v.to_local(), "submesh_sdt (not in submesh)")
        if k == "submesh_rdt":
            if rank % 2 == 0:
                shard_size = SUBMESH_TENSOR_SIZE
                check.equal(torch.Size([shard_size]), v.to_local().size(), "submesh_rdt size")
                check.equal(torch.zeros([shard_size]), v.to_local(), "submesh_rdt")
            else:
                check.equal(
                    torch.Size([0]), v.to_local().size(), "submesh_rdt size (not in submesh)"
                )
                check.equal(torch.tensor([]), v.to_local(), "submesh_rdt (not in submesh)")
        if k == "_extra_state":
            check.equal(1, v["extra_state"], "_extra_state.extra_state")
            check.equal(
                torch.tensor([0.0]), v["extra_state_tensor"], "_extra_state.extra_state_tensor"
            )


SCENARIOS: dict[str, Callable[[Path, Check], None]] = {
    "planner[Writer/Reader]": bind(distributed_tensor_planner, "storage"),
    "planner[swc.save/load]": bind(distributed_tensor_planner, "swc"),
}


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, list[str]]]:
    root = tmp_path_factory.mktemp("dtensor_checkpoint")
    return run_ranks(run_scenarios, WORLD_SIZE, __name__, str(root), list(SCENARIOS), timeout=120)


def test_distributed_tensor_planner_writer_reader(results) -> None:
    # upstream: test_dtensor_checkpoint.py :: test_distributed_tensor_planner
    # (dcp.save/dcp.load with storage_writer=Writer(path=...), storage_reader=Reader(...))
    verdict(results, "planner[Writer/Reader]")


def test_distributed_tensor_planner_swc_save_load(results) -> None:
    # upstream: test_dtensor_checkpoint.py :: test_distributed_tensor_planner
    # (the same scenario through swc.save(..., overwrite=True) / swc.load)
    verdict(results, "planner[swc.save/load]")
