"""What a save may delete after its commit (`io.commit.collect` / `replaced_files`): only
data files that a record of the replaced checkpoint names, and leftovers of dead
saves. A record naming anything else decides nothing, and the new records are never
deleted, whatever the old records say."""

from __future__ import annotations

import io
import json
import os
import pickle
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

import shardwise.checkpoint as swc
from shardwise.checkpoint.format.manifest import Manifest, seal
from shardwise.checkpoint.io.commit import (
    RecordNames,
    collect,
    referenced_files,
    replaced_files,
)
from shardwise.checkpoint.io.lease import LOCK
from tests.inline_manifest import inline_manifest

from .leases import crafted_locks

warnings.filterwarnings("ignore", message="torch.distributed is disabled")


VICTIM = b"my notes: not a checkpoint file\n" * 3


def _state(seed: float) -> dict:
    return {"w": torch.full((3,), float(seed)), "e": torch.zeros(0), "step": int(seed)}


def _targets() -> dict:
    return {"w": torch.zeros(3), "e": torch.zeros(0), "step": -1}


def _loads(folder: Path, seed: float) -> bool:
    out, stock = _targets(), _targets()
    swc.load(out, folder)
    dcp.load(stock, storage_reader=FileSystemReader(folder))
    return all(
        o["step"] == int(seed) and torch.equal(o["w"], torch.full((3,), float(seed)))
        for o in (out, stock)
    )


def _name_in_manifest(folder: Path, name: str) -> None:
    """The old manifest (rewritten as version 3: chunks inline) says the 0-element
    tensor `e` lives in `name`, sealed: a crafted record, not a damaged one."""
    inline_manifest(folder)
    doc = json.loads((folder / "shardwise.json").read_text())
    doc["tensors"]["e"]["chunks"][0]["file"] = name
    doc["crc32c"] = 0
    (folder / "shardwise.json").write_text(seal(json.dumps(doc, separators=(",", ":"))))


def _name_in_metadata(folder: Path, name: str) -> None:
    """The old `.metadata` says the 0-element tensor `e` lives in `name` (a trusted
    pickle round trip: only the test writes it)."""
    metadata = pickle.loads((folder / ".metadata").read_bytes())
    for index, info in metadata.storage_data.items():
        if index.fqn == "e":
            info.relative_path = name
    buffer = io.BytesIO()
    pickle.dump(metadata, buffer)
    (folder / ".metadata").write_bytes(buffer.getvalue())


def _overwrite(how: str, folder: Path, seed: float) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the corrupt record's warning is checked elsewhere
        if how == "swc.save":
            swc.save(_state(seed), folder, overwrite=True)
        else:
            dcp.save(_state(seed), storage_writer=swc.Writer(folder, overwrite=True))


HOW = ["swc.save", "dcp.save+Writer"]


@pytest.mark.parametrize("how", HOW)
@pytest.mark.parametrize("record", ["manifest", "stock .metadata"])
def test_a_victim_an_old_record_names_survives_byte_for_byte(tmp_path, how, record):
    folder = tmp_path / "ckpt"
    if record == "manifest":
        swc.save(_state(1), folder)
        _name_in_manifest(folder, "notes.txt")
    else:
        dcp.save(_state(1), storage_writer=FileSystemWriter(folder))
        _name_in_metadata(folder, "notes.txt")
    (folder / "notes.txt").write_bytes(VICTIM)
    _overwrite(how, folder, 2)
    assert (folder / "notes.txt").read_bytes() == VICTIM
    assert _loads(folder, 2)


@pytest.mark.parametrize("how", HOW)
@pytest.mark.parametrize("own", ["shardwise.json", ".metadata", ".shardwise"])
def test_an_old_record_naming_a_record_never_deletes_the_new_one(tmp_path, how, own):
    folder = tmp_path / "ckpt"
    swc.save(_state(1), folder)
    _name_in_manifest(folder, own)
    _overwrite(how, folder, 2)
    assert {"shardwise.json", ".metadata", ".shardwise"} <= set(os.listdir(folder))
    assert _loads(folder, 2)
    # and the new checkpoint's data is all there: nothing it names is missing
    assert all((folder / n).is_file() for n in referenced_files(folder, both=True))


def test_a_corrupt_record_decides_nothing_and_says_so(tmp_path):
    swc.save(_state(1), tmp_path)
    index = Manifest.read(tmp_path).index
    assert index is not None
    old = referenced_files(tmp_path)
    assert len(old) == 2 and index.file in old
    _name_in_manifest(tmp_path, "notes.txt")
    with pytest.warns(UserWarning, match=r"shardwise.json names 'notes.txt'.*corrupt record"):
        found = replaced_files(tmp_path)
    assert found == old - {index.file}  # `.metadata` still names the data file alone: it counts
    _name_in_metadata(tmp_path, "../outside.distcp")
    with pytest.warns(UserWarning, match="corrupt record"):
        assert replaced_files(tmp_path) == set()


def test_stock_data_files_go_only_when_a_replaced_record_names_them(tmp_path):
    folder = tmp_path / "ckpt"
    dcp.save(_state(1), storage_writer=FileSystemWriter(folder))
    (folder / "__7_0.distcp").write_bytes(b"a stock name no record names")
    swc.save(_state(2), folder, overwrite=True)
    assert not (folder / "__0_0.distcp").exists()  # the replaced stock .metadata named it
    assert (folder / "__7_0.distcp").read_bytes() == b"a stock name no record names"
    assert _loads(folder, 2)


def test_a_link_a_replaced_record_names_is_never_followed_nor_removed(tmp_path):
    outside = tmp_path / "outside.bin"
    outside.write_bytes(VICTIM)
    folder = tmp_path / "ckpt"
    folder.mkdir()
    os.symlink(outside, folder / "__3_0.sw0123456789ab.distcp")
    assert collect(folder, set(), {"__3_0.sw0123456789ab.distcp"}) == []
    assert (folder / "__3_0.sw0123456789ab.distcp").is_symlink()
    assert outside.read_bytes() == VICTIM


def test_collect_never_removes_records_locks_or_names_outside_the_patterns(tmp_path):
    names = [
        "shardwise.json",
        ".metadata",
        ".shardwise",
        "__0.metadata",
        "__0.shardwise.json",
        LOCK,
        "__0.shardwise.lock",
        "notes.txt",
        "__0_0.distcp.bak",
    ]
    for n in names:
        (tmp_path / n).write_bytes(b"x")
    assert collect(tmp_path, set(), set(names)) == []
    assert sorted(os.listdir(tmp_path)) == sorted(names)


def test_a_per_rank_record_naming_another_ranks_file_decides_nothing(tmp_path):
    from shardwise.checkpoint.io.commit import RecordNames

    data = "__1_0.sw0123456789ab.distcp"
    swc.save({"x": torch.zeros(0)}, tmp_path / "src")
    m = inline_manifest(tmp_path / "src")  # a sound record (version 3), sealed, but for its name
    m.tensors["x"].chunks[0].file = data
    (tmp_path / data).write_bytes(b"rank 1's")
    (tmp_path / "__0.shardwise.json").write_text(m.to_json())
    with pytest.warns(UserWarning, match="corrupt record"):
        assert replaced_files(tmp_path, RecordNames(0)) == set()


def test_leftovers_wait_while_another_scopes_save_is_live(tmp_path):
    from shardwise.checkpoint.io.lease import Lease
    from shardwise.storage import open_folder

    leftover = "__1_0.sw0123456789ab.distcp"
    (tmp_path / leftover).write_bytes(b"rank 1's unfinished data")
    with Lease(open_folder(tmp_path), 1).acquire():  # a per-rank save of rank 1 in flight
        assert collect(tmp_path, set(), set()) == []
    assert collect(tmp_path, set(), set()) == [leftover]  # once it is gone: a dead save's


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


def test_a_manifest_whose_index_is_damaged_still_names_its_index_and_objects(tmp_path):
    """What the head of a version 4 manifest names stays named when its sections cannot
    be read: its index is never taken for a leftover because one section is damaged."""
    path = tmp_path / "ck"
    swc.save({"w": torch.ones(4), "step": 3}, path)
    m = Manifest.read(path)
    assert m.index is not None
    (step,) = {o.file for o in m.objects.values()}
    raw = bytearray((path / m.index.file).read_bytes())
    raw[0] ^= 1
    (path / m.index.file).write_bytes(bytes(raw))
    assert referenced_files(path) == {m.index.file, step}


CRAFTED = crafted_locks()


@pytest.mark.parametrize("case", list(CRAFTED))
@pytest.mark.parametrize("how", HOW)
def test_a_crafted_foreign_lock_never_fails_a_committed_save(tmp_path, how, case):
    """A per-rank lock record beside a global save, however crafted, is judged after
    the commit (may rank 0's leftovers go?): the save returns, what it replaced is
    collected, and rank 0's leftovers wait (an unreadable lock is live)."""
    folder = tmp_path / "ckpt"
    swc.save(_state(1), folder)
    replaced = referenced_files(folder, both=True)
    assert len(replaced) == 2  # the data file and the index of save 1
    leftover = "__0_0.sw0123456789ab.distcp"  # rank 0's, of a save that may be in flight
    (folder / leftover).write_bytes(b"rank 0's unfinished data")
    (folder / "__0.shardwise.lock").write_bytes(CRAFTED[case])
    _overwrite(how, folder, 2)
    assert _loads(folder, 2)
    left = set(os.listdir(folder))
    assert not replaced & left
    assert (folder / leftover).read_bytes() == b"rank 0's unfinished data"
    assert (folder / "__0.shardwise.lock").read_bytes() == CRAFTED[case]
