"""The save lease (`lease`) in one process: exclusive, named in the
refusal, waited for when asked, broken when stale, confirmed before a commit, and
never taken for a checkpoint record. Two real processes: tests/reliability/test_concurrent_saves.py.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException

import shardwise.checkpoint as swc
from shardwise.checkpoint.io import lease as lease_module
from shardwise.checkpoint.io.commit import commit, holds_checkpoint, in_the_way
from shardwise.checkpoint.io.lease import LOCK, Holder, live_scopes, lock_name
from shardwise.errors import CheckpointBusyError, IncompleteCheckpointError, ShardwiseError
from shardwise.storage import open_folder

from .leases import crafted_locks, new_lease, plant_lock

warnings.filterwarnings("ignore", message="torch.distributed is disabled")


def _dead_pid() -> int:
    """A pid no process of this host has (none is started: this module spawns nothing)."""
    top = int(Path("/proc/sys/kernel/pid_max").read_text()) if Path("/proc").exists() else 99999
    return next(p for p in range(top - 1, 1, -1) if not _exists(p))


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def test_a_second_lease_fails_fast_naming_the_holder(tmp_path):
    folder = tmp_path / "ckpt"
    first = new_lease(folder).acquire()
    try:
        start = time.monotonic()
        with pytest.raises(CheckpointBusyError) as e:
            new_lease(folder).acquire()
        assert time.monotonic() - start < 1.0
        message = str(e.value)
        assert f"pid {os.getpid()}" in message
        assert f"host {lease_module.HOST}" in message
        assert "since 20" in message and str(folder / LOCK) in message and "wait=" in message
        assert isinstance(e.value, OSError) and isinstance(e.value, ShardwiseError)
        record = json.loads((folder / LOCK).read_text())
        assert record["save_id"] == first.save_id and record["pid"] == os.getpid()
    finally:
        first.release()
    assert not (folder / LOCK).exists()
    new_lease(folder).acquire().release()  # free again


def test_wait_seconds_gives_up_after_about_that_long(tmp_path):
    holder = new_lease(tmp_path).acquire()
    try:
        start = time.monotonic()
        with pytest.raises(CheckpointBusyError, match="still held after waiting 0.3 s"):
            new_lease(tmp_path).acquire(wait=0.3)
        assert 0.3 <= time.monotonic() - start < 1.5
    finally:
        holder.release()


def test_wait_true_takes_the_lease_once_it_is_released(tmp_path):
    holder = new_lease(tmp_path).acquire()
    timer = threading.Timer(0.3, holder.release)
    timer.start()
    start = time.monotonic()
    second = new_lease(tmp_path).acquire(wait=True)
    assert time.monotonic() - start >= 0.25
    assert json.loads((tmp_path / LOCK).read_text())["save_id"] == second.save_id
    second.release()
    timer.join()


def test_a_dead_holder_on_this_host_is_broken_with_a_warning(tmp_path):
    pid = _dead_pid()
    plant_lock(tmp_path, host=lease_module.HOST, pid_namespace=lease_module.PID_NAMESPACE, pid=pid)
    with pytest.warns(UserWarning, match=rf"breaking the stale save lease .*pid {pid} .*is gone"):
        taken = new_lease(tmp_path).acquire()
    assert json.loads((tmp_path / LOCK).read_text())["save_id"] == taken.save_id
    taken.release()


def test_a_reused_pid_is_not_the_holder(tmp_path):
    # a live pid, but another process start time: the holder is gone
    plant_lock(
        tmp_path,
        host=lease_module.HOST,
        pid_namespace=lease_module.PID_NAMESPACE,
        pid=os.getppid(),
        process_start="1",
    )
    if not Path("/proc/self/stat").exists():
        pytest.skip("no /proc: start times are not known")
    with pytest.warns(UserWarning, match="is gone"):
        new_lease(tmp_path).acquire().release()


def test_a_lease_this_process_no_longer_holds_is_broken(tmp_path):
    plant_lock(
        tmp_path, host=lease_module.HOST, pid_namespace=lease_module.PID_NAMESPACE, pid=os.getpid()
    )
    with pytest.warns(UserWarning, match="a save of this process left it"):
        new_lease(tmp_path).acquire().release()


def test_a_holder_elsewhere_is_live_until_its_heartbeat_is_old(tmp_path):
    plant_lock(tmp_path, heartbeat=time.time() - 30)  # another host: its pid says nothing here
    with pytest.raises(CheckpointBusyError, match="pid 4242 on host elsewhere"):
        new_lease(tmp_path).acquire()
    plant_lock(tmp_path, heartbeat=time.time() - lease_module.STALE_AFTER_S - 5)
    with pytest.warns(UserWarning, match=r"heartbeat is \d+ s old"):
        new_lease(tmp_path).acquire().release()


def test_an_unreadable_lock_record_is_busy_and_names_the_fix(tmp_path):
    (tmp_path / LOCK).write_bytes(b"\x00garbage")
    with pytest.raises(CheckpointBusyError, match=rf"unreadable.*remove {tmp_path / LOCK}"):
        new_lease(tmp_path).acquire()
    assert (tmp_path / LOCK).read_bytes() == b"\x00garbage"


def test_a_broken_lease_commits_nothing(tmp_path):
    swc.save({"w": torch.ones(2)}, tmp_path)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    held = new_lease(tmp_path).acquire()
    (tmp_path / LOCK).write_bytes(plant_lock(tmp_path, save_id="someone-else"))  # taken over
    with pytest.raises(CheckpointBusyError, match="was broken while this save ran"):
        commit(tmp_path, b"new metadata", b"{}", set(), lease=held)
    held.release()  # not ours any more: left alone
    assert json.loads((tmp_path / LOCK).read_text())["save_id"] == "someone-else"
    (tmp_path / LOCK).unlink()
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before


def test_a_refused_lease_on_a_new_path_leaves_no_folder(tmp_path):
    held = new_lease(tmp_path / "a").acquire()
    held.release()
    assert not (tmp_path / "a").exists()  # the lease made it, and nothing else came


def test_the_lock_record_is_no_checkpoint_record(tmp_path):
    folder = tmp_path / "ckpt"
    with new_lease(folder).acquire(), new_lease(folder, 0).acquire():
        assert sorted(p.name for p in folder.iterdir()) == sorted([LOCK, lock_name(0)])
        assert not holds_checkpoint(folder) and in_the_way(folder) is None
        # a save started and not committed (SPEC 3): incomplete, naming what is there
        with pytest.raises(IncompleteCheckpointError, match="started but never committed"):
            swc.Reader(folder).read_metadata()
    state = {"w": torch.arange(4.0)}
    swc.save(state, folder)
    (folder / LOCK).write_bytes(plant_lock(folder))  # a save in flight beside a committed one
    out = {"w": torch.zeros(4)}
    dcp.load(out, storage_reader=FileSystemReader(folder))  # stock readers never look at it
    assert torch.equal(out["w"], state["w"])
    out = {"w": torch.zeros(4)}
    swc.load(out, folder)
    assert torch.equal(out["w"], state["w"]) and swc.verify(folder, raise_on_error=False) == []


def test_per_rank_scopes_have_a_lease_each(tmp_path):
    a, b = new_lease(tmp_path, 0).acquire(), new_lease(tmp_path, 1).acquire()
    with pytest.raises(CheckpointBusyError):
        new_lease(tmp_path, 0).acquire()
    assert live_scopes(open_folder(tmp_path), [LOCK, lock_name(0), lock_name(1)], a) == {1}
    a.release()
    b.release()


def test_a_busy_path_fails_swc_save_and_the_writer_before_any_data(tmp_path):
    swc.save({"w": torch.ones(3)}, tmp_path)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    plant_lock(tmp_path)
    with pytest.raises(CheckpointBusyError, match="pid 4242 on host elsewhere"):
        swc.save({"w": torch.zeros(3)}, tmp_path, overwrite=True)
    with pytest.raises(CheckpointBusyError, match="pid 4242 on host elsewhere"):
        swc.async_save({"w": torch.zeros(3)}, tmp_path, overwrite=True).result()
    with pytest.raises(CheckpointException) as e:  # DCP wraps what a storage writer raises
        dcp.save({"w": torch.zeros(3)}, storage_writer=swc.Writer(tmp_path))
    inner = e.value.failures[0]
    inner = inner[0] if isinstance(inner, tuple) else inner
    assert isinstance(inner, CheckpointBusyError) and "pid 4242" in str(inner)
    (tmp_path / LOCK).unlink()
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before


def test_save_and_the_writer_wait_for_the_lease_when_asked(tmp_path):
    holder = new_lease(tmp_path).acquire()
    threading.Timer(0.3, holder.release).start()
    swc.save({"w": torch.full((3,), 2.0)}, tmp_path, wait=10)
    holder = new_lease(tmp_path).acquire()
    threading.Timer(0.3, holder.release).start()
    dcp.save({"w": torch.full((3,), 3.0)}, storage_writer=swc.Writer(tmp_path, wait=True))
    out = {"w": torch.zeros(3)}
    swc.load(out, tmp_path)
    assert torch.equal(out["w"], torch.full((3,), 3.0)) and not (tmp_path / LOCK).exists()


def test_overwrite_false_looks_again_once_it_holds_the_lease(tmp_path):
    holder = new_lease(tmp_path).acquire()

    def commit_meanwhile() -> None:
        # another writer's checkpoint lands while the lease is held, then the lease is
        # given back (saved aside and copied in: a save here would wait for the lease,
        # and after a release the waiting save could take it first)
        swc.save({"w": torch.ones(2)}, tmp_path.parent / "aside")
        shutil.copytree(tmp_path.parent / "aside", tmp_path, dirs_exist_ok=True)
        holder.release()

    threading.Timer(0.3, commit_meanwhile).start()
    with pytest.raises(FileExistsError, match="pass overwrite=True"):
        swc.save({"w": torch.zeros(2)}, tmp_path, wait=10)
    out = {"w": torch.zeros(2)}
    swc.load(out, tmp_path)
    assert torch.equal(out["w"], torch.ones(2))


def test_a_failed_save_gives_the_lease_back(tmp_path, monkeypatch):
    from shardwise.checkpoint.engine import records as joining

    def fails(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(joining, "commit", fails)
    with pytest.raises(OSError, match="disk full"):
        swc.save({"w": torch.ones(2)}, tmp_path / "new")
    assert (tmp_path / "new").exists() and not (tmp_path / "new" / LOCK).exists()
    monkeypatch.undo()
    swc.save({"w": torch.ones(2)}, tmp_path / "new")  # no stale lease in the way, no warning
    assert Holder.of_this_process("x").pid == os.getpid()
    # a writer whose save never reached `finish` gives it back when freed
    writer = swc.Writer(tmp_path / "w")
    writer.set_up_storage_writer(True)
    writer._take_lease()
    assert (tmp_path / "w" / LOCK).exists()
    del writer
    assert not (tmp_path / "w").exists()


def test_memory_urls_take_the_lease_exclusively(memory_root):
    url = f"{memory_root}/ckpt"
    held = new_lease(url).acquire()
    with pytest.raises(CheckpointBusyError):
        new_lease(url).acquire()
    held.release()
    swc.save({"w": torch.ones(2)}, url)
    assert LOCK not in open_folder(url).names()


CRAFTED = crafted_locks()


def _plant(where: str, data: bytes) -> str:
    """`data` as the lock record of the global records at `where`; its name as errors give it."""
    folder = open_folder(where)
    folder.make()
    folder.write_durably(LOCK, data)
    return folder.where(LOCK)


@pytest.mark.parametrize("wait", [False, 0.2], ids=["no-wait", "wait-0.2"])
@pytest.mark.parametrize("case", list(CRAFTED))
def test_a_crafted_lock_is_held_and_named_by_every_save(where, case, wait):
    """Whatever a lock record holds, a save sees an unreadable record: busy, the file
    to remove named, the record left alone (no bare OverflowError/RecursionError)."""
    name = _plant(where, CRAFTED[case])
    with pytest.raises(CheckpointBusyError) as e:
        swc.save({"w": torch.ones(2)}, where, wait=wait)
    message = str(e.value)
    assert "a holder whose lock record is unreadable (b" in message
    assert message.endswith(f"if that save is gone for good, remove {name}")
    assert ("still held after waiting 0.2 s" in message) == bool(wait)
    assert open_folder(where).read(LOCK) == CRAFTED[case]


@pytest.mark.parametrize("case", list(CRAFTED))
def test_a_waiting_save_breaks_a_crafted_lock_after_its_quiet_period(where, case, monkeypatch):
    monkeypatch.setattr(lease_module, "STALE_AFTER_S", 0.3)
    _plant(where, CRAFTED[case])
    start = time.monotonic()
    with pytest.warns(UserWarning, match="stayed unreadable for 0 s while this save waited"):
        swc.save({"w": torch.full((2,), 7.0)}, where, wait=20)
    assert 0.3 <= time.monotonic() - start < 20
    out = {"w": torch.zeros(2)}
    swc.load(out, where)
    assert torch.equal(out["w"], torch.full((2,), 7.0))
    assert LOCK not in open_folder(where).names()


def test_wait_true_breaks_a_stale_lock_with_an_impossible_start(where, monkeypatch):
    """A stale lock whose `since` no clock shows (1e20) was never broken: describing
    it raised. Now unreadable, it goes once a `wait=True` save saw it unchanged."""
    monkeypatch.setattr(lease_module, "STALE_AFTER_S", 0.3)
    _plant(where, CRAFTED["stale-since-1e20"])
    got: list[object] = []

    def take() -> None:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                got.append(new_lease(where).acquire(wait=True))
            except BaseException as e:  # noqa: BLE001 - reported by the assertion below
                got.append(e)
        got.extend(str(w.message) for w in caught)

    taker = threading.Thread(target=take, daemon=True)  # a hang fails, it does not block
    taker.start()
    taker.join(timeout=20)
    assert got and isinstance(got[0], lease_module.Lease), got
    assert any("stayed unreadable for 0 s" in str(m) for m in got[1:]), got
    got[0].release()
    assert LOCK not in open_folder(where).names()


@pytest.mark.parametrize("case", ["pid-1e400", "nested-40000", "since-1e20", "since-NaN"])
def test_reshard_to_a_path_with_a_crafted_lock_names_the_lock(where, tmp_path, case, capsys):
    from shardwise.cli import main

    source = tmp_path / "source"
    swc.save({"w": torch.arange(6.0)}, source)
    name = _plant(where, CRAFTED[case])
    assert main(["reshard", str(source), where, "--world-size", "2"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("shardwise reshard: error: ")
    assert "lock record is unreadable" in err[0] and f"remove {name}" in err[0]
    assert open_folder(where).read(LOCK) == CRAFTED[case]
