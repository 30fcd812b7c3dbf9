"""`verify` says what it checked: a stock checkpoint has no checksums, so its data is
not verified, and "OK" would claim it was; what it can check (sizes, records) it does."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

import shardwise.checkpoint as swc
from shardwise.cli import main

STATE = {"w": torch.arange(100.0), "b": torch.ones(4)}


@pytest.fixture
def stock(tmp_path) -> Path:
    dcp.save({k: v.clone() for k, v in STATE.items()}, checkpoint_id=tmp_path / "stock")
    return tmp_path / "stock"


def _data_file(path: Path) -> Path:
    (found,) = path.glob("*.distcp")
    return found


def test_a_sound_stock_checkpoint_is_not_called_ok(stock, capsys):
    assert main(["verify", str(stock), "--quiet"]) == 0
    assert capsys.readouterr().out == (
        f"{stock}: structure OK; no checksums in a stock checkpoint: data not verified\n"
    )


def test_a_shardwise_checkpoint_is_ok(tmp_path, capsys):
    swc.save({k: v.clone() for k, v in STATE.items()}, tmp_path / "ckpt")
    assert main(["verify", str(tmp_path / "ckpt"), "--quiet"]) == 0
    assert capsys.readouterr().out == f"{tmp_path / 'ckpt'}: OK\n"


def test_a_flipped_byte_in_a_stock_checkpoint_is_said_to_be_unverifiable(stock, capsys):
    data = _data_file(stock)
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 1
    data.write_bytes(bytes(raw))
    assert main(["verify", str(stock), "--quiet"]) == 0  # nothing to check it against
    assert "data not verified" in capsys.readouterr().out


def test_a_truncated_stock_file_fails_naming_it(stock, capsys):
    data = _data_file(stock)
    os.truncate(data, 50)
    assert main(["verify", str(stock), "--quiet"]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    (line,) = captured.err.splitlines()
    assert line.startswith("shardwise verify: ") and str(data) in line
    assert "(50 bytes): truncated or damaged" in line
