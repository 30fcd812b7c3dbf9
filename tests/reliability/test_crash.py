"""SIGKILL a 2-rank save at every step, into folders that also hold the user's
files: nothing committed is lost, nothing half-written loads, no foreign file
is touched, and the next save leaves nothing behind.

Every state is observed by loading the folder from a fresh process (`chaos.observe`):
the previous checkpoint bit for bit, the new one bit for bit, or
`IncompleteCheckpointError` (or, on a new path, no checkpoint at all)."""

from __future__ import annotations

import pytest

from . import chaos

pytestmark = pytest.mark.spawned

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


def _intact(outcome: chaos.CrashOutcome) -> None:
    """What holds after any kill: the observed state is an allowed one, nothing
    committed is lost, the user's files (and, beside a new path, the earlier
    checkpoint's folder) are byte for byte as they were, and the next save is clean."""
    assert outcome.new_state in outcome.allowed_states, outcome
    assert not outcome.lost_previous, outcome
    assert outcome.foreign_lost == [] and outcome.previous_changed == [], outcome
    assert outcome.resave_ok and outcome.stray == [], outcome
    assert outcome.ok, outcome


@pytest.mark.parametrize(
    "point, kill, overwrite",
    CASES,
    ids=[
        f"{p}-{'all' if k is None else f'rank{k}'}{'-overwrite' if o else ''}" for p, k, o in CASES
    ],
)
def test_kill_during_save(folder, point, kill, overwrite):
    outcome = chaos.crash_save(folder, point, kill_rank=kill, overwrite=overwrite)
    _intact(outcome)
    assert outcome.new_state in chaos.expected_states(point, overwrite), outcome


@pytest.mark.parametrize("point", ["before-write", "mid-data", "after-data"])
def test_kill_during_an_overwrite_keeps_the_old_checkpoint(folder, point):
    outcome = chaos.crash_save(folder, point, overwrite=True)
    _intact(outcome)
    assert outcome.new_state == "previous", outcome


@pytest.mark.parametrize("point", ["before-collect", "mid-collect"])
def test_kill_after_an_overwrite_commits_loads_the_new_checkpoint(folder, point):
    outcome = chaos.crash_save(folder, point, overwrite=True)
    _intact(outcome)
    assert outcome.new_state == "complete", outcome


def test_kill_on_a_new_path_between_the_records_leaves_the_new_checkpoint_complete(folder):
    # .metadata names only durable data, and no marker yet: it reads as a complete stock checkpoint
    outcome = chaos.crash_save(folder, "between-records")
    _intact(outcome)
    assert outcome.new_state == "complete", outcome


def test_kill_on_an_overwrite_between_the_records_reads_what_stock_reads(folder):
    # the old manifest is stale beside the new .metadata: followed by no reader
    outcome = chaos.crash_save(folder, "between-records", overwrite=True)
    _intact(outcome)
    assert outcome.new_state == "complete", outcome


def test_kill_on_a_new_path_before_the_commit_reports_incomplete(folder):
    outcome = chaos.crash_save(folder, "before-commit")
    _intact(outcome)
    assert outcome.new_state == "incomplete", outcome


def test_kill_during_async_save_in_the_background(folder):
    outcome = chaos.crash_save(folder, "mid-data", use_async=True)
    _intact(outcome)
    assert outcome.new_state in ("absent", "incomplete"), outcome
