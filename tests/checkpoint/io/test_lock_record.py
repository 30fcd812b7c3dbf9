"""The lock record of a save lease (`io.lease`): what it says about its holder, its
names, and reading it when it is damaged, oversized or a link."""

from __future__ import annotations

import json
import os

import pytest

import shardwise.checkpoint as swc
from shardwise.checkpoint.io.lease import (
    HOST,
    LOCK,
    LOCK_NAME,
    Holder,
    lock_name,
    process_alive,
    read_record,
)
from shardwise.storage import open_folder

from .leases import crafted_locks, record_text

HOLDER = Holder("0123456789abcdef", "elsewhere", 4242, "pid:[1]", "77", 1.0, 2.0)


def test_a_holder_round_trips_through_its_record():
    data = HOLDER.to_bytes()
    assert json.loads(data) == {
        "format": "shardwise-lease/1",
        "save_id": "0123456789abcdef",
        "host": "elsewhere",
        "pid": 4242,
        "pid_namespace": "pid:[1]",
        "process_start": "77",
        "since": 1.0,
        "heartbeat": 2.0,
    }
    assert Holder.parse(data) == HOLDER


@pytest.mark.parametrize(
    "data",
    [
        b"\x00garbage",
        b"",
        b"null",
        b"[1, 2]",
        json.dumps({k: v for k, v in json.loads(HOLDER.to_bytes()).items() if k != "pid"}).encode(),
        HOLDER.to_bytes().replace(b"4242", b'"x"'),
        HOLDER.to_bytes().replace(b"2.0", b"null"),
        HOLDER.to_bytes()[:-20],
    ],
    ids=["garbage", "empty", "null", "list", "no-pid", "pid-string", "heartbeat-null", "cut"],
)
def test_a_damaged_record_names_no_holder(data):
    assert Holder.parse(data) is None


CRAFTED = crafted_locks()


def test_the_crafted_records_differ_from_a_sound_one_in_one_field_only():
    holder = Holder.parse(record_text())
    assert holder is not None and (holder.host, holder.pid) == ("elsewhere", 4242)
    assert Holder.parse(record_text(since="0", heartbeat="253402300799")) is not None  # 9999


@pytest.mark.parametrize("data", list(CRAFTED.values()), ids=list(CRAFTED))
def test_a_crafted_record_names_no_holder_and_never_raises(data):
    """Huge or non-finite numbers, deep nesting, wrong types, other encodings: one
    answer, "unreadable" (None), never an OverflowError, RecursionError or ValueError."""
    assert Holder.parse(data) is None


def test_a_holder_built_by_hand_with_an_impossible_start_is_still_described():
    for since in (1e20, float("nan")):
        text = Holder("x" * 16, "h", 1, "", "", since, 2.0).describe()
        assert text.startswith(f"save xxxxxxxxxxxx of pid 1 on host h, since {since!r} (")


def test_lock_names():
    assert (lock_name(None), lock_name(3)) == (LOCK, "__3.shardwise.lock")
    found = [
        LOCK_NAME.fullmatch(n)
        for n in [LOCK, "__3.shardwise.lock", "__x.shardwise.lock", "a.shardwise.lock"]
    ]
    assert [m.group(1) if m else "none" for m in found] == [None, "3", "none", "none"]


def test_read_record_reads_a_plain_record(tmp_path):
    (tmp_path / LOCK).write_bytes(HOLDER.to_bytes())
    assert read_record(open_folder(tmp_path), LOCK) == HOLDER.to_bytes()
    with pytest.raises(FileNotFoundError):
        read_record(open_folder(tmp_path), lock_name(0))


def test_an_oversized_record_is_read_only_64_kib_far_and_names_no_holder(tmp_path):
    doc = json.loads(HOLDER.to_bytes())
    doc["host"] = "h" * (1 << 20)  # well-formed JSON, 1 MiB of it
    (tmp_path / LOCK).write_bytes(json.dumps(doc).encode())
    data = read_record(open_folder(tmp_path), LOCK)
    assert len(data) == 1 << 16
    assert Holder.parse(data) is None


def test_a_link_is_never_read_through(tmp_path):
    (tmp_path / "elsewhere").write_bytes(HOLDER.to_bytes())
    os.symlink(tmp_path / "elsewhere", tmp_path / LOCK)
    with pytest.raises(swc.CorruptCheckpointError, match="is a symbolic link"):
        read_record(open_folder(tmp_path), LOCK)


def test_this_process_is_alive_and_a_reused_pid_is_not():
    me = Holder.of_this_process("s")
    assert (me.host, me.pid, me.save_id, me.since) == (HOST, os.getpid(), "s", me.heartbeat)
    assert process_alive(os.getpid(), me.process_start)
    if me.process_start:  # known from /proc: another start time is another process
        assert not process_alive(os.getpid(), str(int(me.process_start) + 1))


def test_describe_names_the_save_pid_host_and_start():
    text = HOLDER.describe()
    assert text.startswith(
        "save 0123456789ab of pid 4242 on host elsewhere, since 1970-01-01T00:00:01+00:00 "
        "(last heartbeat "
    )
