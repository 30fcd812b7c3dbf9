"""Two real processes saving to one path, one of them held mid-write by a pause point
(`checkpoint/faults.py`): the other is refused naming the holder, or waits and wins
when asked; the last committed checkpoint loads at every moment; a killed holder's
lease is broken with a warning; and no data file the committed records name is
ever missing afterwards."""

from __future__ import annotations

import multiprocessing
import os
import signal
import socket
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException

import shardwise.checkpoint as swc
from shardwise.checkpoint.io.commit import referenced_files
from shardwise.checkpoint.io.lease import LOCK
from shardwise.errors import CheckpointBusyError

pytestmark = pytest.mark.spawned

warnings.filterwarnings("ignore", message="torch.distributed is disabled")

VICTIM = b"the user's notes\n" * 10
ENTRY_TABLES = {".metadata", "shardwise.json", ".shardwise"}


def _state(seed: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(64, 16, generator=g), "b": torch.randn(16, generator=g), "step": seed}


def _loads(path: str, seed: int, storage_options: dict | None = None) -> bool:
    """The folder loads `seed`'s state, through shardwise and (locally) stock DCP."""
    want = _state(seed)
    out = {"w": torch.zeros(64, 16), "b": torch.zeros(16), "step": -1}
    swc.load(out, path, storage_options=storage_options)
    ok = (
        out["step"] == seed
        and torch.equal(out["w"], want["w"])
        and torch.equal(out["b"], want["b"])
    )
    if storage_options is None:
        stock = {"w": torch.zeros(64, 16), "b": torch.zeros(16), "step": -1}
        dcp.load(stock, storage_reader=FileSystemReader(path))
        ok = ok and torch.equal(stock["w"], want["w"]) and stock["step"] == seed
    return ok


def _held_save(path: str, pause_dir: str, seed: int, storage_options: dict | None) -> None:
    """Child process: save `seed` to `path`, pausing mid-write until `pause_dir/go`."""
    warnings.filterwarnings("ignore")
    os.environ["SHARDWISE_PAUSEPOINT"] = "mid-data"
    os.environ["SHARDWISE_PAUSE_DIR"] = pause_dir
    swc.save(_state(seed), path, overwrite=True, storage_options=storage_options)


def _start_holder(
    path: str, tmp: Path, seed: int, storage_options: dict | None = None
) -> tuple[multiprocessing.process.BaseProcess, Path]:
    pause = tmp / f"pause-{seed}"
    pause.mkdir()
    proc = multiprocessing.get_context("spawn").Process(
        target=_held_save, args=(path, str(pause), seed, storage_options)
    )
    proc.start()
    deadline = time.monotonic() + 60
    while not (pause / "reached").exists():
        assert proc.is_alive() and time.monotonic() < deadline, "the holder never got mid-write"
        time.sleep(0.02)
    return proc, pause


def _committed_files_present(folder: Path) -> bool:
    named = referenced_files(folder, both=True)
    return bool(named) and all((folder / n).is_file() for n in named)


def _previous(tmp: Path) -> Path:
    folder = tmp / "ckpt"
    swc.save(_state(0), folder)
    (folder / "notes.txt").write_bytes(VICTIM)
    return folder


def test_a_second_save_is_refused_naming_the_holder_then_waits_and_wins(tmp_path):
    folder = _previous(tmp_path)
    holder, pause = _start_holder(str(folder), tmp_path, 1)
    try:
        start = time.monotonic()
        with pytest.raises(CheckpointBusyError) as e:
            swc.save(_state(2), folder, overwrite=True)
        assert time.monotonic() - start < 5  # fails fast, never waits
        message = str(e.value)
        assert f"pid {holder.pid} on host {socket.gethostname()}" in message
        assert "since 20" in message and str(folder / LOCK) in message
        with pytest.raises(CheckpointException) as wrapped:  # the same under dcp.save + Writer
            dcp.save(_state(2), storage_writer=swc.Writer(folder))
        assert f"pid {holder.pid}" in str(wrapped.value)
        assert _loads(str(folder), 0)  # the last committed checkpoint, untouched meanwhile

        outcome: list[Any] = []
        waiter = threading.Thread(
            target=lambda: outcome.append(swc.save(_state(2), folder, overwrite=True, wait=60))
        )
        waiter.start()
        time.sleep(0.5)
        assert waiter.is_alive() and not outcome  # waiting for the holder
        (pause / "go").touch()
        holder.join(60)
        assert holder.exitcode == 0
        waiter.join(60)
        assert len(outcome) == 1 and not waiter.is_alive()
    finally:
        (pause / "go").touch()
        holder.join(60)
    assert _loads(str(folder), 2)  # the later commit wins
    assert _committed_files_present(folder)
    # the holder's checkpoint was replaced and collected: nothing but the winner's is left
    names = set(os.listdir(folder))
    assert names == ENTRY_TABLES | {"notes.txt"} | referenced_files(folder), names
    assert (folder / "notes.txt").read_bytes() == VICTIM


def test_a_killed_holder_is_broken_with_a_warning(tmp_path):
    folder = _previous(tmp_path)
    holder, pause = _start_holder(str(folder), tmp_path, 1)
    os.kill(holder.pid, signal.SIGKILL)
    holder.join(30)
    assert (folder / LOCK).exists() and _loads(str(folder), 0)
    with pytest.warns(
        UserWarning, match=rf"breaking the stale save lease .*pid {holder.pid} .*gone"
    ):
        swc.save(_state(2), folder, overwrite=True)
    assert _loads(str(folder), 2) and _committed_files_present(folder)
    # the dead save's unfinished data is collected; the user's file is not
    assert set(os.listdir(folder)) == ENTRY_TABLES | {"notes.txt"} | referenced_files(folder)
    assert (folder / "notes.txt").read_bytes() == VICTIM


def test_the_holder_commits_even_while_refused_saves_come_and_go(tmp_path):
    """Refused saves write nothing: the held save then commits complete data."""
    folder = _previous(tmp_path)
    holder, pause = _start_holder(str(folder), tmp_path, 1)
    try:
        for _ in range(3):
            with pytest.raises(CheckpointBusyError):
                swc.save(_state(2), folder, overwrite=True)
        with pytest.raises(CheckpointBusyError):
            swc.async_save(_state(2), folder, overwrite=True).result(60)
    finally:
        (pause / "go").touch()
        holder.join(60)
    assert holder.exitcode == 0
    assert _loads(str(folder), 1) and _committed_files_present(folder)
    assert set(os.listdir(folder)) == ENTRY_TABLES | {"notes.txt"} | referenced_files(folder)


def test_s3_a_second_save_is_refused_while_one_is_mid_write(tmp_path, s3_bucket):
    url, options = s3_bucket
    url += "/ckpt"
    swc.save(_state(0), url, storage_options=options)
    holder, pause = _start_holder(url, tmp_path, 1, options)
    try:
        with pytest.raises(CheckpointBusyError, match=f"pid {holder.pid} on host"):
            swc.save(_state(2), url, overwrite=True, storage_options=options)
        assert _loads(url, 0, options)
    finally:
        (pause / "go").touch()
        holder.join(60)
    assert holder.exitcode == 0 and _loads(url, 1, options)
    from shardwise.storage import open_folder

    folder = open_folder(url, options)
    folder.create_exclusive("probe", b"1")
    with pytest.raises(FileExistsError):  # S3's conditional PUT (If-None-Match: *)
        folder.create_exclusive("probe", b"2")
    assert folder.read("probe") == b"1" and LOCK not in folder.names()
