"""Bad input on ONE rank, for every collective entry point: every rank raises the
same exception type within seconds, and nothing on disk changes."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from shardwise.testing import run_ranks

from .bad_input_cases import CASES, prepare, run_case


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("badinput")
    prepare(path)
    return path


def _snapshot(folder: Path) -> dict[str, tuple[int, int]]:
    return {
        str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns)
        for p in folder.rglob("*")
        if p.is_file() and ".shardwise-partial" not in str(p)
    }


def test_there_are_at_least_30_cases():
    assert len(CASES) >= 30


@pytest.mark.parametrize("name", list(CASES))
def test_every_rank_raises_the_same_error(folder, name):
    before = _snapshot(folder)
    start = time.monotonic()
    results = run_ranks(run_case, 2, name, str(folder), timeout=30)
    assert time.monotonic() - start < 30
    kinds = {kind for kind, _ in results}
    assert len(kinds) == 1 and "no error" not in kinds, results
    assert _snapshot(folder) == before, "a failed collective changed files on disk"
    assert not (folder / "new").exists() and not (folder / "other").exists()
