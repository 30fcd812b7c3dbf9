"""SIGKILL a 2-rank save at every step, into folders that also hold the user's
files: nothing committed is lost, nothing half-written loads, no foreign file
is touched, and the next save leaves nothing behind."""

from __future__ import annotations

import pytest

from . import chaos

# Data-phase points on a new path (one or all ranks killed); commit-phase points
# (the coordinator's) while overwriting, where the previous checkpoint is at stake.
CASES = [
    (point, kill, point in chaos.COORDINATOR_POINTS)
    for point in chaos.CRASH_POINTS
    for kill in ((None, 0) if point in chaos.COORDINATOR_POINTS else (None, 0, 1))
]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tmp_path_factory.mktemp("crash")


@pytest.mark.parametrize(
    "point, kill, overwrite",
    CASES,
    ids=[
        f"{p}-{'all' if k is None else f'rank{k}'}{'-overwrite' if o else ''}" for p, k, o in CASES
    ],
)
def test_kill_during_save(folder, point, kill, overwrite):
    outcome = chaos.crash_save(folder, point, kill_rank=kill, overwrite=overwrite)
    assert not outcome.lost_previous, outcome
    assert outcome.new_state in ("absent", "incomplete", "complete"), outcome
    assert outcome.foreign_lost == [], outcome
    assert outcome.resave_ok and outcome.stray == [], outcome


@pytest.mark.parametrize("point", ["before-write", "mid-data", "after-data"])
def test_kill_during_an_overwrite_keeps_the_old_checkpoint(folder, point):
    outcome = chaos.crash_save(folder, point, overwrite=True)
    assert outcome.ok, outcome


def test_kill_on_a_new_path_between_the_records_leaves_the_new_checkpoint_complete(folder):
    # .metadata names only durable data, and no marker yet: it reads as a complete stock checkpoint
    outcome = chaos.crash_save(folder, "between-records")
    assert outcome.ok and outcome.new_state == "complete", outcome


def test_kill_on_a_new_path_before_the_commit_reports_incomplete(folder):
    outcome = chaos.crash_save(folder, "before-commit")
    assert outcome.ok and outcome.new_state == "incomplete", outcome


def test_kill_during_async_save_in_the_background(folder):
    outcome = chaos.crash_save(folder, "mid-data", use_async=True)
    assert outcome.ok and outcome.new_state in ("absent", "incomplete"), outcome
