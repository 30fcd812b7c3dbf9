"""The in-place commit protocol (`checkpoint/commit.py`): what each step leaves,
what collection may and may not remove, and the cases a review found."""

from __future__ import annotations

import os
import warnings
from collections import OrderedDict
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultSavePlanner, FileSystemReader, FileSystemWriter

import shardwise.checkpoint as swc
from shardwise.checkpoint.format.manifest import Manifest
from shardwise.checkpoint.io.commit import (
    RecordNames,
    collect,
    in_the_way,
    referenced_files,
)
from shardwise.storage import LocalFolder
from shardwise.testing import run_ranks

pytestmark = pytest.mark.spawned

warnings.filterwarnings("ignore", message="torch.distributed is disabled")


def _state(seed: int) -> dict:
    return {"w": torch.full((4, 3), float(seed)), "step": seed}


def _loads(folder: Path, seed: int, *, stock: bool = False) -> bool:
    out = {"w": torch.zeros(4, 3), "step": -1}
    if stock:
        dcp.load(out, storage_reader=FileSystemReader(folder))
    else:
        swc.load(out, folder)
    return out["step"] == seed and torch.equal(out["w"], torch.full((4, 3), float(seed)))


def test_cached_plans_never_reuse_committed_file_names(tmp_path):
    folder = tmp_path / "ckpt"
    planner = DefaultSavePlanner(enable_plan_caching=True)
    writer = swc.Writer(folder)
    names = []
    for seed in (1, 2, 3):
        dcp.save(_state(seed), storage_writer=writer, planner=planner)
        names.append(referenced_files(folder))
        assert _loads(folder, seed)
    assert len(set().union(*names)) == 3  # a fresh data file every save
    assert [n.name for n in folder.glob("*.distcp")] == sorted(names[-1])


def _die_at(rank: int, world: int, folder: str, point: str) -> None:
    os.environ["SHARDWISE_FAILPOINT"] = point
    dcp.save(_state(2), storage_writer=swc.Writer(folder))


@pytest.mark.parametrize("point", ["before-commit", "between-records", "before-collect"])
def test_a_crash_while_replacing_a_stock_checkpoint_leaves_one_that_loads(tmp_path, point):
    folder = tmp_path / "ckpt"
    dcp.save(_state(1), storage_writer=FileSystemWriter(folder))
    run_ranks(_die_at, 1, str(folder), point, timeout=60, allow_dead=True)
    seed = 1 if point == "before-commit" else 2
    assert _loads(folder, seed) and _loads(folder, seed, stock=True)


def _per_rank_then_global(rank: int, world: int, folder: str) -> bool:
    dcp.save(
        {"own": torch.full((2,), float(rank))},
        storage_writer=swc.Writer(folder),
        use_collectives=False,
    )
    swc.save({"g": torch.ones(3)}, folder, overwrite=True)  # a global checkpoint in the same folder
    reader = swc.Reader(folder)
    metadata = reader.read_metadata(rank=rank)  # the per-rank records still name files that exist
    files = {info.relative_path for info in metadata.storage_data.values()}
    return all((Path(folder) / f).exists() for f in files)


def test_a_global_save_keeps_files_that_per_rank_records_name(tmp_path):
    assert run_ranks(_per_rank_then_global, 2, str(tmp_path / "ckpt"), timeout=60) == [True, True]


def _per_rank_load(rank: int, world: int, folder: str) -> bool:
    dcp.save(
        {"own": torch.full((2,), float(rank))},
        storage_writer=swc.Writer(folder),
        use_collectives=False,
    )
    out = {"own": torch.zeros(2)}
    swc.load(out, folder)  # no global records: each rank reads its own, as dcp.load does
    return torch.equal(out["own"], torch.full((2,), float(rank)))


def test_swc_load_reads_a_per_rank_checkpoint(tmp_path):
    assert run_ranks(_per_rank_load, 2, str(tmp_path / "ckpt"), timeout=60) == [True, True]
    with pytest.raises(FileNotFoundError, match="per-rank"):
        swc.Reader(tmp_path / "ckpt").read_metadata()


def test_planner_data_that_is_not_json_does_not_depend_on_metadata(tmp_path):
    class Planner(DefaultSavePlanner):
        def create_global_plan(self, plans):
            plans, metadata = super().create_global_plan(plans)
            metadata.planner_data = {1: ("a", 2), "od": OrderedDict(x=1)}  # int key, OrderedDict
            return plans, metadata

    folder = tmp_path / "ckpt"
    dcp.save({"x": torch.ones(2)}, storage_writer=swc.Writer(folder), planner=Planner())
    data = swc.Reader(folder).read_metadata().planner_data
    assert data == {1: ("a", 2), "od": OrderedDict(x=1)} and type(data["od"]) is OrderedDict
    (folder / ".metadata").write_bytes(b"replaced by a newer save that died before its manifest")
    data = Manifest.read(folder).decoded_planner_data()  # the manifest holds its own copy
    assert data == {1: ("a", 2), "od": OrderedDict(x=1)} and type(data["od"]) is OrderedDict
    # a reader follows `.metadata` (what stock sees) once it differs: unreadable here
    with pytest.raises(swc.CorruptCheckpointError, match="does not match the manifest"):
        swc.Reader(folder).read_metadata()


def test_collect_removes_only_its_own_files(tmp_path):
    ours = [
        "__0_0.sw0123456789ab.distcp",
        "__1_3.swfedcba987654.distcp",
        "shardwise.json.sw0123456789ab.tmp",
    ]
    theirs = [
        "__0_0.sw0123456789ab.distcp\n",  # a trailing newline: not our name
        "__0_0.distcp",
        "__0_0.sw0123456789AB.distcp",
        "notes.sw0123456789ab.tmp",
        "x.distcp",
    ]
    for name in ours + theirs:
        (tmp_path / name).write_bytes(b"x")
    keep = {"__1_3.swfedcba987654.distcp"}
    assert collect(tmp_path, keep, set()) == sorted(set(ours) - keep)
    assert sorted(os.listdir(tmp_path)) == sorted(theirs + list(keep))
    per_rank = collect(tmp_path, set(), set(), RecordNames(0))  # a per-rank commit: only its rank
    assert per_rank == [] and (tmp_path / "__1_3.swfedcba987654.distcp").exists()


def test_verify_checks_compressed_chunks(tmp_path):
    from torch.distributed.checkpoint._extension import ZStandard

    if not ZStandard.is_available():
        pytest.skip("zstandard is not installed")
    folder = tmp_path / "zstd"
    dcp.save(
        {"x": torch.arange(10000.0)}, storage_writer=swc.Writer(folder, _extensions=[ZStandard()])
    )
    assert swc.verify(folder, raise_on_error=False) == []
    data = next(folder.glob("*.distcp"))
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    data.write_bytes(bytes(raw))
    with pytest.raises(swc.CorruptCheckpointError, match="'x'") as e:
        swc.verify(folder)
    assert len(e.value.problems) == 1


def test_write_atomically_leaves_the_old_file_or_the_new_one(tmp_path):
    path = tmp_path / "record"
    path.write_bytes(b"old")

    def fails(sink) -> None:
        sink.write([b"half"])
        raise OSError("disk full")

    folder = LocalFolder(tmp_path)
    with pytest.raises(OSError, match="disk full"):
        folder.write_atomically("record", fails, sync=True)
    assert path.read_bytes() == b"old" and os.listdir(tmp_path) == ["record"]
    folder.write_atomically("record", lambda sink: sink.write([b"new"]), sync=True)
    assert path.read_bytes() == b"new" and os.listdir(tmp_path) == ["record"]


def test_only_a_checkpoint_or_a_file_is_in_the_way(tmp_path):
    assert in_the_way(tmp_path / "missing") is None
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("not a checkpoint")
    assert in_the_way(tmp_path / "other") is None
    swc.save(_state(1), tmp_path / "ckpt")
    assert "pass overwrite=True" in (in_the_way(tmp_path / "ckpt") or "")
    (tmp_path / "model.pt").write_bytes(b"")
    assert in_the_way(tmp_path / "model.pt") is None
    assert "pass overwrite=True" in (in_the_way(tmp_path / "model.pt", files=True) or "")
