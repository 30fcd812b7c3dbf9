"""`convert` names every non-tensor value it drops, and reports its progress."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import shardwise.checkpoint as swc
from shardwise.cli import main

TENSORS = {"w": torch.arange(48.0).reshape(6, 8), "b": torch.ones(3, dtype=torch.int64)}


@pytest.fixture
def ckpt(tmp_path) -> Path:
    state = {
        **{k: v.clone() for k, v in TENSORS.items()},
        "trainer": {"step": 11},
        "opt": {"param_groups": [{"lr": 0.1}]},
    }
    swc.save(state, tmp_path / "ckpt")
    return tmp_path / "ckpt"


DROPPED = (
    "dropped 2 non-tensor values that format '{format}' cannot store (it holds tensors "
    "only): 'opt.param_groups.0.lr', 'trainer.step'; load them from the checkpoint itself "
    "(swc.load) if you need them"
)


@pytest.mark.parametrize("format", ["safetensors", "torch"])
def test_each_dropped_value_is_named_in_a_warning_and_on_stderr(
    format, ckpt, tmp_path, capsys, caplog
):
    out = tmp_path / "model.out"
    with caplog.at_level(logging.WARNING, logger="shardwise"):
        assert main(["convert", str(ckpt), str(out), "--format", format]) == 0
    message = DROPPED.format(format=format)
    assert [(r.name, r.levelno, r.getMessage()) for r in caplog.records] == [
        ("shardwise", logging.WARNING, message)
    ]
    assert capsys.readouterr().err == f"shardwise convert: warning: {message}\n"


def test_the_python_call_warns_too_and_a_tensor_only_checkpoint_not_at_all(ckpt, tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="shardwise"):
        swc.convert(ckpt, tmp_path / "a.safetensors")
        assert [r.getMessage() for r in caplog.records] == [DROPPED.format(format="safetensors")]
        caplog.clear()
        swc.save({k: v.clone() for k, v in TENSORS.items()}, tmp_path / "plain")
        swc.convert(tmp_path / "plain", tmp_path / "b.safetensors")
    assert caplog.records == []


def test_a_long_list_of_dropped_values_is_cut_with_a_count(tmp_path, caplog):
    state = {"w": torch.ones(2), "meta": {f"k{i:02d}": i for i in range(13)}}
    swc.save(state, tmp_path / "ckpt")
    with caplog.at_level(logging.WARNING, logger="shardwise"):
        swc.convert(tmp_path / "ckpt", tmp_path / "m.pt", "torch")
    shown = ", ".join(f"'meta.k{i:02d}'" for i in range(10))
    assert caplog.records[0].getMessage() == (
        "dropped 13 non-tensor values that format 'torch' cannot store (it holds tensors "
        f"only): {shown}, ... and 3 more; load them from the checkpoint itself (swc.load) "
        "if you need them"
    )


@pytest.mark.parametrize("format", ["safetensors", "torch"])
def test_progress_adds_up_to_the_tensor_bytes_from_a_checkpoint(format, ckpt, tmp_path):
    seen: list[int] = []
    swc.convert(ckpt, tmp_path / "out", format, progress=seen.append)
    assert sorted(seen) == sorted(t.nbytes for t in TENSORS.values())


@pytest.mark.parametrize("format", ["shardwise", "torch"])
def test_progress_adds_up_to_the_tensor_bytes_from_a_safetensors_file(format, tmp_path):
    src = tmp_path / "in.safetensors"
    save_file(TENSORS, str(src))
    seen: list[int] = []
    swc.convert(src, tmp_path / "out", format, progress=seen.append)
    assert sorted(seen) == sorted(t.nbytes for t in TENSORS.values())
