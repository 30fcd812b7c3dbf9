"""`engine.save`: a save's records through the staging pipeline, on CPU.

`Staging(host=True)` sends host tensors through the slabs as device tensors go
on a GPU, so the engine-level behaviour — bytes and checksums equal to a direct
save, waves within the budget, the staged signal on every rank, a failure on
one rank mid-staging raised on all with the last checkpoint kept — is checked
on any machine. Ranks are threads (ThreadedWorld).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from shardwise import Layout, ShardedTensor
from shardwise.checkpoint.engine import save as rank_file
from shardwise.checkpoint.engine.save import Staging, save_state
from shardwise.checkpoint.format.manifest import Manifest
from shardwise.checkpoint.io.device import slabs_for, staging_bytes
from shardwise.checkpoint.io.write import DataFile
from shardwise.comm.agreement import Agreement

from ...comm.threaded_world import ThreadedWorld

ARGS = ("save path", ("p",))
BUDGET = 2 << 20  # two 1 MiB slabs: every state below goes in waves
FULL = torch.arange(700 * 600, dtype=torch.float32).reshape(700, 600)  # 1.6 MiB
LAYOUT = Layout.row_wise((700, 600), [500, 200])


def _state(rank: int, shift: float = 0.0) -> dict:
    block = LAYOUT.blocks_of(rank)[0]
    return {
        "w": ShardedTensor.from_layout(LAYOUT, [FULL[block.slices()] + shift], rank=rank),
        "small": {f"b{i}": torch.full((100 + i,), float(i) + shift) for i in range(20)},
        "big": torch.arange(400_000, dtype=torch.float64) + shift,  # replicated: one rank writes it
        "step": 3,
    }


def _save(path: Path, shift: float, staging: dict[int, Staging]) -> list:
    world = ThreadedWorld(2)
    return world.run(
        lambda comm: save_state(
            _state(comm.rank, shift), path, Agreement(comm, ARGS), staging=staging.get(comm.rank)
        )
    )


def _stock(path: Path) -> dict:
    target = {
        "w": torch.zeros(700, 600),
        "small": {f"b{i}": torch.zeros(100 + i) for i in range(20)},
        "big": torch.zeros(400_000, dtype=torch.float64),
        "step": 0,
    }
    dcp.load(target, checkpoint_id=path, no_dist=True)
    return target


def _chunks(path: Path) -> dict:
    manifest = Manifest.read(path)
    return {k: [(c.crcs, c.tile, c.payload) for c in v.chunks] for k, v in manifest.tensors.items()}


def test_a_staged_save_is_the_direct_save_byte_for_byte(tmp_path: Path) -> None:
    calls: list[int] = []
    staged = {r: Staging(BUDGET, host=True, on_staged=lambda r=r: calls.append(r)) for r in (0, 1)}
    assert _save(tmp_path / "staged", 0.0, staged) == [None, None]
    pool = slabs_for("save", staging_bytes(BUDGET))
    assert pool.allocated == BUDGET and pool.free == pool.count  # within the budget, all back
    assert _save(tmp_path / "direct", 0.0, {}) == [None, None]
    assert sorted(calls) == [0, 1]  # once per rank
    got = _stock(tmp_path / "staged")
    assert torch.equal(got["w"], FULL) and got["step"] == 3
    assert torch.equal(got["big"], torch.arange(400_000, dtype=torch.float64))
    assert all(
        torch.equal(got["small"][f"b{i}"], torch.full((100 + i,), float(i))) for i in range(20)
    )
    assert _chunks(tmp_path / "staged") == _chunks(tmp_path / "direct")


def test_a_failure_on_one_rank_mid_staging_fails_every_rank_and_keeps_the_last_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "ck"
    assert _save(path, 0.0, {}) == [None, None]
    before = {p.name: p.read_bytes() for p in path.iterdir() if p.is_file()}

    class FailingFile(DataFile):
        writes = 0

        def __init__(self, folder, name) -> None:
            super().__init__(folder, name)
            if name.startswith("__1_"):  # rank 1's file fails at its second slab's write
                write_at = self._sink.write_at

                def failing(buffers, at) -> None:
                    FailingFile.writes += 1
                    if FailingFile.writes == 2:
                        raise OSError("disk full on rank 1")
                    write_at(buffers, at)

                self._sink.write_at = failing  # type: ignore[method-assign]

    monkeypatch.setattr(rank_file, "DataFile", FailingFile)
    calls: list[int] = []
    staged = {r: Staging(BUDGET, host=True, on_staged=lambda r=r: calls.append(r)) for r in (0, 1)}
    results = _save(path, 1.0, staged)
    assert FailingFile.writes == 2
    assert all(isinstance(e, Exception) and "disk full on rank 1" in str(e) for e in results)
    assert sorted(calls) == [0, 1]  # the state is released on every rank
    after = {p.name: p.read_bytes() for p in path.iterdir() if p.is_file()}
    assert {k: after.get(k) for k in before} == before  # nothing committed earlier changed
    new = sorted(set(after) - set(before))  # rank 0's finished file, collected by the next save;
    assert len(new) == 1 and new[0].startswith("__0_")  # rank 1's half-written one is gone
    assert torch.equal(_stock(path)["w"], FULL)
    pool = slabs_for("save", staging_bytes(BUDGET))
    assert pool.free == pool.count


def test_a_large_share_is_spread_over_several_files_that_every_reader_reads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past `SPLIT_BYTES` a rank writes `file_count` files at once (one writer per file
    is what file systems allow); the checkpoint stays one DCP checkpoint."""
    from shardwise.checkpoint.engine import plan as planning

    assert [planning.file_count(n) for n in (0, 511 << 20, 512 << 20, 1 << 30, 64 << 30)] == [
        1,
        1,
        2,
        4,
        8,
    ]
    monkeypatch.setattr(planning, "SPLIT_BYTES", 1 << 20)
    monkeypatch.setattr(planning, "FILE_BYTES", 1 << 20)
    staged = {r: Staging(BUDGET, host=True) for r in (0, 1)}
    assert _save(tmp_path / "ck", 0.0, staged) == [None, None]
    manifest = Manifest.read(tmp_path / "ck")
    assert manifest.index is not None
    index = manifest.index.file
    names = sorted(p.name.split(".")[0] for p in (tmp_path / "ck").glob("*.distcp"))
    names.remove(index.split(".")[0])
    assert index.split(".")[0] == "__0_1"  # rank 0's next data file: named before any is written
    # rank 0 writes its 1.2 MB of `w`: 1 file (1.2 MB // 1 MiB); rank 1, holding the
    # smaller shard (0.5 MB), is given every replicated value by their owners (the
    # 3.2 MB `big` and the small ones): 3 files, each record in the shortest one
    assert names == ["__0_0", "__1_0", "__1_1", "__1_2"]
    got = _stock(tmp_path / "ck")
    assert torch.equal(got["w"], FULL) and got["step"] == 3
    assert torch.equal(got["big"], torch.arange(400_000, dtype=torch.float64))
    assert all(
        torch.equal(got["small"][f"b{i}"], torch.full((100 + i,), float(i))) for i in range(20)
    )
    files = {c.file.split(".")[0] for v in manifest.tensors.values() for c in v.chunks}
    assert files == set(names)
