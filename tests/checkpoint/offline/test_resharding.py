"""`reshard`: a layout with holes, a world size of no ranks, a layout for a key the
checkpoint lacks: each refused before anything is written or collected."""

from __future__ import annotations

import warnings

import pytest
import torch

import shardwise.checkpoint as swc
from shardwise import Block, CheckpointMismatchError, InvalidArgumentError, Layout, LayoutError
from shardwise.cli import main

warnings.filterwarnings("ignore", message="torch.distributed is disabled")

W = torch.arange(48.0).reshape(6, 8)
HOLED = Layout((6, 8), {0: [Block((0, 0), (4, 8))], 1: []}, allow_holes=True)
HOLE = (
    "'w': elements [4:6, 0:8] are held by no rank (the layout's blocks cover 32 of its 48 "
    "elements); every element must be saved: give the layout blocks that cover the tensor"
)


@pytest.fixture
def ckpt(tmp_path):
    swc.save({"w": W, "b": torch.ones(3)}, tmp_path / "ckpt")
    return tmp_path / "ckpt"


def _files(path):
    return {p.name: p.read_bytes() for p in path.iterdir()}


def test_a_layout_with_holes_never_replaces_the_checkpoint(ckpt):
    before = _files(ckpt)
    with pytest.raises(LayoutError) as e:
        swc.reshard(ckpt, ckpt, 2, layouts={"w": HOLED}, overwrite=True)
    assert str(e.value) == HOLE
    # refused before the lease: the folder is byte for byte as it was, the rows still there
    assert _files(ckpt) == before
    assert torch.equal(swc.read_tensor(ckpt, "w"), W)


def test_a_layout_with_holes_writes_no_new_checkpoint(ckpt, tmp_path):
    with pytest.raises(LayoutError, match=r"'w': elements \[4:6, 0:8\] are held by no rank"):
        swc.reshard(ckpt, tmp_path / "out", 2, layouts={"w": HOLED})
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "layout, hole",
    [
        # replicas counted once: rows 0..2 twice still leave 3..5 uncovered
        (
            Layout(
                (6, 8), {0: [Block((0, 0), (3, 8))], 1: [Block((0, 0), (3, 8))]}, allow_holes=True
            ),
            "[3:6, 0:8]",
        ),
        # only zero-size blocks: nothing is covered
        (Layout((6, 8), {0: [Block((0, 0), (0, 8))], 1: []}, allow_holes=True), "[0:6, 0:8]"),
        # a hole in the middle of a column split
        (
            Layout(
                (6, 8), {0: [Block((0, 0), (6, 3))], 1: [Block((0, 5), (6, 3))]}, allow_holes=True
            ),
            "[0:6, 3:5]",
        ),
    ],
    ids=["replicas", "empty-blocks", "middle"],
)
def test_every_kind_of_hole_is_named(ckpt, tmp_path, layout, hole):
    with pytest.raises(LayoutError) as e:
        swc.reshard(ckpt, tmp_path / "out", 2, layouts={"w": layout})
    assert str(e.value).startswith(f"'w': elements {hole} are held by no rank")
    assert not (tmp_path / "out").exists()


def test_a_covering_layout_with_allow_holes_is_accepted(ckpt, tmp_path):
    full = Layout(
        (6, 8), {0: [Block((0, 0), (4, 8))], 1: [Block((4, 0), (2, 8))]}, allow_holes=True
    )
    swc.reshard(ckpt, tmp_path / "out", 2, layouts={"w": full})
    assert torch.equal(swc.read_tensor(tmp_path / "out", "w"), W)


def test_the_cli_refuses_a_layout_file_with_holes(ckpt, tmp_path, capsys):
    spec = tmp_path / "layout.json"
    spec.write_text('{"w": ' + HOLED.to_json() + "}")
    before = _files(ckpt)
    argv = ["reshard", str(ckpt), str(ckpt), "--world-size", "2", "--layout", str(spec)]
    assert main([*argv, "--overwrite"]) != 0
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith("shardwise ")
    assert _files(ckpt) == before


@pytest.mark.parametrize("world_size", [0, -1, True, 2.0, "2", None])
def test_a_world_size_of_no_ranks_never_replaces_the_checkpoint(tmp_path, world_size):
    # a checkpoint of objects only has no tensor whose layout would refuse 0 ranks:
    # it was committed for no ranks, unreadable, in place of the good one
    path = tmp_path / "objects"
    swc.save({"trainer": {"step": 1234, "lr": 0.1}}, path)
    before = _files(path)
    with pytest.raises(InvalidArgumentError) as e:
        swc.reshard(path, path, world_size, overwrite=True)
    assert str(e.value) == (
        f"world_size must be an int of at least 1, got {world_size!r}: a checkpoint for no "
        "ranks holds nothing, not even its objects"
    )
    assert _files(path) == before
    out = {"trainer": {"step": None, "lr": None}}
    swc.load(out, path)
    assert out == {"trainer": {"step": 1234, "lr": 0.1}}
    with pytest.raises(InvalidArgumentError):
        swc.reshard(path, tmp_path / "new", world_size)
    assert not (tmp_path / "new").exists()


def test_a_layout_for_a_key_the_checkpoint_lacks_is_refused(ckpt, tmp_path):
    # a typo left the real key chunked by default, the caller's layout silently unused
    layouts = {
        "ww": Layout.column_wise((6, 8), [4, 4]),
        "b": Layout.replicated((3,), 2),
        "extra": Layout.replicated((3,), 2),
    }
    with pytest.raises(CheckpointMismatchError) as e:
        swc.reshard(ckpt, tmp_path / "out", 2, layouts=layouts)
    assert str(e.value) == (
        f"layouts names 2 key(s) that are no tensor of {ckpt}: 'extra', 'ww' (did you mean "
        "'w'?); its tensors are 'w', 'b'"
    )
    assert not (tmp_path / "out").exists()


def test_the_cli_refuses_a_layout_file_for_a_key_the_checkpoint_lacks(ckpt, tmp_path, capsys):
    spec = tmp_path / "layout.json"
    spec.write_text('{"ww": ' + Layout.column_wise((6, 8), [4, 4]).to_json() + "}")
    before = _files(ckpt)
    argv = ["reshard", str(ckpt), str(ckpt), "--world-size", "2", "--layout", str(spec)]
    assert main([*argv, "--overwrite"]) == 1
    assert capsys.readouterr().err.strip().splitlines() == [
        f"shardwise reshard: error: layouts names 1 key(s) that are no tensor of {ckpt}: "
        "'ww' (did you mean 'w'?); its tensors are 'w', 'b'"
    ]
    assert _files(ckpt) == before


@pytest.mark.parametrize(
    "text, why",
    [("[1, 2]", "holds a JSON list; give an object: key -> layout JSON"), ("{", "is not readable")],
)
def test_the_cli_refuses_a_layout_file_that_is_no_object(ckpt, tmp_path, capsys, text, why):
    spec = tmp_path / "layout.json"
    spec.write_text(text)
    argv = ["reshard", str(ckpt), str(tmp_path / "out"), "--world-size", "2", "--layout", str(spec)]
    assert main(argv) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"shardwise reshard: error: --layout {spec} {why}")
