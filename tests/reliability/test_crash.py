"""SIGKILL a 2-rank save at every step: nothing committed is lost, nothing half-written loads."""

from __future__ import annotations

import pytest

from shardwise import chaos

CASES = [
    (point, kill)
    for point in chaos.CRASH_POINTS
    for kill in ((None, 0) if point in chaos.COORDINATOR_POINTS else (None, 0, 1))
]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tmp_path_factory.mktemp("crash")


@pytest.mark.parametrize("point, kill", CASES, ids=[f"{p}-{'all' if k is None else f'rank{k}'}" for p, k in CASES])
def test_kill_during_save(folder, point, kill):
    outcome = chaos.crash_save(folder, point, kill_rank=kill, overwrite=point == "mid-overwrite")
    assert not outcome.lost_previous, outcome
    assert outcome.new_state in ("absent", "incomplete", "complete"), outcome
    assert outcome.resave_ok and not outcome.stray, outcome


@pytest.mark.parametrize("point", ["before-publish", "mid-overwrite"])
def test_kill_during_an_overwrite_keeps_the_old_checkpoint(folder, point):
    outcome = chaos.crash_save(folder, point, overwrite=True)
    assert outcome.ok and not outcome.lost_previous, outcome


def test_kill_during_async_save_in_the_background(folder):
    outcome = chaos.crash_save(folder, "mid-data", use_async=True)
    assert outcome.ok and outcome.new_state in ("absent", "incomplete"), outcome
