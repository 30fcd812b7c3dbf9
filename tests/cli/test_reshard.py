"""`reshard`'s `dim`: a dim no tensor has is refused; tensors lacking it are replicated
(the documented rule); and the bytes written are reported to `progress`."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import shardwise.checkpoint as swc
from shardwise import InvalidArgumentError, Layout
from shardwise.checkpoint.format.manifest import Manifest
from shardwise.cli import main

W = torch.arange(48.0).reshape(6, 8)
B = torch.ones(3)


@pytest.fixture
def ckpt(tmp_path) -> Path:
    swc.save({"w": W.clone(), "b": B.clone(), "step": torch.tensor(7)}, tmp_path / "ckpt")
    return tmp_path / "ckpt"


def test_the_cli_refuses_a_dim_no_tensor_has_naming_the_tensor_and_its_ndim(ckpt, tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["reshard", str(ckpt), str(out), "--world-size", "2", "--dim", "5"]) == 1
    assert capsys.readouterr().err == (
        f"shardwise reshard: error: --dim 5 is no dimension of any tensor of {ckpt}: the one "
        "with the most, 'w', has ndim 2 (shape (6, 8)); every tensor would be replicated, all "
        "in rank 0's file. Chunk along a dim below 2, or give layouts\n"
    )
    assert not out.exists()


def test_the_python_call_refuses_it_too_and_a_negative_dim(ckpt, tmp_path):
    with pytest.raises(InvalidArgumentError, match=r"^dim=2 is no dimension of any tensor"):
        swc.reshard(ckpt, tmp_path / "out", 2, dim=2)
    with pytest.raises(InvalidArgumentError, match=r"^dim must be an int of at least 0.*-1$"):
        swc.reshard(ckpt, tmp_path / "out", 2, dim=-1)
    assert not (tmp_path / "out").exists()


def test_a_dim_only_some_tensors_have_replicates_the_others(ckpt, tmp_path):
    out = swc.reshard(ckpt, tmp_path / "out", 2, dim=1)
    tensors = Manifest.read(out).tensors
    assert [c.sizes for c in tensors["w"].chunks] == [(6, 4), (6, 4)]
    assert [c.sizes for c in tensors["b"].chunks] == [(3,)]  # stored once, read by both
    assert torch.equal(swc.read_tensor(out, "b"), B) and torch.equal(swc.read_tensor(out, "w"), W)


def test_a_dim_the_layouts_make_unused_is_not_checked(ckpt, tmp_path):

    layouts = {"w": Layout.row_wise((6, 8), [3, 3]), "b": Layout.replicated((3,), 2)}
    layouts["step"] = Layout.replicated((), 2)
    swc.reshard(ckpt, tmp_path / "out", 2, dim=4, layouts=layouts)


def test_progress_adds_up_to_the_tensor_bytes(ckpt, tmp_path):
    seen: list[int] = []
    swc.reshard(ckpt, tmp_path / "out", 4, progress=seen.append)
    assert sum(seen) == W.nbytes + B.nbytes + 8
    assert sorted(seen) == [4, 4, 4, 8, 64, 64, 64]  # rows 2+2+2+0, bias 1+1+1+0, step once
