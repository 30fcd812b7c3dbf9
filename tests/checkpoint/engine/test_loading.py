"""`engine.load`: one load path for every checkpoint `swc.load` reads: shardwise,
stock DCP, transformed chunks, values only DCP's planner knows; no `dcp.load` fallback."""

from __future__ import annotations

import math
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
from shardwise import Block, Layout, ShardedTensor

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


def _cuts(shape: tuple[int, ...], dim: int, cuts: list[int]) -> list[Block]:
    """`shape` cut along `dim` at `cuts`, whole along every other dimension."""
    bounds = [0, *cuts, shape[dim]]
    return [
        Block(
            tuple(lo if d == dim else 0 for d in range(len(shape))),
            tuple(hi - lo if d == dim else n for d, n in enumerate(shape)),
        )
        for lo, hi in zip(bounds, bounds[1:])
    ]


# (shape, stored blocks, loaded blocks), all on rank 0 so that one process saves and loads
# many. Stored cut along dim 1 at 4, loaded cut at 3 and 8: the piece [3:8] holds the stored
# boundary, the other two fall inside one chunk each.
_ACROSS_DIM_1 = {
    "columns": ((6, 10), _cuts((6, 10), 1, [4]), _cuts((6, 10), 1, [3, 8])),
    "middle_dim": ((2, 10, 3), _cuts((2, 10, 3), 1, [4]), _cuts((2, 10, 3), 1, [3, 8])),
    # stored also cut along dim 0 (at 2): the middle piece takes parts of four chunks
    "grid": (
        (6, 10),
        [
            Block((r0, c0), (r1 - r0, c1 - c0))
            for r0, r1 in ((0, 2), (2, 6))
            for c0, c1 in ((0, 4), (4, 10))
        ],
        _cuts((6, 10), 1, [3, 8]),
    ),
    # more than 16 stored chunks: shardwise's pieces are gathered from arrays of parts
    # (`format.table`, `io.chunks`); stock and cast ones are read box by box
    "many": (
        (3, 40, 2),
        _cuts((3, 40, 2), 1, list(range(2, 40, 2))),
        _cuts((3, 40, 2), 1, [3, 17, 30]),
    ),
}


def _save_across_dim_1(path: Path, case: str, stock: bool) -> tuple[torch.Tensor, list[Block]]:
    """Save the `case` tensor in its stored chunks (shardwise or stock DCP); return the full
    tensor and the blocks to load it into."""
    shape, stored, loaded = _ACROSS_DIM_1[case]
    full = torch.arange(float(math.prod(shape))).reshape(shape)
    layout = Layout(shape, {0: stored})
    st = ShardedTensor.from_layout(layout, [full[b.slices()].clone() for b in stored], rank=0)
    if stock:
        dcp.save({"w": st}, storage_writer=FileSystemWriter(path))
    else:
        swc.save({"w": st}, path)
    return full, loaded


@pytest.mark.parametrize("verify", [True, False], ids=["verify", "no_verify"])
@pytest.mark.parametrize("kind", ["shardwise", "stock", "cast"])
@pytest.mark.parametrize("case", list(_ACROSS_DIM_1))
def test_a_stored_boundary_inside_a_piece_along_dim_1(
    tmp_path: Path, case: str, kind: str, verify: bool
) -> None:
    """Each loaded piece holds exactly its own elements when stored chunk boundaries fall
    inside it along dim 1: a part of a chunk read from, or written to, the wrong offset
    along that dimension shows as wrong values. `cast` loads into another dtype, which
    takes the box-by-box path rather than the gathered one."""
    path = tmp_path / "ck"
    full, loaded = _save_across_dim_1(path, case, stock=kind == "stock")
    dtype = torch.float64 if kind == "cast" else torch.float32
    layout = Layout(full.shape, {0: loaded})
    target = ShardedTensor.from_layout(
        layout, [torch.full(b.sizes, -1.0, dtype=dtype) for b in loaded], rank=0
    )
    swc.load({"w": target}, path, verify=verify, cast_dtype=kind == "cast")
    for block, shard in zip(loaded, target.local_shards(), strict=True):
        assert torch.equal(shard, full[block.slices()].to(dtype)), block
