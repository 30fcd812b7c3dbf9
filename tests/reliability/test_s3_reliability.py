"""The crash and corruption suites again, on S3 (moto's server on 127.0.0.1): a lean subset.

On an object store the commit is different underneath (no rename, no fsync): the last
rank writes `.metadata` under a temporary name, the coordinator server-side copies it
into place, then PUTs `shardwise.json` and the marker whole. The same guarantees must
hold: a SIGKILL at any step loses nothing committed, leaves nothing half-written
loadable, touches no object of the user's, and the next save leaves no stray object;
every corruption of a copy is detected, nothing damaged loads as wrong data.

Each crash scenario is 2-3 saves of 2 ranks; each corruption kind 2 random trials
(the local suites, `test_crash.py` and `test_corruption.py`, run the full matrix).
"""

from __future__ import annotations

import random

import pytest

from . import chaos
from .test_crash import _intact

pytestmark = pytest.mark.spawned

# (point, rank killed or None for all, overwrite): the data phase on a new path, the
# commit phase while overwriting, where the previous checkpoint is at stake
CRASHES = [
    ("before-write", None, False),
    ("mid-data", 1, False),
    ("after-data", None, False),
    ("before-commit", None, False),
    ("between-records", None, True),
    ("before-collect", None, True),
    ("mid-collect", None, True),
]
TRIALS = 2


@pytest.fixture(scope="module")
def crash_folder(s3_server):
    """One bucket for every crash scenario, as `test_crash.py` uses one folder."""
    return chaos.Where(f"s3://{s3_server.new_bucket('crash')}/ckpt", s3_server.storage_options)


@pytest.fixture(scope="module")
def reference(s3_server):
    where = chaos.Where(f"s3://{s3_server.new_bucket('ref')}/ref", s3_server.storage_options)
    chaos.save_reference(where)
    return where


@pytest.mark.parametrize(
    "point, kill, overwrite",
    CRASHES,
    ids=[
        f"{p}-{'all' if k is None else f'rank{k}'}{'-overwrite' if o else ''}"
        for p, k, o in CRASHES
    ],
)
def test_kill_during_save_on_s3(crash_folder, point, kill, overwrite):
    outcome = chaos.crash_save(crash_folder, point, kill_rank=kill, overwrite=overwrite)
    _intact(outcome)
    assert outcome.new_state in chaos.expected_states(point, overwrite), outcome


@pytest.mark.parametrize("kind", chaos.CORRUPTIONS)
def test_damage_on_s3_is_always_detected(reference, s3_bucket, kind):
    url, options = s3_bucket
    scratch = chaos.Where(f"{url}/scratch", options)
    rng = random.Random(kind)
    for _ in range(TRIALS):
        outcome = chaos.corrupt_and_load(reference, scratch, rng, kind)
        assert outcome.ok, outcome
        assert not outcome.load.startswith("loaded WRONG"), outcome
