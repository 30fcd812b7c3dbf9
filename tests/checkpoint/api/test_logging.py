"""What a save or load did, on the `shardwise` logger, and `progress=` callbacks (issue 40, 4).

Rank 0 logs one INFO line per save and load (path, time, what it wrote or read); every
rank logs its detail, with the time of each phase, at DEBUG; nothing is printed by
default. `progress(n)` adds up to exactly the bytes a rank wrote or read.
"""

from __future__ import annotations

import logging
import subprocess
import sys
import textwrap
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

import shardwise.checkpoint as swc
from shardwise import Layout, ShardedTensor
from shardwise.testing import run_ranks, shard_of

pytestmark = pytest.mark.spawned

SHAPE = (40, 6)


def _state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(3)
    return {"a": torch.randn(SHAPE, generator=g), "b": torch.arange(10, dtype=torch.int64)}


def _nbytes(state: dict[str, Any]) -> int:
    return sum(t.numel() * t.element_size() for t in state.values())


class _Records(logging.Handler):
    """The `shardwise` logger's records, thread-safe (async saves log from their thread)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def at(self, level: int) -> list[str]:
        return [r.getMessage() for r in self.records if r.levelno == level]


@pytest.fixture
def records():
    logger = logging.getLogger("shardwise")
    handler, before = _Records(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    yield handler
    logger.removeHandler(handler)
    logger.setLevel(before)


def test_save_and_load_log_one_info_line_each_and_progress_adds_up(tmp_path, records):
    state, written = _state(), []
    info = swc.save(state, tmp_path / "c", progress=written.append)
    assert info.bytes_written == _nbytes(state) == sum(written)
    assert sorted(written) == sorted(t.numel() * t.element_size() for t in state.values())
    (saved,) = records.at(logging.INFO)
    assert saved.startswith(f"saved {tmp_path / 'c'} in ")
    assert "on 1 ranks; rank 0 wrote 2 tensors and 0 objects, 0.0 MiB in 1 files" in saved
    assert "(plan made; describe " in saved and ", commit " in saved
    (detail,) = records.at(logging.DEBUG)
    assert detail.startswith(f"rank 0 saved 2 tensor and 0 object records, {_nbytes(state)} bytes")

    records.records.clear()
    target, read = {k: torch.zeros_like(v) for k, v in state.items()}, []
    lock = threading.Lock()

    def count(n: int) -> None:
        with lock:
            read.append(n)

    loaded = swc.load(target, tmp_path / "c", progress=count)
    assert all(torch.equal(target[k], state[k]) for k in state)
    assert sum(read) == loaded.bytes_read > 0
    (line,) = records.at(logging.INFO)
    assert line.startswith(f"loaded {tmp_path / 'c'} in ")
    assert line.endswith("on 1 ranks; rank 0 read 0.0 MiB (saved by 1 ranks: 2 tensors, 0 objects)")
    (detail,) = records.at(logging.DEBUG)
    assert detail.startswith(f"rank 0 loaded 2 values from {tmp_path / 'c'}: read ")
    assert "(plan " in detail and "broadcast and verdict " in detail


def test_a_repeated_save_logs_its_reused_plan(tmp_path, records):
    # a structure no other save of this process had: plans are kept per structure
    state = {f"{k}_{tmp_path.name}": v for k, v in _state().items()}
    swc.save(state, tmp_path / "c")
    swc.save(state, tmp_path / "c", overwrite=True)
    first, second = records.at(logging.INFO)
    assert "(plan made;" in first and "(plan reused;" in second


def test_async_save_reports_progress_from_its_thread(tmp_path, records):
    state, written = _state(), []
    future = swc.async_save(state, tmp_path / "c", progress=written.append)
    info = future.result(timeout=60)
    assert sum(written) == info.bytes_written == _nbytes(state)
    (saved,) = records.at(logging.INFO)
    assert saved.startswith(f"saved {tmp_path / 'c'} in ")


def test_objects_count_their_pickled_bytes(tmp_path, records):
    written: list[int] = []
    info = swc.save({"t": torch.ones(4), "step": 7}, tmp_path / "c", progress=written.append)
    assert len(written) == 2 and sum(written) == info.bytes_written
    assert 16 in written  # the tensor's bytes; the rest is the object's pickle
    (saved,) = records.at(logging.INFO)
    assert "rank 0 wrote 1 tensors and 1 objects" in saved


def test_nothing_is_printed_by_default(tmp_path):
    """A program that never configures logging sees no output from a save and a load."""
    code = textwrap.dedent(
        f"""
        import torch
        import shardwise.checkpoint as swc
        state = {{"w": torch.ones(3, 3)}}
        swc.save(state, {str(tmp_path / "c")!r})
        swc.load(state, {str(tmp_path / "c")!r})
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert (proc.stdout, proc.stderr) == ("", "")


def _ranks_body(rank: int, world: int, root: str) -> tuple[int, int, list[str], int, int]:
    handler = _Records()
    logger = logging.getLogger("shardwise")
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    full = torch.arange(96 * 4, dtype=torch.float32).reshape(96, 4)
    layout = Layout.row_wise((96, 4), [50, 46])
    st = ShardedTensor.from_layout(layout, shard_of(full, layout, rank))
    written: list[int] = []
    info = swc.save({"w": st}, root, progress=written.append)
    other = Layout.row_wise((96, 4), [20, 76])
    target = ShardedTensor.from_layout(other, shard_of(torch.zeros(96, 4), other, rank))
    read: list[int] = []
    loaded = swc.load({"w": target}, root, progress=read.append)
    assert torch.equal(target.full_tensor(), full)
    return (
        sum(written) - info.bytes_written,
        sum(read) - loaded.bytes_read,
        handler.at(logging.INFO),
        info.bytes_written,
        loaded.bytes_read,
    )


def test_on_two_ranks_rank_0_alone_logs_info_and_each_counts_its_own_bytes(tmp_path):
    out = run_ranks(_ranks_body, 2, str(tmp_path / "c"), timeout=120)
    for rank, (wrote_off, read_off, _info, written, read) in enumerate(out):
        assert (wrote_off, read_off) == (0, 0)
        assert written == (50 if rank == 0 else 46) * 4 * 4  # its own rows, float32
        # rows 0..19 (rank 0) and 20..95 (rank 1) of stored rows [0, 50) and [50, 96): a
        # verified read takes whole checksum tiles, and each of these chunks is one tile
        assert read == (50 if rank == 0 else 96) * 4 * 4
    assert len(out[0][2]) == 2 and out[1][2] == []
    saved, loaded = out[0][2]
    assert saved.startswith("saved ") and "on 2 ranks; rank 0 wrote 1 tensors" in saved
    assert loaded.startswith("loaded ") and "rank 0 read 0.0 MiB (saved by 2 ranks" in loaded


def test_manager_passes_progress_through(tmp_path):
    manager = swc.CheckpointManager(tmp_path / "run")
    written: list[int] = []
    manager.save(1, _state(), progress=written.append)
    read: list[int] = []
    target = {k: torch.zeros_like(v) for k, v in _state().items()}
    assert manager.restore(target, progress=read.append) == 1
    assert sum(written) == _nbytes(_state()) and sum(read) > 0
    assert torch.equal(target["a"], _state()["a"])


def test_info_is_visible_through_basic_config(tmp_path):
    """The documented way to see it: `logging.basicConfig(level=logging.INFO)`."""
    code = textwrap.dedent(
        f"""
        import logging, torch
        import shardwise.checkpoint as swc
        logging.basicConfig(level=logging.INFO, format="%(name)s %(levelname)s %(message)s")
        swc.save({{"w": torch.ones(3, 3)}}, {str(tmp_path / "c")!r})
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"shardwise INFO saved {tmp_path / 'c'} in ")


def test_path_of_the_info_line_is_the_checkpoint_path(tmp_path: Path, records):
    swc.save({"w": torch.ones(2)}, str(tmp_path / "x"))
    (saved,) = records.at(logging.INFO)
    assert saved.split(" in ")[0] == f"saved {tmp_path / 'x'}"
