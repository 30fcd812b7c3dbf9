"""Port of PyTorch's test/distributed/checkpoint/e2e/test_e2e_save_and_load.py (torch 2.13 era).

Models and optimizers saved and loaded whole through DCP: `get_state_dict` /
`set_state_dict`, Stateful objects (a tensor holder, a train state with a
BytesIO), partial loads, `_load_state_dict_from_keys`, async save with and
without cached staging, overwrite semantics, key order across ranks, and the
no-process-group path. DCP's FileSystemWriter / FileSystemReader are swapped for
`shardwise.checkpoint.Writer` / `Reader` (same constructor arguments), and each
`checkpoint_id=` call also runs as `swc.save(..., overwrite=True)` / `swc.load`.

Upstream needs 4 GPUs for its distributed tests; here they run on 4 CPU ranks
(gloo). DDP, one of upstream's model types, runs on CPU, so the e2e test runs with
DDP here, and the async-save and partial-load tests, which upstream runs with FSDP1
(accelerator only), run with DDP too; the FSDP/HSDP variants run only with 4 CUDA
devices. Every upstream assertion is kept; "(adapted)" notes say where a detail
had to change.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum, auto
from functools import partial
from io import BytesIO
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.distributed.checkpoint.state_dict_saver as saver
import torch.nn as nn
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed._state_dict_utils import _gather_state_dict
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    _patch_model_state_dict,
    _patch_optimizer_state_dict,
    get_model_state_dict,
    get_optimizer_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

import shardwise.checkpoint as swc

from .harness import (  # the storage under test
    FORMS,
    STOCK,
    Check,
    Reader,
    TestDummyModel,
    Writer,
    assert_equal,
    bind,
    by_form,
    cuda_devices,
    ignore_user_warnings,
    load_as,
    run_cuda_scenarios,
    save_as,
    scenario_results,
    verdict,
)

pytestmark = [ignore_user_warnings, pytest.mark.spawned]

WORLD_SIZE = 4
CUDA4 = cuda_devices(4)
NO_PIN = (
    "cache_staged_state_dict=True stages into pinned memory, which stock DCP cannot allocate "
    "without an accelerator"
)
NEEDS_CUDA4 = "FSDP1/HSDP need an accelerator; upstream runs these on 4 CUDA devices"


class TestStatefulObj:
    __test__ = False

    def __init__(self, device: str = "cpu") -> None:
        self.data = torch.rand(10, 10, device=device)

    def state_dict(self) -> dict[str, Any]:
        return {"data": self.data}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.data = state_dict["data"]

    def __eq__(self, other: object) -> bool:
        return torch.equal(self.data, other.data)  # type: ignore[attr-defined]


class ModelType(Enum):
    FSDP = auto()
    HSDP = auto()
    FSDP_TP = auto()
    DDP = auto()
    NONE = auto()  # no parallelization


@dataclass
class TestTrainState:
    __test__ = False
    step: int = 0
    current_loss: float = -1
    losses: list[float] = field(default_factory=list)

    def state_dict(self) -> dict[str, Any]:
        loss_bytes = BytesIO()
        torch.save(self.losses, loss_bytes)
        return {
            "step": torch.tensor(self.step, dtype=torch.int32),
            "current_loss": torch.tensor(self.current_loss, dtype=torch.float32),
            "losses": loss_bytes,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.step = state_dict["step"].item()
        self.current_loss = state_dict["current_loss"].item()
        state_dict["losses"].seek(0)
        self.losses = torch.load(state_dict["losses"])

    def __eq__(self, other: object) -> bool:
        return (
            self.step == other.step  # type: ignore[attr-defined]
            and self.current_loss == other.current_loss  # type: ignore[attr-defined]
            and self.losses == other.losses  # type: ignore[attr-defined]
        )


def _train(model: Any, optim: torch.optim.Optimizer, train_steps: int = 1):
    torch.manual_seed(0)
    loss = None
    train_state = TestTrainState()
    for _ in range(train_steps):
        loss = model(model.get_input()).sum()
        loss.backward()
        # real training syncs the loss across dp ranks; simulated here
        train_state.step += 1
        train_state.current_loss = torch.rand(1).item()
        train_state.losses.append(train_state.current_loss)
        optim.step()
        optim.zero_grad()
    return loss, train_state


def _device(model_type: ModelType) -> str:
    return "cuda" if model_type in (ModelType.FSDP, ModelType.HSDP) else "cpu"


def _optim(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.Adam(model.parameters(), lr=0.1)


def _create_model(model_type: ModelType, device: str = "cpu"):
    dummy_model = TestDummyModel().to(device)
    world = dist.get_world_size()
    if model_type == ModelType.FSDP:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        model = FSDP(
            dummy_model, device_mesh=init_device_mesh("cuda", (world,)), use_orig_params=True
        )
    elif model_type == ModelType.HSDP:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        from torch.distributed.fsdp.api import ShardingStrategy

        model = FSDP(
            dummy_model,
            device_mesh=init_device_mesh("cuda", (2, world // 2)),
            use_orig_params=True,
            sharding_strategy=ShardingStrategy.HYBRID_SHARD,
        )
    elif model_type == ModelType.DDP:
        model = DistributedDataParallel(dummy_model)
        model.get_input = partial(TestDummyModel.get_input, model)
    else:
        model = dummy_model
    optim = _optim(model)
    if model_type is not ModelType.NONE:
        _patch_model_state_dict(model)
        _patch_optimizer_state_dict(model, optimizers=optim)
    return model, optim


# -- VerifyStateDictMixin's checks (torch.testing._internal.distributed.common_state_dict) ----


def compare_tensor(
    check: Check, orig: torch.Tensor, dist_tensor: Any, offload_to_cpu: bool, what: str
) -> None:
    if isinstance(dist_tensor, (DTensor, ShardedTensor)):
        dist_tensor = _gather_state_dict({"mykey": dist_tensor}).pop("mykey")
    if offload_to_cpu:
        orig = orig.cpu()
        dist_tensor = dist_tensor.cpu()
    check.true(isinstance(dist_tensor, torch.Tensor), f"{what} is a tensor")
    check.true(torch.allclose(orig, dist_tensor), f"{what} allclose")


def verify_msd(
    check: Check, msd: dict, dist_msd: dict, offload_to_cpu: bool = False, what: str = "msd"
) -> None:
    check.equal(len(msd), len(dist_msd), f"{what}: number of entries")
    for fqn, param in msd.items():
        dist_param = dist_msd.get(fqn)
        check.true(dist_param is not None, f"{what}: {fqn} present")
        if dist_param is not None:
            compare_tensor(check, param, dist_param, offload_to_cpu, f"{what}: {fqn}")


def verify_osd_by_load(check: Check, model: nn.Module, optim, new_optim, dist_osd: dict) -> None:
    new_dist_osd = _gather_state_dict(dist_osd)
    set_state_dict(model, optimizers=new_optim, model_state_dict={}, optim_state_dict=new_dist_osd)
    check.equal(
        optim.state_dict(), new_optim.state_dict(), "optimizer state loaded from the dist osd"
    )


# -- TestE2ESaveAndLoad (distributed) -------------------------------------------------


def run_e2e(
    path: Path,
    check: Check,
    model_type: ModelType,
    form: str,
    cache_staged_state_dict: bool = False,
) -> None:
    # upstream: e2e/test_e2e_save_and_load.py :: _run_e2e_test
    # (via test_e2e and test_e2e_async_cached)
    device = _device(model_type)
    model, optim = _create_model(ModelType.NONE, device)
    _train(model, optim, train_steps=2)

    dist_model, dist_optim = _create_model(model_type, device)
    _, original_train_state = _train(dist_model, dist_optim, train_steps=2)
    original_stateful_obj = TestStatefulObj(device)  # arbitrary object saving/loading
    sd = {
        "model": dist_model,
        "optimizer": dist_optim,
        "s": original_stateful_obj,
        "train_state": original_train_state,
    }

    if form == "async Writer":
        writer = Writer(path, cache_staged_state_dict=cache_staged_state_dict)
        f = saver.async_save(sd, storage_writer=writer)
        t = time.monotonic()
        while not f.done():
            time.sleep(0.05)
            if time.monotonic() - t > 60:
                raise TimeoutError("async_save did not finish within 60s")
        f.result()
    elif form == "swc.async_save":
        if STOCK:
            dcp.async_save(sd, checkpoint_id=path).result()
        else:
            swc.async_save(sd, path, overwrite=True).result()
    else:  # upstream: DCP.save(sd, checkpoint_id=...)
        save_as(form, sd, path)

    loaded_stateful_obj = TestStatefulObj(device)
    loaded_train_state = TestTrainState()
    dist_model, dist_optim = _create_model(model_type, device)
    to_load = {
        "model": dist_model,
        "optimizer": dist_optim,
        "s": loaded_stateful_obj,
        "train_state": loaded_train_state,
    }
    # upstream: checkpoint_id=...; every form but swc.save/load (the async ones too) loads
    # through dcp.load with Reader
    load_as(form if form == "swc.save/load" else "Writer/Reader", to_load, path)

    check.true(original_stateful_obj == loaded_stateful_obj, "stateful object restored")
    check.true(original_train_state == loaded_train_state, "train state restored")

    # one more step on both models
    loss, _ = _train(model, optim, train_steps=1)
    dist_loss, _ = _train(dist_model, dist_optim, train_steps=1)
    check.equal(loss, dist_loss, "loss after one more step")

    dist_msd, dist_osd = get_state_dict(dist_model, optimizers=dist_optim)
    model_sd, _optim_sd = get_state_dict(model, optimizers=optim)
    verify_msd(check, model_sd, dist_msd)
    verify_osd_by_load(check, model, optim, _optim(model), dist_osd)


def different_ordered_state_dict_keys(path: Path, check: Check, form: str) -> None:
    # upstream: e2e/test_e2e_save_and_load.py :: test_different_ordered_state_dict_keys
    # The order of keys must not matter: were it followed, ranks would deadlock in the
    # collectives the two load_state_dict methods issue. (adapted: CPU tensors, gloo)
    world_size = dist.get_world_size()

    class Foo:
        def state_dict(self):
            return {}

        def load_state_dict(self, state_dict):
            tl = [torch.ones(2, dtype=torch.int64) for _ in range(world_size)]
            t = torch.arange(2, dtype=torch.int64) + 1 + 2 * dist.get_rank()
            dist.all_gather(tl, t, async_op=False)

    class Bar:
        def state_dict(self):
            return {}

        def load_state_dict(self, state_dict):
            tensor = torch.arange(2, dtype=torch.int64) + 1 + 2 * dist.get_rank()
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM)

    sd = {"A": Foo(), "B": Bar()} if dist.get_rank() == 0 else {"B": Bar(), "A": Foo()}
    save_as(form, sd, path)
    load_as(form, sd, path)


def partial_load(path: Path, check: Check, model_type: ModelType, form: str) -> None:
    # upstream: e2e/test_e2e_save_and_load.py :: test_partial_load
    # (adapted: DDP on CPU where upstream uses FSDP1; the FSDP variant needs CUDA)
    device = _device(model_type)
    model, optim = _create_model(ModelType.NONE, device)
    _train(model, optim, train_steps=2)

    dist_model, dist_optim = _create_model(model_type, device)
    _train(dist_model, dist_optim, train_steps=2)
    save_as(form, {"model": dist_model, "optimizer": dist_optim}, path)

    dist_model, _ = _create_model(model_type, device)
    load_as(form, {"model": dist_model}, path)

    dist_msd = get_model_state_dict(dist_model)
    model_sd = get_model_state_dict(model)
    verify_msd(check, model_sd, dist_msd, what="partially loaded model")

    # another way
    loaded_model_sd = _load_state_dict_from_keys("model", storage_reader=Reader(path))["model"]
    verify_msd(
        check,
        model_sd,
        loaded_model_sd,
        offload_to_cpu=True,
        what="_load_state_dict_from_keys('model')",
    )

    loaded_optim_state = _load_state_dict_from_keys("optimizer.state", storage_reader=Reader(path))[
        "optimizer"
    ]["state"]
    check.true(
        "param_groups" not in loaded_optim_state, "'param_groups' not in loaded optimizer state"
    )
    for k, v in dist_optim.state_dict()["state"].items():
        for optim_key in ["exp_avg", "exp_avg_sq", "step"]:
            compare_tensor(
                check,
                loaded_optim_state[k][optim_key],
                v[optim_key],
                True,
                f"optimizer.state.{k}.{optim_key}",
            )


def overwrite(path: Path, check: Check, form: str) -> None:
    # upstream: e2e/test_e2e_save_and_load.py :: test_overwrite
    # (adapted: seeded so that every rank draws the same t1, t2 - each rank compares its own
    # t2 with the one copy that was written)
    torch.manual_seed(0)
    t1, t2 = torch.randn(10), torch.randn(10)
    if form == "Writer/Reader" or STOCK:
        dcp.save({"random": t1}, storage_writer=Writer(path))  # upstream: checkpoint_id=...
        dcp.save({"random": t2}, storage_writer=Writer(path, overwrite=True))
        sd = {"random": torch.zeros(10)}
        dcp.load(sd, storage_reader=Reader(path))
        check.true(torch.allclose(sd["random"], t2), "overwritten checkpoint holds t2")
        check.raises(
            CheckpointException,
            ".*Checkpoint already exists.*",
            lambda: dcp.save({"random": t2}, storage_writer=Writer(path, overwrite=False)),
            "save over an existing checkpoint with overwrite=False",
        )
    else:
        swc.save({"random": t1}, path)
        swc.save({"random": t2}, path, overwrite=True)
        sd = {"random": torch.zeros(10)}
        swc.load(sd, path)
        check.true(torch.allclose(sd["random"], t2), "overwritten checkpoint holds t2")
        check.raises(
            (CheckpointException, FileExistsError),
            "(?i)already exists",
            lambda: swc.save({"random": t2}, path, overwrite=False),
            "swc.save over an existing checkpoint with overwrite=False",
        )


SCENARIOS: dict[str, Callable[[Path, Check], None]] = {
    **{f"e2e[DDP,{form}]": bind(run_e2e, ModelType.DDP, form) for form in FORMS},
    "e2e_async_cached[False]": bind(run_e2e, ModelType.DDP, "async Writer", False),
    **(
        {"e2e_async_cached[True]": bind(run_e2e, ModelType.DDP, "async Writer", True)}
        if torch.cuda.is_available()
        else {}
    ),
    "e2e_async[swc.async_save]": bind(run_e2e, ModelType.DDP, "swc.async_save"),
    **{f"ordered_keys[{form}]": bind(different_ordered_state_dict_keys, form) for form in FORMS},
    **{f"partial_load[DDP,{form}]": bind(partial_load, ModelType.DDP, form) for form in FORMS},
    **{f"overwrite[{form}]": bind(overwrite, form) for form in FORMS},
}

CUDA_SCENARIOS: dict[str, Callable[[Path, Check], None]] = {
    **{
        f"e2e[{mt.name},{form}]": bind(run_e2e, mt, form)
        for mt in (ModelType.FSDP, ModelType.HSDP)
        for form in FORMS
    },
    **{
        f"e2e_async_cached[FSDP,{cache}]": bind(run_e2e, ModelType.FSDP, "async Writer", cache)
        for cache in (False, True)
    },
    **{f"partial_load[FSDP,{form}]": bind(partial_load, ModelType.FSDP, form) for form in FORMS},
}


results = scenario_results("e2e", __name__, WORLD_SIZE, timeout=240)
cuda_results = scenario_results(
    "e2e_cuda",
    f"{__name__}:CUDA_SCENARIOS",
    WORLD_SIZE,
    timeout=300,
    body=run_cuda_scenarios,
    name="cuda_results",
    backend="cpu:gloo,cuda:nccl",
)


@by_form
def test_e2e_ddp(results, form) -> None:
    # upstream: e2e/test_e2e_save_and_load.py :: test_e2e[compile=False, model_type=DDP]
    verdict(results, f"e2e[DDP,{form}]")


@pytest.mark.skip(
    reason="torch.compile is orthogonal to storage and costs minutes of inductor compilation "
    "on 2 CPU cores"
)
def test_e2e_compiled() -> None:
    # upstream: e2e/test_e2e_save_and_load.py :: test_e2e[compile=True, *]
    pass


@pytest.mark.skipif(not CUDA4, reason=NEEDS_CUDA4)
@pytest.mark.parametrize("model_type", ["FSDP", "HSDP"])
@by_form
def test_e2e_fsdp(cuda_results, model_type, form) -> None:
    # upstream: e2e/test_e2e_save_and_load.py :: test_e2e[compile=False, model_type=FSDP|HSDP]
    verdict(cuda_results, f"e2e[{model_type},{form}]")


@pytest.mark.parametrize("cache_staged_state_dict", [False, True])
def test_e2e_async_cached(results, cache_staged_state_dict) -> None:
    # upstream: e2e/test_e2e_save_and_load.py :: test_e2e_async_cached
    # (saver.async_save with storage_writer=Writer(path, cache_staged_state_dict=...); DDP on CPU)
    if cache_staged_state_dict and not torch.cuda.is_available():
        pytest.skip(NO_PIN)
    verdict(results, f"e2e_async_cached[{cache_staged_state_dict}]")


def test_e2e_async_swc_async_save(results) -> None:
    # upstream: e2e/test_e2e_save_and_load.py :: test_e2e_async_cached (through swc.async_save)
    verdict(results, "e2e_async[swc.async_save]")


@pytest.mark.skipif(not CUDA4, reason=NEEDS_CUDA4)
@pytest.mark.parametrize("cache_staged_state_dict", [False, True])
def test_e2e_async_cached_fsdp(cuda_results, cache_staged_state_dict) -> None:
    # upstream: e2e/test_e2e_save_and_load.py :: test_e2e_async_cached (FSDP, as upstream)
    verdict(cuda_results, f"e2e_async_cached[FSDP,{cache_staged_state_dict}]")


@by_form
def test_different_ordered_state_dict_keys(results, form) -> None:
    # upstream: e2e/test_e2e_save_and_load.py :: test_different_ordered_state_dict_keys
    verdict(results, f"ordered_keys[{form}]")


@by_form
def test_partial_load(results, form) -> None:
    # upstream: e2e/test_e2e_save_and_load.py :: test_partial_load (DDP on CPU)
    verdict(results, f"partial_load[DDP,{form}]")


@pytest.mark.skipif(not CUDA4, reason=NEEDS_CUDA4)
@by_form
def test_partial_load_fsdp(cuda_results, form) -> None:
    # upstream: e2e/test_e2e_save_and_load.py :: test_partial_load (FSDP, as upstream)
    verdict(cuda_results, f"partial_load[FSDP,{form}]")


@by_form
def test_overwrite(results, form) -> None:
    # upstream: e2e/test_e2e_save_and_load.py :: test_overwrite
    verdict(results, f"overwrite[{form}]")


# -- one-process tests (no process group, as upstream) -----------------------------------


@by_form
def test_stateful_and_non_stateful_loads(tmp_path: Path, form: str) -> None:
    # upstream: e2e/test_e2e_save_and_load.py :: test_stateful_and_non_stateful_loads
    class StateDict(dict):
        def __init__(self) -> None:
            self.set_sd_item_called = False

        def __setitem__(self, item: Any, value: Any) -> None:
            self.set_sd_item_called = True
            super().__setitem__(item, value)

    class Foo(Stateful):
        def __init__(self) -> None:
            self.load_state_dict_called = False

        def state_dict(self) -> dict:
            return {}

        def load_state_dict(self, state_dict: dict) -> None:
            self.load_state_dict_called = True

    stateful_foo = Foo()
    sd = StateDict()
    sd["foo"] = stateful_foo
    sd.set_sd_item_called = False

    save_as(form, sd, tmp_path)
    load_as(form, sd, tmp_path)

    # the stateful object was loaded in place ...
    assert stateful_foo.load_state_dict_called
    # ... and not replaced in the state dict
    assert not sd.set_sd_item_called

    sd = StateDict()
    sd["foo"] = {"replicated": torch.rand(10, 10), "bytes": [1, 2, 3, 4]}
    sd.set_sd_item_called = False

    save_as(form, sd, tmp_path)
    load_as(form, sd, tmp_path)

    # the non-stateful state dict was replaced with the loaded one
    assert sd.set_sd_item_called


@by_form
def test_no_dist(tmp_path: Path, form: str) -> None:
    # upstream: e2e/test_e2e_save_and_load.py :: test_no_dist
    # no process group in this process: DCP assumes a single process
    save_as(form, {}, tmp_path)
    load_as(form, {}, tmp_path)


@pytest.mark.skip(
    reason="needs an NCCL-only process group (CUDA) and involves no storage: "
    "async_save({}) must refuse it"
)
def test_no_cpu() -> None:
    # upstream: e2e/test_e2e_save_and_load.py :: test_no_cpu
    pass


@by_form
def test_init_state_dict(tmp_path: Path, form: str) -> None:
    # upstream: e2e/test_e2e_save_and_load.py :: test_init_state_dict
    model = TestDummyModel()
    optim = torch.optim.Adam(model.parameters(), lr=0.1)
    state_dict_to_save = {
        "model": get_model_state_dict(model),
        "optimizer": get_optimizer_state_dict(model, optim),
    }
    save_as(form, state_dict_to_save, tmp_path)

    torch.manual_seed(0)
    model_2 = TestDummyModel()
    # the learning rate, not a tensor, differs
    optim_2 = torch.optim.Adam(model_2.parameters(), lr=0.2)
    msd = get_model_state_dict(model_2)
    osd = get_optimizer_state_dict(model_2, optim_2)
    state_dict_to_load = {"model": msd, "optimizer": osd}
    load_as(form, state_dict_to_load, tmp_path)

    # DCP loads in place: the very same objects
    assert msd is state_dict_to_load["model"]
    assert osd is state_dict_to_load["optimizer"]

    # set_state_dict calls load_state_dict on model and optimizer: lr is 0.1 again
    set_state_dict(
        model_2,
        optim_2,
        model_state_dict=state_dict_to_load["model"],
        optim_state_dict=state_dict_to_load["optimizer"],
    )
    assert_equal(msd, get_model_state_dict(model_2))
    assert_equal(osd, get_optimizer_state_dict(model_2, optim_2))
    assert optim_2.param_groups[0]["lr"] == 0.1
