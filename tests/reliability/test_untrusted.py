"""A checkpoint folder is untrusted input (issue 20, points 1, 2 (read side), 4 (read side),
5 and 6): every crafted record is refused, by every entry point, with the exact error type,
naming the entry and the path, and nothing outside the folder (or foreign inside it) is read
or changed."""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException

import shardwise.checkpoint as swc
from shardwise.checkpoint.format.checks import DATA_FILE, check_coverage, name_problem
from shardwise.checkpoint.io.commit import _DATA, data_file_name
from shardwise.cli import main
from shardwise.errors import CorruptCheckpointError, UnsafeMetadataError

from . import crafted
from .crafted import Place

LOCAL_AND_MEMORY = ["local", "memory"]


@pytest.fixture(params=LOCAL_AND_MEMORY)
def place(request, tmp_path) -> Place:
    if request.param == "local":
        p = Place(tmp_path)
    else:
        import fsspec

        root = f"memory://untrusted-{os.getpid()}-{id(tmp_path)}"
        p = Place(root)
        request.addfinalizer(lambda: fsspec.filesystem("memory").rm(root, recursive=True))
    p.save()
    return p


def _dcp_load(p: Place) -> Any:
    targets = crafted.targets()
    dcp.load(targets, storage_reader=swc.Reader(p.ckpt))
    return targets


# Every entry point that reads a checkpoint, as a call that raises or returns.
ENTRIES: dict[str, Callable[[Place], Any]] = {
    "load": lambda p: swc.load(crafted.targets(), p.ckpt),
    "read_tensor": lambda p: swc.read_tensor(p.ckpt, "w"),
    "verify": lambda p: swc.verify(p.ckpt),
    "inspect": lambda p: swc.inspect(p.ckpt),
    "convert": lambda p: swc.convert(p.ckpt, p.out("out.safetensors")),
    "reshard": lambda p: swc.reshard(p.ckpt, p.out("resharded"), 2),
    "dcp.load+Reader": _dcp_load,
}
CLI = {
    "verify": lambda p: ["verify", "--quiet", p.ckpt],
    "inspect": lambda p: ["inspect", p.ckpt],
    "convert": lambda p: ["convert", p.ckpt, p.out("out.pt"), "--format", "torch"],
    "reshard": lambda p: ["reshard", p.ckpt, p.out("resharded"), "--world-size", "2"],
}


def _refused_everywhere(p: Place, capsys: Any, kind: type[BaseException], *needles: str) -> None:
    """Every entry point raises exactly `kind` naming each of `needles`; `verify` with
    `raise_on_error=False` returns the same as its one problem; every CLI command exits
    1 with one line; the victims are untouched and no output was written."""
    before = p.victims()
    for name, entry in ENTRIES.items():
        with pytest.raises(BaseException) as info:
            entry(p)
        if name == "dcp.load+Reader":  # stock wraps what read_metadata raised, message kept
            assert type(info.value) is CheckpointException, repr(info.value)
        else:
            assert type(info.value) is kind or (
                name == "verify" and isinstance(info.value, CorruptCheckpointError)
            ), (name, repr(info.value))
        for needle in needles:
            assert needle in str(info.value), (name, needle, str(info.value))
    problems = swc.verify(p.ckpt, raise_on_error=False)
    assert len(problems) == 1 and all(n in problems[0] for n in needles), problems
    capsys.readouterr()
    for name, argv in CLI.items():
        assert main(argv(p)) == 1, name
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(f"shardwise {name}: "), (name, err)
        assert all(n in err[0] for n in needles), (name, err)
    assert p.victims() == before
    assert not p.parent.has("out.safetensors") and not p.parent.has("out.pt")
    assert not open_names(p, "resharded")


def open_names(p: Place, sub: str) -> list[str]:
    from shardwise.storage import open_folder

    return [n for n in open_folder(p.out(sub)).names() if not n.endswith(".lock")]


def _replaceable(p: Place) -> None:
    """A damaged checkpoint is always replaced by `save(..., overwrite=True)`, and the
    user's notes survive it."""
    notes = p.folder.read("notes.txt")
    swc.save(crafted.state(), p.ckpt, overwrite=True)
    got = crafted.targets()
    swc.load(got, p.ckpt)
    assert all(torch.equal(got[k], v) for k, v in crafted.state().items())
    assert p.folder.read("notes.txt") == notes


# -- 1. confinement -------------------------------------------------------------------------


@pytest.mark.parametrize("how", ["dotdot", "absolute"])
def test_stock_metadata_naming_a_file_outside_is_refused(place, capsys, how):
    path = "../secret.distcp" if how == "dotdot" else place.secret_path
    place.parent.write_durably("secret.distcp", place.folder.read(place.data_file()))
    crafted.stock_path(place, path)
    _refused_everywhere(place, capsys, CorruptCheckpointError, "'w'", repr(path))
    _replaceable(place)


@pytest.mark.parametrize("stock", [False, True], ids=["manifest", "stock"])
def test_a_symlink_in_the_folder_is_refused(tmp_path, capsys, stock):
    p = Place(tmp_path)
    p.save()
    data = p.data_file()
    outside = tmp_path / "outside.distcp"
    outside.write_bytes((tmp_path / "ckpt" / data).read_bytes())
    if stock:
        crafted.stock_path(p, "link.distcp")
        os.symlink(outside, tmp_path / "ckpt" / "link.distcp")
        data = "link.distcp"
    else:
        os.remove(tmp_path / "ckpt" / data)
        os.symlink(outside, tmp_path / "ckpt" / data)
    _refused_everywhere(p, capsys, CorruptCheckpointError, data, "not a plain file")
    assert os.path.islink(tmp_path / "ckpt" / data)


def test_a_symlinked_record_is_never_read(tmp_path):
    p = Place(tmp_path)
    p.save()
    outside = tmp_path / "outside.json"
    outside.write_bytes((tmp_path / "ckpt" / "shardwise.json").read_bytes())
    os.remove(tmp_path / "ckpt" / "shardwise.json")
    os.symlink(outside, tmp_path / "ckpt" / "shardwise.json")
    for entry in ("load", "read_tensor", "inspect", "verify"):
        with pytest.raises(CorruptCheckpointError, match="symbolic link"):
            ENTRIES[entry](p)
    with pytest.raises(CheckpointException, match="symbolic link"):
        _dcp_load(p)
    assert os.path.islink(tmp_path / "ckpt" / "shardwise.json")


def test_local_listing_and_reads_never_follow_links(tmp_path):
    from shardwise.storage import LocalFolder

    (tmp_path / "f").mkdir()
    (tmp_path / "secret").write_bytes(b"secret")
    (tmp_path / "f" / "plain").write_bytes(b"ok")
    os.symlink(tmp_path / "secret", tmp_path / "f" / "link")
    os.mkfifo(tmp_path / "f" / "fifo")
    folder = LocalFolder(tmp_path / "f")
    assert folder.sizes() == {"plain": 2}
    assert folder.read("plain") == b"ok"
    for name in ("link", "fifo"):
        with pytest.raises(CorruptCheckpointError):
            folder.read(name)
    for name in ("../secret", "/etc/passwd", "..", ""):
        with pytest.raises(CorruptCheckpointError):
            folder.open(name)


@pytest.mark.parametrize("name", ["notes.txt", "shardwise.json", ".metadata"])
def test_manifest_naming_a_file_that_is_not_ours_is_refused(place, capsys, name):
    crafted.manifest_file(place, name)  # each exists: only its name gives it away
    _refused_everywhere(place, capsys, CorruptCheckpointError, "'e'", repr(name))
    _replaceable(place)


@pytest.mark.parametrize("name", ["shardwise.json", ".metadata", "ckpt.lock", "__3.metadata"])
def test_stock_metadata_naming_a_record_is_refused(place, capsys, name):
    crafted.stock_path(place, name)
    _refused_everywhere(place, capsys, CorruptCheckpointError, "'w'", repr(name))


def test_name_rules():
    data = data_file_name("__3_", 7, "0123456789ab")
    assert DATA_FILE.pattern == _DATA.pattern and DATA_FILE.fullmatch(data)
    assert name_problem(data, shardwise=True) is None
    assert name_problem("__0_0.distcp", shardwise=False) is None  # stock's own names
    assert name_problem("__0_0.distcp", shardwise=True) is not None
    for bad in (
        "../x",
        "/abs",
        "a/b",
        "a\\b",
        "..",
        "",
        ".shardwise",
        "__2.shardwise.json",
        ".metadata.sw0123456789ab.tmp",
        "x.lock",
        3,
    ):
        assert name_problem(bad, shardwise=False) is not None, bad


# -- 5. records checked before use ------------------------------------------------------------


@pytest.mark.parametrize("stock", [False, True], ids=["manifest", "stock"])
def test_a_huge_shape_with_one_small_chunk_is_refused_before_allocating(place, capsys, stock):
    crafted.huge_shape(place, stock)
    _refused_everywhere(place, capsys, CorruptCheckpointError, "'w'", "in no chunk")
    _replaceable(place)


@pytest.mark.parametrize("stock", [False, True], ids=["manifest", "stock"])
def test_partly_overlapping_chunks_are_refused(place, capsys, stock):
    crafted.reshaped(place, stock, (6, 4), (2, 0))
    _refused_everywhere(place, capsys, CorruptCheckpointError, "'w'", "overlap")


@pytest.mark.parametrize("stock", [False, True], ids=["manifest", "stock"])
def test_a_hole_is_refused_and_never_read(place, capsys, stock):
    crafted.reshaped(place, stock, (9, 4), (5, 0))
    _refused_everywhere(place, capsys, CorruptCheckpointError, "'w'", "in no chunk")


def test_a_deeply_nested_manifest_is_corrupt_and_replaceable(place, capsys):
    crafted.nested_manifest(place)
    _refused_everywhere(place, capsys, CorruptCheckpointError, "shardwise.json", "nested")
    _replaceable(place)


def test_a_deeply_nested_pickle_raises_no_recursion_error(place):
    crafted.nested_pickle(place)
    got = _dcp_load(place)  # planner data is DCP's business: loaded, never walked by us
    assert torch.equal(got["w"], crafted.state()["w"])
    assert torch.equal(swc.read_tensor(place.ckpt, "w"), crafted.state()["w"])
    assert swc.verify(place.ckpt) == []


def test_a_pickle_whose_class_raises_type_error_is_unsafe(place, capsys):
    crafted.type_error_pickle(place)
    _refused_everywhere(place, capsys, UnsafeMetadataError, ".metadata", "TypeError")
    _replaceable(place)


def test_coverage_rules():
    check_coverage("t", (4, 4), [((0, 0), (2, 4)), ((2, 0), (2, 4)), ((2, 0), (2, 4))], "r")
    for chunks in (
        [((0, 0), (2, 4)), ((1, 0), (3, 4))],  # partial overlap along the cut
        [((0, 0), (2, 2)), ((1, 1), (2, 2)), ((0, 2), (4, 2)), ((2, 0), (2, 2))],  # grid
        [((0, 0), (2, 4))],  # a hole
        [((0, 0), (2, 2)), ((2, 2), (2, 2))],  # holes in a grid
        [((0,), (4,))],  # wrong ndim
        [((0, 0), (5, 4))],  # out of bounds
        [((0, 0), (4, 4)), ((0, 0), (0, 0))],  # two chunks at one place
    ):
        with pytest.raises(CorruptCheckpointError, match="'t'"):
            check_coverage("t", (4, 4), chunks, "r")
    with pytest.raises(CorruptCheckpointError, match="two chunks"):  # a manifest stores each once
        check_coverage("t", (4,), [((0,), (4,)), ((0,), (4,))], "r", replicas=False)
    check_coverage("t", (4, 4), [((0, 0), (2, 4))], "r", holes=True)  # a per-rank record


# -- 6. stale manifests ---------------------------------------------------------------------


def test_a_manifest_left_behind_by_a_stock_overwrite_is_not_followed(tmp_path):
    p = Place(tmp_path)
    p.save()
    new = {k: v + 1000 for k, v in crafted.state().items()}
    dcp.save(new, storage_writer=FileSystemWriter(p.ckpt, overwrite=True))
    assert p.folder.has("shardwise.json")  # stock never removes it
    got = crafted.targets()
    swc.load(got, p.ckpt)
    assert torch.equal(got["w"], new["w"]) and torch.equal(got["v"], new["v"])
    assert torch.equal(swc.read_tensor(p.ckpt, "v"), new["v"])
    assert torch.equal(_dcp_load(p)["w"], new["w"])
    assert swc.inspect(p.ckpt).kind == "stock DCP"
    assert swc.verify(p.ckpt) == []


def test_a_stale_manifest_under_a_url_is_not_followed(place):
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

    new = {k: v * 3 - 7 for k, v in crafted.state().items()}
    writer = (
        FileSystemWriter(place.ckpt, overwrite=True)
        if place.local
        else FsspecWriter(place.ckpt, overwrite=True)
    )
    dcp.save(new, storage_writer=writer)
    got = crafted.targets()
    swc.load(got, place.ckpt)
    assert torch.equal(got["w"], new["w"])
    assert torch.equal(swc.read_tensor(place.ckpt, "w"), new["w"])
    assert torch.equal(_dcp_load(place)["v"], new["v"])


def test_a_damaged_metadata_beside_its_manifest_is_corrupt(place):
    data = bytearray(place.folder.read(".metadata"))
    at = data.index(b"save_id") if b"save_id" in data else len(data) // 2
    data[at] ^= 0x20  # still a pickle, still naming the same data files
    place.folder.write_durably(".metadata", bytes(data))
    for name in ("load", "read_tensor", "inspect", "verify"):
        with pytest.raises(CorruptCheckpointError, match=re.escape(".metadata")):
            ENTRIES[name](place)
    with pytest.raises(CheckpointException, match="damaged"):
        _dcp_load(place)
