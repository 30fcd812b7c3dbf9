"""Bad input on ONE rank, for every collective entry point: every rank raises the
same exception type within seconds, and nothing on disk changes."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from shardwise.testing import run_ranks

from .bad_input_cases import CASES, corrupt_chunk, prepare, run_case
from .reads import data_reads, touches

pytestmark = pytest.mark.spawned

# Measured on 2 shared cores (2 runs of the 53 cases): 0.09-0.87 s from starting the
# 2 ranks to their results, the process group's start included (the forkserver is
# warm after the module fixture). 5 s is ~6x the slowest; the harness kills a hang at 30 s.
BUDGET_S = 5.0
HARNESS_TIMEOUT_S = 30


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


def test_the_table_has_53_named_cases():
    assert len(CASES) == 53
    assert all(name == c.name == c.call.__name__.replace("_", "-") for name, c in CASES.items())
    assert len({c.entry for c in CASES.values()}) == 9  # every collective entry point


@pytest.mark.parametrize("name", list(CASES))
def test_every_rank_raises_the_same_error(folder, name):
    before = _snapshot(folder)
    start = time.monotonic()
    results = run_ranks(run_case, 2, name, str(folder), timeout=HARNESS_TIMEOUT_S)
    assert time.monotonic() - start < BUDGET_S, results
    kinds = {kind for kind, _ in results}
    assert len(kinds) == 1 and "no error" not in kinds, results
    assert _snapshot(folder) == before, "a failed collective changed files on disk"
    assert not (folder / "new").exists() and not (folder / "other").exists()


def _corrupt_case_with_reads(rank: int, world: int, folder: str) -> tuple[str, list]:
    with data_reads() as reads:
        kind, _ = run_case(rank, world, "load-corrupt-one-rank", folder)
    return kind, reads


def test_only_rank_1_reads_the_corrupt_chunk_and_every_rank_raises(folder):
    chunk = corrupt_chunk(folder)
    results = run_ranks(_corrupt_case_with_reads, 2, str(folder), timeout=HARNESS_TIMEOUT_S)
    assert [kind for kind, _ in results] == ["CorruptCheckpointError"] * 2, results
    readers = [
        r for r, (_, reads) in enumerate(results) if touches(reads, chunk.file, *chunk.record)
    ]
    assert readers == [1], (chunk, results)
