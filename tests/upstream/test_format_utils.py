"""Ports of PyTorch's DCP format-conversion tests (torch 2.13 era):

- test/distributed/checkpoint/test_format_utils.py (dcp_to_torch_save,
  torch_save_to_dcp, BroadcastingTorchSaveReader + DynamicMetaLoadPlanner);
- the older test/distributed/checkpoint/test_dcp_to_torch_save.py and
  test_torch_save_to_dcp.py (offline / online conversion through a custom
  StorageReader), which later versions folded into test_format_utils.py.

Where a storage is involved, DCP's FileSystemWriter / FileSystemReader are
swapped for `shardwise.checkpoint.Writer` / `Reader`: `dcp_to_torch_save` and
`torch_save_to_dcp` are called as is (stock DCP reading / writing next to
shardwise) and once more with their internal FileSystemReader / FileSystemWriter
replaced by ours (the same two lines as format_utils, with our storage), and the
`checkpoint_id=` calls run both as dcp.save/load with Writer/Reader and as
swc.save/swc.load. Every upstream assertion is kept; checks marked "(added)" are
not upstream's.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.format_utils import (
    BroadcastingTorchSaveReader,
    DynamicMetaLoadPlanner,
    dcp_to_torch_save,
    torch_save_to_dcp,
)
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict
from torch.distributed.checkpoint.state_dict_saver import _save_state_dict
from torch.distributed.checkpoint.storage import StorageReader
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.futures import Future

from .harness import (
    FORMS,
    Check,
    Reader,
    TestDummyModel,
    Writer,
    assert_equal,
    bind,
    by_form,
    ignore_user_warnings,
    load_as,
    save_as,
    scenario_results,
    sw_load,
    sw_save,
    verdict,
)  # the storage under test

pytestmark = [ignore_user_warnings, pytest.mark.spawned]

SAVES = ["Writer", "swc.save"]  # the save-only forms: dcp.save with Writer, or swc.save
by_save = pytest.mark.parametrize("form", SAVES)


class SimpleModelUneven(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net1 = nn.Linear(5, 10)
        self.relu = nn.ReLU()
        self.net2 = nn.Linear(10, 15)
        self.net3 = nn.Linear(15, 30)
        self.net4 = nn.Linear(30, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.net1(x))
        x = F.relu(self.net2(x))
        x = F.relu(self.net3(x))
        return self.net4(x)


def convert_dcp_to_torch_save_with(reader: StorageReader, torch_save_path: Path) -> None:
    """format_utils.dcp_to_torch_save with its FileSystemReader swapped for `reader`."""
    sd: dict[str, Any] = {}
    _load_state_dict(sd, storage_reader=reader, planner=_EmptyStateDictLoadPlanner(), no_dist=True)
    torch.save(sd, torch_save_path)


def convert_torch_save_to_dcp_with(torch_save_path: Path, writer: Any) -> None:
    """format_utils.torch_save_to_dcp with its FileSystemWriter swapped for `writer`."""
    state_dict = torch.load(torch_save_path, weights_only=False)
    _save_state_dict(state_dict, storage_writer=writer, no_dist=True)


# -- test_format_utils.py :: TestFormatUtils.test_dcp_to_torch_save (one process) ----------


@pytest.mark.parametrize("save", SAVES)
@pytest.mark.parametrize("convert", ["stock dcp_to_torch_save", "dcp_to_torch_save with Reader"])
def test_dcp_to_torch_save(tmp_path: Path, save: str, convert: str) -> None:
    # upstream: test_format_utils.py :: test_dcp_to_torch_save
    # (dcp.save(checkpoint_id=...) -> dcp.save(storage_writer=Writer(...)) or swc.save; the
    # conversion as is, and with its FileSystemReader swapped for Reader)
    model = SimpleModelUneven()
    save_as(save, {"model": model}, tmp_path)

    torch_path = tmp_path / "model.pt"
    if convert == "stock dcp_to_torch_save":
        dcp_to_torch_save(tmp_path, torch_path)
    else:
        convert_dcp_to_torch_save_with(Reader(tmp_path), torch_path)

    loaded_sd = torch.load(torch_path)
    assert_equal({"model": model.state_dict()}, loaded_sd)


# -- test_format_utils.py :: TestFormatUtils.test_torch_save_to_dcp (one process) ----------


@pytest.mark.parametrize(
    "convert",
    ["stock torch_save_to_dcp, load with Reader", "torch_save_to_dcp with Writer", "swc.save"],
)
def test_torch_save_to_dcp(tmp_path: Path, convert: str) -> None:
    # upstream: test_format_utils.py :: test_torch_save_to_dcp
    # (the DCP checkpoint is written into the folder that holds model.pt, as upstream does)
    model = SimpleModelUneven()
    sd = {"model": model.state_dict()}
    torch_path = tmp_path / "model.pt"
    torch.save(sd, torch_path)

    if convert.startswith("stock"):
        torch_save_to_dcp(torch_path, tmp_path)
    elif convert == "torch_save_to_dcp with Writer":
        convert_torch_save_to_dcp_with(torch_path, Writer(tmp_path))
    else:
        sw_save(torch.load(torch_path, weights_only=False), tmp_path)

    model = SimpleModelUneven()
    load_as(convert, {"model": model}, tmp_path)
    assert_equal(sd, {"model": model.state_dict()})
    # (added, SPEC 3: a save never deletes a file the checkpoint did not write)
    assert torch_path.exists(), "model.pt, written before the save into its folder, is gone"


def test_torch_save_to_dcp_swc_load_reads_stock(tmp_path: Path) -> None:
    # upstream: test_format_utils.py :: test_torch_save_to_dcp
    # (stock torch_save_to_dcp writes, swc.load reads: SPEC 3 "swc.load reads a stock checkpoint")
    model = SimpleModelUneven()
    sd = {"model": model.state_dict()}
    torch_path = tmp_path / "model.pt"
    torch.save(sd, torch_path)
    torch_save_to_dcp(torch_path, tmp_path)
    model = SimpleModelUneven()
    sw_load({"model": model}, tmp_path)
    assert_equal(sd, {"model": model.state_dict()})


# -- multi-rank scenarios (2 ranks, gloo) ---------------------------------------------------


def online_torch_save_to_dcp(path: Path, check: Check) -> None:
    # upstream: test_format_utils.py :: test_online_torch_save_to_dcp
    # A torch.save file loads straight into a model on every rank through
    # BroadcastingTorchSaveReader (rank 0 reads, broadcasts) and DynamicMetaLoadPlanner.
    # Upstream wraps the model in FSDP1, which needs an accelerator, and loads FSDP1's default
    # (full, unsharded) state dict; on CPU the model stays unwrapped, which presents the same
    # full state dict. No shardwise storage is involved (the reader is DCP's own).
    model = SimpleModelUneven()
    sd = {"model": model.state_dict()}
    torch_fn = path.parent / "online_model.pt"
    if dist.get_rank() == 0:
        torch.save(sd, torch_fn)
    dist.barrier()

    model = SimpleModelUneven()
    for p in model.parameters():  # other values than the file's
        nn.init.normal_(p)
    dcp.load(
        {"model": model},
        planner=DynamicMetaLoadPlanner(),
        storage_reader=BroadcastingTorchSaveReader(),
        checkpoint_id=torch_fn,
    )
    check.equal(sd["model"], model.state_dict(), "state dict after load")


class NestedModel(nn.Module):
    """A 'complicated enough' state dict with nested modules (stands in for upstream's
    Transformer(ModelArgs()) from torch's internal test utilities)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.tok_embeddings = nn.Embedding(8, 16)
        self.layers = nn.ModuleList(
            nn.ModuleDict(
                {
                    "attention_norm": nn.LayerNorm(16),
                    "attention": nn.Linear(16, 48),
                    "ffn": nn.Linear(16, 16),
                }
            )
            for _ in range(2)
        )
        self.norm = nn.LayerNorm(16)
        self.output = nn.Linear(16, 8, bias=False)


def dcp_to_torch_save_transformer(path: Path, check: Check, form: str) -> None:
    # upstream: test_dcp_to_torch_save.py :: test_dcp_to_torch_save
    # Saved on 2 ranks (every tensor replicated), converted on each rank. Each rank writes its own
    # .pt file (upstream's ranks all write the same one).
    model = NestedModel()
    save_as(form, {"model": model}, path)
    torch_fn = Path(f"{path}.{dist.get_rank()}.pt")
    dcp_to_torch_save(path, torch_fn)
    check.equal({"model": model.state_dict()}, torch.load(torch_fn), "stock dcp_to_torch_save")
    torch_fn2 = Path(f"{path}.{dist.get_rank()}.reader.pt")
    convert_dcp_to_torch_save_with(Reader(path), torch_fn2)
    check.equal(
        {"model": model.state_dict()}, torch.load(torch_fn2), "dcp_to_torch_save with Reader"
    )


def _torch_save_on_rank0(folder: Path, model: nn.Module) -> Path:
    # upstream saves into a NamedTemporaryFile on rank 0 and broadcasts its name
    fp = folder / "torch_save.pt"
    if dist.get_rank() == 0:
        folder.mkdir(parents=True, exist_ok=True)
        torch.save(model.state_dict(), fp)
    dist.barrier()
    return fp


def offline_conversion(path: Path, check: Check, form: str) -> None:
    # upstream: test_torch_save_to_dcp.py :: test_offline_conversion
    # torch.save file -> DTensors sharded Shard(0) over the ranks -> DCP checkpoint; then a
    # plain load of the converted checkpoint.
    model = TestDummyModel()
    fp_name = _torch_save_on_rank0(path.parent / f"{path.name}_src", model)
    state_dict = torch.load(fp_name, map_location="cpu")
    device_mesh = init_device_mesh("cpu", [dist.get_world_size()])
    for key, value in state_dict.items():
        state_dict[key] = DTensor.from_local(
            value, device_mesh, [Replicate()], run_check=False
        ).redistribute(placements=[Shard(0)])
    save_as(form, state_dict, path)

    state_dict = copy.deepcopy(model.state_dict())
    load_as(form, state_dict, path)
    check.equal(state_dict, model.state_dict(), "converted checkpoint loads back")

    # (added) the same load into zeroed targets, so that the values must come from the checkpoint
    zeroed = {k: torch.zeros_like(v) for k, v in model.state_dict().items()}
    load_as(form, zeroed, path)
    check.equal(model.state_dict(), zeroed, "(added) load into zeroed targets")


def _state_dict_and_metadata(fp_name: Path) -> tuple[dict[str, Any], Metadata]:
    """A torch.save file's tensors and DCP metadata describing each as one whole chunk."""
    state_dict = torch.load(fp_name, map_location="cpu")
    state_dict_metadata = {}
    for key, value in state_dict.items():
        size = value.size()
        state_dict_metadata[key] = TensorStorageMetadata(
            TensorProperties(dtype=value.dtype),
            size,
            [ChunkStorageMetadata(offsets=torch.Size([0] * len(size)), sizes=size)],
        )
    return state_dict, Metadata(state_dict_metadata=state_dict_metadata)


class TorchSaveReader(StorageReader):
    """Serves a torch.save file's tensors to dcp.load (upstream's example reader)."""

    def __init__(self, fp_name: Path) -> None:
        super().__init__()
        self.state_dict, self.metadata = _state_dict_and_metadata(fp_name)

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        return

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        for req in plan.items:
            if req.type == LoadItemType.BYTE_IO:
                raise RuntimeError("The conversion does not support BYTE_IO yet.")
            tensor = narrow_tensor_by_index(
                self.state_dict[req.storage_index.fqn], req.storage_offsets, req.lengths
            )
            target_tensor = planner.resolve_tensor(req).detach()
            if target_tensor.size() != tensor.size():
                raise AssertionError(
                    f"req {req.storage_index} mismatch sizes "
                    f"{target_tensor.size()} vs {tensor.size()}"
                )
            target_tensor.copy_(tensor)
            planner.commit_tensor(req, target_tensor)
        fut: Future = Future()
        fut.set_result(None)
        return fut

    def read_metadata(self) -> Metadata:
        return self.metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool) -> None:
        return

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, global_plan: list[LoadPlan]) -> list[LoadPlan]:
        return global_plan

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return True


class ConversionReader(StorageReader):
    """Reads a DCP checkpoint folder (through the storage under test) or a torch.save file."""

    def __init__(self, fp_name: Path) -> None:
        # not a robust way to tell a DCP checkpoint, but good enough for the example
        self.reader = Reader(fp_name) if os.path.isdir(fp_name) else TorchSaveReader(fp_name)

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        return

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        return self.reader.read_data(plan, planner)

    def read_metadata(self) -> Metadata:
        return self.reader.read_metadata()

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool) -> None:
        return self.reader.set_up_storage_reader(metadata, is_coordinator)

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return self.reader.prepare_local_plan(plan)

    def prepare_global_plan(self, global_plan: list[LoadPlan]) -> list[LoadPlan]:
        return self.reader.prepare_global_plan(global_plan)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return True


def online_conversion(path: Path, check: Check, form: str) -> None:
    # upstream: test_torch_save_to_dcp.py :: test_online_conversion
    model = TestDummyModel()
    fp_name = _torch_save_on_rank0(path.parent / f"{path.name}_src", model)
    copy_state_dict = copy.deepcopy(model.state_dict())
    state_dict = model.state_dict()
    # dcp.load through ConversionReader reads a torch.save file ...
    dcp.load(state_dict, storage_reader=ConversionReader(fp_name))
    model.load_state_dict(state_dict)
    check.equal(copy_state_dict, model.state_dict(), "loaded from the torch.save file")

    # ... or a DCP checkpoint (read here by the Reader under test)
    save_as(form, state_dict, path)
    dcp.load(state_dict, storage_reader=ConversionReader(path))
    model.load_state_dict(state_dict)
    check.equal(copy_state_dict, model.state_dict(), "loaded from the DCP checkpoint")


SCENARIOS: dict[str, Callable[[Path, Check], None]] = {
    "online_torch_save_to_dcp": online_torch_save_to_dcp,
    **{
        f"dcp_to_torch_save_transformer[{save}]": bind(dcp_to_torch_save_transformer, save)
        for save in SAVES
    },
    **{f"offline_conversion[{form}]": bind(offline_conversion, form) for form in FORMS},
    **{f"online_conversion[{save}]": bind(online_conversion, save) for save in SAVES},
}


results = scenario_results("format_utils", __name__, 2, timeout=120)


def test_online_torch_save_to_dcp(results) -> None:
    # upstream: test_format_utils.py :: test_online_torch_save_to_dcp (plain model, CPU)
    verdict(results, "online_torch_save_to_dcp")


@by_save
def test_dcp_to_torch_save_distributed(results, form) -> None:
    # upstream: test_dcp_to_torch_save.py :: test_dcp_to_torch_save
    verdict(results, f"dcp_to_torch_save_transformer[{form}]")


@by_form
def test_offline_conversion(results, form) -> None:
    # upstream: test_torch_save_to_dcp.py :: test_offline_conversion
    verdict(results, f"offline_conversion[{form}]")


@by_save
def test_online_conversion(results, form) -> None:
    # upstream: test_torch_save_to_dcp.py :: test_online_conversion
    verdict(results, f"online_conversion[{form}]")
