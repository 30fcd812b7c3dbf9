"""The in-place commit protocol (`commit`): fresh names every save, what each crash point
leaves, scopes of records side by side, and atomic whole-file writes."""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import DefaultSavePlanner, FileSystemReader, FileSystemWriter

import shardwise.checkpoint as swc
from shardwise.checkpoint.io.commit import referenced_files
from shardwise.storage import LocalFolder
from shardwise.testing import RankFailure, run_ranks

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
    # a fresh data file and index (format version 4) every save
    assert [len(n) for n in names] == [2, 2, 2] and len(set().union(*names)) == 6
    assert sorted(n.name for n in folder.glob("*.distcp")) == sorted(names[-1])


def _die_at(rank: int, world: int, folder: str, point: str) -> str:
    os.environ["SHARDWISE_FAILPOINT"] = point
    dcp.save(_state(2), storage_writer=swc.Writer(folder))
    return "the save finished"  # never: the failpoint kills the rank first


@pytest.mark.parametrize("point", ["before-commit", "between-records", "before-collect"])
def test_a_crash_while_replacing_a_stock_checkpoint_leaves_one_that_loads(tmp_path, point):
    """The rank is SIGKILLed at `point` (its slot holds the harness's death notice, exit
    code -9): a save that finished, or failed some other way, is no crash test."""
    folder = tmp_path / "ckpt"
    dcp.save(_state(1), storage_writer=FileSystemWriter(folder))
    [result] = run_ranks(_die_at, 1, str(folder), point, timeout=60, allow_dead=True)
    assert isinstance(result, RankFailure) and str(result) == "rank 0 died (exit code -9)"
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
