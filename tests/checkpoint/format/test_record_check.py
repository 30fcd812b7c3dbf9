"""What records claim, checked before anything is opened (`format.checks`): the names a
record may give a data file, byte ranges inside their files and apart, and stock
`.metadata` read with the safe unpickler and then checked."""

from __future__ import annotations

import os
import pickle

import pytest
import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

from shardwise.checkpoint.format.checks import (
    DATA_FILE,
    check_metadata,
    check_name,
    check_ranges,
    follow_replaced,
    name_problem,
    read_stock,
)
from shardwise.errors import CorruptCheckpointError, UnsafeMetadataError
from shardwise.storage import open_folder

OURS = "__0_0.sw0123456789ab.distcp"
OUT = "is not a file directly inside the checkpoint folder (a path out of it)"
RECORD = "is one of the checkpoint's own records, not a data file"


@pytest.mark.parametrize(
    "name, problem",
    [
        ("../x", OUT),
        ("a/b", OUT),
        ("a\\b", OUT),
        ("", OUT),
        (".", OUT),
        ("..", OUT),
        ("x\n", "holds a non-printable character (a newline, an escape or a control code)"),
        (".metadata", RECORD),
        ("shardwise.json", RECORD),
        (".shardwise", RECORD),
        ("__3.metadata", RECORD),
        ("__3.shardwise.json", RECORD),
        (".shardwise.lock", RECORD),
        ("shardwise.json.sw0123456789ab.tmp", RECORD),
        (3, "is a int, not a file name"),
        (None, "is a NoneType, not a file name"),
    ],
)
def test_names_no_record_may_give_a_data_file(name, problem):
    assert name_problem(name, shardwise=True) == problem
    assert name_problem(name, shardwise=False) == problem


@pytest.mark.parametrize(
    "name",
    ["__0_0.distcp", "__0_0.sw0123456789AB.distcp", "data.bin", "__0_0.sw0123456789ab.distcp.x"],
)
def test_a_manifest_names_only_shardwise_data_files(name):
    assert name_problem(name, shardwise=True) == (
        "is not a shardwise data file (__<rank>_<k>.sw<token>.distcp)"
    )
    assert name_problem(name, shardwise=False) is None  # stock .metadata may name it
    assert name_problem(OURS, shardwise=True) is None


def test_data_file_pattern_is_ascii_and_whole():
    m = DATA_FILE.fullmatch("__12_3.sw0123456789ab.distcp")
    assert m is not None and m.groups() == ("12", "3", "0123456789ab")
    assert DATA_FILE.fullmatch("__\u0663_0.sw0123456789ab.distcp") is None  # an Arabic-Indic 3
    assert DATA_FILE.fullmatch(OURS + "\n") is None


def test_check_name_names_the_entry_the_file_and_the_folder(tmp_path):
    with pytest.raises(CorruptCheckpointError) as info:
        check_name(open_folder(tmp_path), "k", "../x", "rec", shardwise=False)
    assert str(info.value) == (
        f"rec: 'k' names the file '../x' in {tmp_path}, which {OUT}: "
        "the checkpoint is damaged or crafted; refused, nothing read"
    )


@pytest.fixture
def folder(tmp_path):
    (tmp_path / "a").write_bytes(bytes(40))
    return open_folder(tmp_path)


def test_ranges_inside_and_apart_pass(folder):
    check_ranges(folder, [("k", "a", 0, 6), ("j", "a", 6, 34), ("e", "a", 3, 0)], folder.sizes())


@pytest.mark.parametrize(
    "ranges, message",
    [
        (
            [("k", "a", 35, 6)],
            "'k': bytes 35..41 lie past the end of {a} (40 bytes): truncated or damaged",
        ),
        (
            [("k", "b", 0, 1)],
            "'k': data file {b} is missing or not a plain file (links and folders are refused)",
        ),
        (
            [("k", "a", 0, 6), ("j", "a", 5, 2)],
            "'j' and 'k' claim overlapping bytes of {a} (at 5): damaged or crafted records",
        ),
    ],
    ids=["past-the-end", "missing", "overlap"],
)
def test_ranges_outside_or_overlapping_are_refused(folder, ranges, message):
    with pytest.raises(CorruptCheckpointError) as info:
        check_ranges(folder, ranges, folder.sizes())
    assert str(info.value) == message.format(a=folder.where("a"), b=folder.where("b"))


def _metadata(storage: dict) -> Metadata:
    w = TensorStorageMetadata(
        TensorProperties(dtype=torch.float32),
        torch.Size([4]),
        [ChunkStorageMetadata(torch.Size([0]), torch.Size([4]))],
    )
    return Metadata({"w": w, "o": BytesStorageMetadata()}, storage_data=storage)


W, OBJ = MetadataIndex("w", torch.Size([0])), MetadataIndex("o")
SOUND = {W: _StorageInfo("a", 0, 16), OBJ: _StorageInfo("a", 16, 5)}


@pytest.mark.parametrize(
    "storage, message",
    [
        (
            {W: _StorageInfo("a", 0, 10), OBJ: _StorageInfo("a", 10, 5)},
            "rec: 'w' chunk at (0,) claims 16 bytes of elements in a record of 10 bytes of {a}",
        ),
        (
            {OBJ: _StorageInfo("a", 10, 5)},
            "rec: 'w' (at torch.Size([0])) has no storage entry: damaged metadata",
        ),
        (
            {W: _StorageInfo("a", 0, 16), OBJ: _StorageInfo("a", -1, 5)},
            "rec: 'o' has an invalid byte range -1, 5 in {a}",
        ),
    ],
    ids=["short-record", "no-storage", "negative-offset"],
)
def test_stock_metadata_claims_are_checked(folder, storage, message):
    check_metadata(_metadata(SOUND), folder, "rec")
    with pytest.raises(CorruptCheckpointError) as info:
        check_metadata(_metadata(storage), folder, "rec")
    assert str(info.value) == message.format(a=folder.where("a"))


def test_something_else_than_metadata_is_refused(folder):
    with pytest.raises(
        CorruptCheckpointError, match="^rec holds a dict, not DCP checkpoint metadata$"
    ):
        check_metadata({}, folder, "rec")


class _Runs:
    def __reduce__(self):
        return (os.system, ("true",))


def test_read_stock_unpickles_safely_then_checks(folder):
    good = _metadata(SOUND)
    assert read_stock(folder, ".metadata", pickle.dumps(good)) == good
    with pytest.raises(UnsafeMetadataError) as info:
        read_stock(folder, ".metadata", pickle.dumps(_Runs()))
    assert str(info.value).startswith(
        f"{folder.where('.metadata')}: refused global posix.system in the checkpoint metadata"
    )


def test_a_replaced_metadata_is_followed_unless_it_names_the_manifests_files(folder):
    good = _metadata(SOUND)
    assert follow_replaced(folder, ".metadata", pickle.dumps(good), {"other"}) == good
    with pytest.raises(CorruptCheckpointError, match="names the same data files: it is damaged"):
        follow_replaced(folder, ".metadata", pickle.dumps(good), {"a"})
    with pytest.raises(CorruptCheckpointError, match="does not match the manifest beside it"):
        follow_replaced(folder, ".metadata", b"not a pickle", {"other"})
