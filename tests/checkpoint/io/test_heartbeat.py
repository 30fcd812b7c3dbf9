"""The heartbeat of a held lease (`io.lease`): the lock record's `io.lease` rewritten
while held, never after the lease is given back, never over another save's record."""

from __future__ import annotations

import json
import time
from dataclasses import asdict

from shardwise.checkpoint.io import lease as lease_module
from shardwise.checkpoint.io.lease import LOCK, Heartbeat, Holder
from shardwise.storage import open_folder

from .leases import new_lease


def test_the_heartbeat_is_rewritten_while_held(tmp_path, monkeypatch):
    monkeypatch.setattr(lease_module, "HEARTBEAT_S", 0.05)
    held = new_lease(tmp_path).acquire()
    try:
        first = json.loads((tmp_path / LOCK).read_text())
        deadline = time.monotonic() + 5
        while json.loads((tmp_path / LOCK).read_text())["heartbeat"] == first["heartbeat"]:
            assert time.monotonic() < deadline, "no heartbeat"
            time.sleep(0.02)
        again = json.loads((tmp_path / LOCK).read_text())
        assert again["save_id"] == first["save_id"] and again["since"] == first["since"]
    finally:
        held.release()
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def _holder(save_id: str, heartbeat: float = 1.0) -> Holder:
    return Holder(save_id, "elsewhere", 4242, "", "", 1.0, heartbeat)


def test_a_beat_rewrites_only_the_heartbeat(tmp_path):
    (tmp_path / LOCK).write_bytes(_holder("mine").to_bytes())
    Heartbeat(open_folder(tmp_path), LOCK, "mine").beat()
    after = Holder.parse((tmp_path / LOCK).read_bytes())
    assert after is not None and after.heartbeat > 1.0
    assert after == Holder(**{**asdict(_holder("mine")), "heartbeat": after.heartbeat})


def test_a_beat_never_rewrites_another_saves_record(tmp_path):
    theirs = _holder("theirs").to_bytes()
    (tmp_path / LOCK).write_bytes(theirs)
    Heartbeat(open_folder(tmp_path), LOCK, "mine").beat()
    assert (tmp_path / LOCK).read_bytes() == theirs


def test_a_beat_never_brings_a_removed_record_back(tmp_path):
    Heartbeat(open_folder(tmp_path), LOCK, "mine").beat()
    assert not (tmp_path / LOCK).exists()


def test_a_stopped_heartbeat_writes_nothing(tmp_path):
    before = _holder("mine").to_bytes()
    (tmp_path / LOCK).write_bytes(before)
    heartbeat = Heartbeat(open_folder(tmp_path), LOCK, "mine")
    with heartbeat.lock:
        heartbeat.stop()
    heartbeat.beat()
    assert (tmp_path / LOCK).read_bytes() == before


def test_beats_stop_after_release(tmp_path):
    held = new_lease(tmp_path).acquire()
    heartbeat = held._heartbeat
    held.release()
    assert not (tmp_path / LOCK).exists()
    (tmp_path / LOCK).write_bytes(_holder(held.save_id).to_bytes())  # as if still ours
    heartbeat.beat()  # what the thread would do next: nothing, the lease is given back
    assert Holder.parse((tmp_path / LOCK).read_bytes()) == _holder(held.save_id)
