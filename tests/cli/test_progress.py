"""The CLI's progress bar: on stderr when it is a terminal, off with `--quiet` or when not."""

from __future__ import annotations

import io
import sys

import pytest
import torch

import shardwise.checkpoint as swc
from shardwise.cli import main


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.fixture
def ckpt(tmp_path):
    swc.save({"w": torch.arange(4096.0).reshape(64, 64)}, tmp_path / "ckpt")
    return tmp_path / "ckpt"


COMMANDS = {
    "reshard": ["reshard", "{ckpt}", "{tmp}/out", "--world-size", "2"],
    "convert": ["convert", "{ckpt}", "{tmp}/out.safetensors", "--format", "safetensors"],
}


@pytest.mark.parametrize("command", list(COMMANDS))
def test_a_terminal_shows_the_bytes_done_and_quiet_shows_nothing(
    command, ckpt, tmp_path, monkeypatch
):
    argv = [a.format(ckpt=ckpt, tmp=tmp_path) for a in COMMANDS[command]]
    terminal = _Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    assert main(argv) == 0
    shown = terminal.getvalue()
    assert f"{command}: 100%" in shown and "16.4k/16.4k" in shown
    quiet = _Terminal()
    monkeypatch.setattr(sys, "stderr", quiet)
    assert main([*argv, "--overwrite", "--quiet"]) == 0
    assert quiet.getvalue() == ""


@pytest.mark.parametrize("command", list(COMMANDS))
def test_no_bar_when_stderr_is_no_terminal(command, ckpt, tmp_path, capsys):
    assert main([a.format(ckpt=ckpt, tmp=tmp_path) for a in COMMANDS[command]]) == 0
    assert capsys.readouterr().err == ""
