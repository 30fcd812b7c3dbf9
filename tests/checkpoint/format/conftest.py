"""Fixtures of the format tests (checkpoint locations, the wide tiled checkpoint); the shared
helper modules get pytest's assertion rewriting."""

from __future__ import annotations

import uuid
import warnings
from pathlib import Path

import pytest
import torch

import shardwise.checkpoint as swc
from shardwise import Block, Layout, ShardedTensor

from .tile_data import WIDE, random_tensor

pytest.register_assert_rewrite(
    "tests.checkpoint.format.golden_manifest",
    "tests.checkpoint.format.broken_fields",
    "tests.checkpoint.format.crafted_sections",
)


@pytest.fixture(params=["local", "memory"])
def where(request, tmp_path: Path) -> str:
    """A checkpoint location: a local folder, or a fresh fsspec memory URL."""
    if request.param == "local":
        return str(tmp_path / "ckpt")
    return f"memory://objects-trust-{uuid.uuid4().hex}/ckpt"


def _save(path: Path, state: dict) -> None:
    with warnings.catch_warnings():  # "assuming the intent is to save in a single process"
        warnings.simplefilter("ignore", UserWarning)
        swc.save(state, path)


@pytest.fixture(scope="module")
def wide(tmp_path_factory) -> tuple[Path, torch.Tensor]:
    """A (64, 65536) float32 checkpoint in two row-wise chunks (tiles of (1, 16384)), and
    its values; a test copies it before damaging it."""
    path = tmp_path_factory.mktemp("tiles") / "wide"
    full = random_tensor(WIDE, torch.float32, seed=7)
    layout = Layout(
        WIDE, {0: [Block((0, 0), (40, 65536)), Block((40, 0), (24, 65536))]}
    )  # row-wise
    _save(path, {"w": ShardedTensor.from_layout(layout, [full[:40].clone(), full[40:].clone()])})
    return path, full
