"""`engine.loading`: one load path for every checkpoint `swc.load` reads: shardwise,
stock DCP, transformed chunks, values only DCP's planner knows; no `dcp.load` fallback."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.testing._internal.distributed.checkpoint_utils import (
    Rot13Example,
    get_test_extension_registry,
)

import shardwise.checkpoint as swc
from shardwise import Layout, ShardedTensor

FULL = torch.arange(64.0).reshape(8, 8)


def _no_dcp_load(monkeypatch: pytest.MonkeyPatch) -> None:
    """`swc.load` must not fall back to DCP's own load path."""

    def refused(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("swc.load fell back to dcp.load")

    monkeypatch.setattr(dcp, "load", refused)


def test_load_returns_a_load_info(tmp_path: Path) -> None:
    swc.save({"w": FULL, "n": 3}, tmp_path / "ck")
    target = {"w": torch.zeros(8, 8), "n": 0}
    info = swc.load(target, tmp_path / "ck")
    assert isinstance(info, swc.LoadInfo) and info.path == tmp_path / "ck"
    assert info.seconds >= 0 and info.manifest is not None and "n" in info.manifest.objects
    assert info.bytes_read >= FULL.nbytes and target["n"] == 3 and torch.equal(target["w"], FULL)
    with pytest.raises(AttributeError):
        info.bytes_read = 0  # type: ignore[misc]


def test_a_stock_checkpoint_loads_without_dcp_load(tmp_path, monkeypatch):
    path = tmp_path / "stock"
    dcp.save({"w": FULL, "meta": {"epoch": 2}}, storage_writer=FileSystemWriter(path))
    _no_dcp_load(monkeypatch)
    target = {"w": torch.zeros(8, 8), "meta": {"epoch": 0}}
    info = swc.load(target, path)
    assert torch.equal(target["w"], FULL) and target["meta"] == {"epoch": 2}
    assert info.manifest is None
    # a band of the stock record: its head is read to find the payload, then the runs
    band = {"w": ShardedTensor.from_layout(Layout.column_wise((8, 8), [3, 5]), [torch.zeros(8, 3)])}
    swc.load(band, path)
    assert torch.equal(band["w"].local_shards()[0], FULL[:, :3])


def test_transformed_chunks_load_through_the_engine(tmp_path, monkeypatch):
    path = tmp_path / "rot13"
    dcp.save({"w": FULL}, storage_writer=swc.Writer(path, _extensions=[Rot13Example()]))
    _no_dcp_load(monkeypatch)
    rows = Layout.row_wise((8, 8), [3, 5])
    target = {"w": ShardedTensor.from_layout(rows, [torch.zeros(3, 8)], rank=0)}
    swc.load(target, path, extension_registry=get_test_extension_registry())
    assert torch.equal(target["w"].local_shards()[0], FULL[:3])


class _Subclass(torch.Tensor):
    """A tensor subclass the engine's inventory does not know: DCP's planner plans it."""


def test_values_only_dcp_knows_load_through_its_planner_into_the_same_executor(
    tmp_path, monkeypatch
):
    swc.save({"w": FULL, "b": torch.arange(3.0)}, tmp_path / "ck")
    _no_dcp_load(monkeypatch)
    target = {"w": torch.zeros(8, 8).as_subclass(_Subclass), "b": torch.zeros(3)}
    info = swc.load(target, tmp_path / "ck")
    assert torch.equal(target["w"].as_subclass(torch.Tensor), FULL)
    assert torch.equal(target["b"], torch.arange(3.0))
    assert info.bytes_read >= FULL.nbytes + 12


@pytest.mark.parametrize("where", ["local", "memory"])
def test_a_load_lists_its_folder_once(tmp_path, monkeypatch, where):
    """On an object store a listing is a request, made by every rank of a load: one."""
    from shardwise.storage import local, remote

    path = tmp_path / "ck" if where == "local" else f"memory://list-once-{id(tmp_path)}/ck"
    swc.save({"w": FULL, "b": torch.arange(3.0), "n": 3}, path)
    kind = local.LocalFolder if where == "local" else remote.FsspecFolder
    listed = []
    original = kind.sizes

    def sizes(self: Any) -> dict[str, int]:
        listed.append(self)
        return original(self)

    monkeypatch.setattr(kind, "sizes", sizes)
    target = {"w": torch.zeros(8, 8), "b": torch.zeros(3), "n": 0}
    swc.load(target, path)
    assert torch.equal(target["w"], FULL) and target["n"] == 3
    assert len(listed) == 1
