"""Fixtures of the io tests."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest


@pytest.fixture(params=["local", "memory"])
def where(request, tmp_path: Path) -> str:
    """A checkpoint location: a local folder, or a fresh fsspec memory URL."""
    if request.param == "local":
        return str(tmp_path / "ckpt")
    return f"memory://objects-trust-{uuid.uuid4().hex}/ckpt"
