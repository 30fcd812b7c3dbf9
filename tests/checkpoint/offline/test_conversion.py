"""`convert`'s registry of targets: the formats it accepts are the ones it names and the CLI offers."""

from __future__ import annotations

import warnings

import pytest
import torch

import shardwise.checkpoint as swc
from shardwise.checkpoint.offline.conversion import TARGETS
from shardwise.cli import _parser

warnings.filterwarnings("ignore", message="torch.distributed is disabled")


@pytest.fixture
def ckpt(tmp_path):
    swc.save({"w": torch.arange(6.0).reshape(2, 3)}, tmp_path / "ckpt")
    return tmp_path / "ckpt"


def test_an_unknown_format_lists_the_registered_ones(ckpt, tmp_path):
    from_checkpoint = sorted(n for n, t in TARGETS.items() if t.from_checkpoint)
    with pytest.raises(ValueError, match="unknown format 'nope' for a checkpoint") as e:
        swc.convert(ckpt, tmp_path / "out", "nope")
    assert all(f"'{n}'" in str(e.value) for n in from_checkpoint)


def test_a_checkpoint_is_not_written_from_a_checkpoint(ckpt, tmp_path):
    with pytest.raises(ValueError, match="use 'safetensors' or 'torch'"):
        swc.convert(ckpt, tmp_path / "out", "shardwise")


def test_the_cli_offers_exactly_the_registered_formats():
    sub = next(a for a in _parser()._actions if a.dest == "command")
    convert = sub.choices["convert"]
    (fmt,) = [a for a in convert._actions if a.dest == "format"]
    assert list(fmt.choices) == list(TARGETS) == ["safetensors", "torch", "shardwise"]
