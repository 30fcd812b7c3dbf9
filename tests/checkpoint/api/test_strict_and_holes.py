"""Issue 20 points 7 and 4 (save side): a stored tensor loaded into a non-tensor
target is a `CheckpointMismatchError` (as `dcp.load` refuses it), on every rank,
nothing modified; and a save whose layout leaves elements uncovered is refused
(`ShardMismatchError` naming the key and the first uncovered region) by
`swc.save` and by `dcp.save` with `Writer`, in one process as across ranks."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

import shardwise.checkpoint as swc
from shardwise import Block, CheckpointMismatchError, Layout, ShardedTensor, ShardMismatchError
from shardwise.checkpoint.engine.plan import first_hole
from shardwise.testing import run_ranks

pytestmark = [
    pytest.mark.spawned,
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled"),
]

FULL = torch.arange(48.0).reshape(6, 8)
HOLES = Layout((6, 8), [[Block((0, 0), (4, 8))], []], allow_holes=True)  # rows 4..5: no one's


def _save(kind: str, path: Path) -> None:
    state = {"w": torch.arange(4.0), "step": torch.tensor(5), "meta": {"epoch": 2}}
    if kind == "shardwise":
        swc.save(state, path)
    else:
        dcp.save(state, storage_writer=dcp.FileSystemWriter(path))


# -- point 7: strict means strict -------------------------------------------------------------


@pytest.mark.parametrize("strict", [True, False])
@pytest.mark.parametrize("kind", ["shardwise", "stock"])
def test_stored_tensor_into_a_python_value_is_refused(
    tmp_path: Path, kind: str, strict: bool
) -> None:
    path = tmp_path / "ckpt"
    _save(kind, path)
    target: dict[str, Any] = {"w": torch.zeros(4), "step": 0, "meta": {"epoch": 0}}
    with pytest.raises(CheckpointMismatchError) as caught:
        swc.load(target, path, strict=strict)
    assert "'step' is a Python int here but a tensor in the checkpoint" in str(caught.value)
    # refused before any target is touched
    assert target == {"w": target["w"], "step": 0, "meta": {"epoch": 0}}
    assert torch.equal(target["w"], torch.zeros(4))


@pytest.mark.parametrize("kind", ["shardwise", "stock"])
def test_stock_dcp_load_refuses_it_too(tmp_path: Path, kind: str) -> None:
    """What point 7 matches: dcp.load raises on a tensor stored where a Python value is."""
    path = tmp_path / "ckpt"
    _save(kind, path)
    with pytest.raises(CheckpointException):
        dcp.load({"step": 0}, storage_reader=dcp.FileSystemReader(path))


@pytest.mark.parametrize("kind", ["shardwise", "stock"])
def test_tensor_target_for_a_stored_object_is_refused(tmp_path: Path, kind: str) -> None:
    path = tmp_path / "ckpt"
    _save(kind, path)
    target = {"w": torch.zeros(4), "meta": {"epoch": torch.zeros(1)}}
    with pytest.raises(
        CheckpointMismatchError,
        match="'meta.epoch' is a tensor here but a Python object in the checkpoint",
    ):
        swc.load(target, path, strict=False)
    assert torch.equal(target["w"], torch.zeros(4))


def _load_mismatched(rank: int, world: int, path: str) -> tuple[str, str, bool]:
    target: dict[str, Any] = {"w": torch.zeros(4), "step": 0, "meta": {"epoch": 0}}
    try:
        swc.load(target, path)
        kind, message = "no error", ""
    except Exception as e:  # noqa: BLE001 - the test compares what every rank saw
        kind, message = type(e).__name__, str(e)
    untouched = bool(torch.equal(target["w"], torch.zeros(4))) and target["step"] == 0
    return kind, message, untouched and target["meta"] == {"epoch": 0}


@pytest.mark.parametrize("kind", ["shardwise", "stock"])
def test_every_rank_refuses_the_mismatch(tmp_path: Path, kind: str) -> None:
    path = tmp_path / "ckpt"
    _save(kind, path)
    results = run_ranks(_load_mismatched, 2, str(path), timeout=60)
    for error, message, untouched in results:
        assert error == "CheckpointMismatchError", results
        assert "'step' is a Python int here but a tensor in the checkpoint" in message
        assert untouched


# -- point 4, save side: holes are refused ----------------------------------------------------


def _holey() -> ShardedTensor:
    return ShardedTensor.from_layout(HOLES, [FULL[:4]], rank=0)


def test_swc_save_refuses_a_layout_with_holes(tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    with pytest.raises(ShardMismatchError) as caught:
        swc.save({"h": _holey(), "ok": torch.ones(2)}, path)
    message = str(caught.value)
    assert "'h': elements [4:6, 0:8] are held by no rank" in message
    assert "cover 32 of its 48 elements" in message
    assert not (path / "shardwise.json").exists() and not (path / ".metadata").exists()


def test_dcp_save_with_writer_refuses_a_layout_with_holes(tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    with pytest.raises(CheckpointException) as caught:
        dcp.save({"h": _holey()}, storage_writer=swc.Writer(path))
    failure = next(iter(caught.value.failures.values()))
    refused = failure[0] if isinstance(failure, tuple) else failure
    assert isinstance(refused, ShardMismatchError)
    assert "'h': elements [4:6, 0:8] are written by no rank" in str(refused)
    assert not path.exists()  # refused while planning: nothing written


def test_dcp_save_with_writer_still_saves_a_covered_sharded_tensor(tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    halves = Layout((6, 8), [[Block((0, 0), (4, 8)), Block((4, 0), (2, 8))]])
    dcp.save(
        {"h": ShardedTensor.from_layout(halves, [FULL[:4], FULL[4:]], rank=0)},
        storage_writer=swc.Writer(path),
    )
    assert torch.equal(swc.read_tensor(path, "h"), FULL)


def _save_with_holes(rank: int, world: int, path: str, how: str) -> tuple[str, str]:
    shards = [FULL[:4]] if rank == 0 else []
    h = ShardedTensor.from_layout(HOLES, shards, rank=rank, dtype=torch.float32)
    try:
        if how == "swc":
            swc.save({"h": h}, path)
        else:
            dcp.save({"h": h}, storage_writer=swc.Writer(path))
        return "no error", ""
    except CheckpointException as e:
        failure = next(iter(e.failures.values()))
        inner = failure[0] if isinstance(failure, tuple) else failure
        return f"CheckpointException({type(inner).__name__})", str(inner)
    except Exception as e:  # noqa: BLE001 - the test compares what every rank saw
        return type(e).__name__, str(e)
    finally:
        dist.barrier()


@pytest.mark.parametrize("how", ["swc", "dcp"])
def test_every_rank_refuses_holes(tmp_path: Path, how: str) -> None:
    path = tmp_path / "ckpt"
    results = run_ranks(_save_with_holes, 2, str(path), how, timeout=60)
    kinds = {kind for kind, _ in results}
    assert len(kinds) == 1 and "no error" not in kinds, results
    if how == "swc":
        assert kinds == {"ShardMismatchError"}
        assert all("'h': elements [4:6, 0:8] are held by no rank" in m for _, m in results)
    else:  # across ranks stock DCP's own plan validation refuses them first
        assert kinds == {"CheckpointException(ValueError)"}, results
        assert all(
            "key:h invalid fill tensor-volume: 48 chunks-volume: 32" in m for _, m in results
        )
    assert not (path / "shardwise.json").exists() and not (path / ".metadata").exists()


@pytest.mark.parametrize(
    ("boxes", "shape", "region"),
    [
        ([((0, 0), (4, 8))], (6, 8), ((4, 0), (2, 8))),
        ([((0, 0), (2, 4)), ((2, 0), (2, 2)), ((0, 4), (4, 4))], (4, 8), ((2, 2), (2, 2))),
        ([((0,), (3,)), ((5,), (2,))], (8,), ((3,), (2,))),
        ([], (3, 2), ((0, 0), (3, 2))),
    ],
)
def test_first_hole_is_an_uncovered_region(boxes, shape, region) -> None:
    assert first_hole(boxes, shape) == region
    offsets, sizes = region
    covered = torch.zeros(shape, dtype=torch.bool)
    for o, s in boxes:
        covered[tuple(slice(a, a + n) for a, n in zip(o, s))] = True
    assert not covered[tuple(slice(a, a + n) for a, n in zip(offsets, sizes))].any()
