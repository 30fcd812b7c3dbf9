"""`main`'s wording: the command line's own flags, not the library's argument names,
and a failure every rank shares said once."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import shardwise.checkpoint as swc
from shardwise import CheckpointExistsError, InvalidArgumentError
from shardwise.cli import main
from shardwise.testing import RanksFailed


@pytest.fixture
def ckpt(tmp_path) -> Path:
    swc.save({"w": torch.arange(12.0).reshape(3, 4)}, tmp_path / "ckpt")
    return tmp_path / "ckpt"


def test_a_checkpoint_in_the_way_names_the_overwrite_flag(ckpt, capsys):
    assert main(["reshard", str(ckpt), str(ckpt), "--world-size", "2"]) == 1
    assert capsys.readouterr().err == (
        f"shardwise reshard: error: Checkpoint already exists at {ckpt}; "
        "pass --overwrite to replace it\n"
    )


def test_an_export_in_the_way_names_the_overwrite_flag(ckpt, tmp_path, capsys):
    out = tmp_path / "m.safetensors"
    argv = ["convert", str(ckpt), str(out), "--format", "safetensors"]
    assert main(argv) == 0
    capsys.readouterr()
    assert main(argv) == 1
    assert capsys.readouterr().err == (
        f"shardwise convert: error: {out} already exists; pass --overwrite\n"
    )


def test_an_argument_with_an_underscore_is_named_as_its_flag(ckpt, tmp_path, capsys):
    assert main(["reshard", str(ckpt), str(tmp_path / "x"), "--world-size", "0"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("shardwise reshard: error: --world-size must be an int of at least 1")
    assert "world_size" not in err


def test_python_callers_keep_the_argument_names(ckpt):
    with pytest.raises(CheckpointExistsError, match=r"pass overwrite=True to replace it$"):
        swc.reshard(ckpt, ckpt, 2)


def _failed_on_every_rank(args):
    same = CheckpointExistsError("Checkpoint already exists at /x; pass overwrite=True")
    raise RanksFailed(
        {0: same, 1: same, 2: same, 3: InvalidArgumentError("rank 3 only")},
        {r: f"Traceback of rank {r}" for r in range(4)},
    )


def test_an_error_every_rank_raised_is_printed_once(monkeypatch, capsys):
    monkeypatch.setattr("shardwise.cli.demo.main", _failed_on_every_rank)
    assert main(["demo"]) == 1
    assert capsys.readouterr().err == (
        "shardwise demo: error: ranks 0, 1, 2: Checkpoint already exists at /x; pass "
        "overwrite=True; rank 3: rank 3 only\n"
    )


def test_a_repr_inside_a_message_keeps_its_argument_names(ckpt, tmp_path, monkeypatch, capsys):
    def refuse(args):
        raise InvalidArgumentError(
            "world_size must be 2 for Layout(global_shape=(6,), world_size=3); pass overwrite=True"
        )

    monkeypatch.setattr("shardwise.cli.reshard.main", refuse)
    argv = ["reshard", str(ckpt), str(tmp_path / "x"), "--world-size", "2"]
    assert main(argv) == 1
    assert capsys.readouterr().err == (
        "shardwise reshard: error: --world-size must be 2 for "
        "Layout(global_shape=(6,), world_size=3); pass --overwrite\n"
    )
