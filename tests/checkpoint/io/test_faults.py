"""Failpoints for crash tests (`io.commit`): `name[@rank]` parsed, the process killed only at
the named point of the named rank, and a pausepoint that waits for its go."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from shardwise.checkpoint.io.commit import failpoint

pytestmark = pytest.mark.spawned


@pytest.fixture
def pause_dir(tmp_path, monkeypatch):
    """Pausepoints report to `tmp_path` and find their go already there: none waits."""
    for name in ("SHARDWISE_FAILPOINT", "SHARDWISE_PAUSEPOINT", "SHARDWISE_RANK", "RANK"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("SHARDWISE_PAUSE_DIR", str(tmp_path))
    (tmp_path / "go").touch()
    return tmp_path


@pytest.mark.parametrize(
    "spec, env, reached",
    [
        ("before-commit", {}, True),
        ("before-commit", {"SHARDWISE_RANK": "3"}, True),  # no rank named: every rank
        ("before-commit@1", {"SHARDWISE_RANK": "1"}, True),
        ("before-commit@1", {"SHARDWISE_RANK": "0"}, False),
        ("before-commit@1", {"RANK": "1"}, True),  # torchrun's RANK when ours is unset
        ("before-commit@1", {"SHARDWISE_RANK": "0", "RANK": "1"}, False),  # ours first
        ("before-commit@1", {}, False),  # no rank known: not rank 1
        ("before-collect", {}, False),
        ("before", {}, False),  # names match whole
    ],
)
def test_a_pausepoint_stops_only_at_its_point_and_rank(pause_dir, monkeypatch, spec, env, reached):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("SHARDWISE_PAUSEPOINT", spec)
    failpoint("before-commit")
    assert (pause_dir / "reached").exists() == reached


def test_unset_failpoints_do_nothing(pause_dir):
    failpoint("before-commit")
    assert sorted(p.name for p in pause_dir.iterdir()) == ["go"]


_CALL = "from shardwise.checkpoint.io.commit import failpoint; failpoint('mid-data'); print('past')"


@pytest.mark.parametrize(
    "spec, killed",
    [("mid-data@0", True), ("mid-data@1", False), ("after-data", False)],
)
def test_a_failpoint_kills_its_rank_with_sigkill(spec, killed):
    env = dict(os.environ, SHARDWISE_FAILPOINT=spec, SHARDWISE_RANK="0")
    done = subprocess.run([sys.executable, "-c", _CALL], env=env, capture_output=True, timeout=120)
    if killed:
        assert done.returncode == -signal.SIGKILL and b"past" not in done.stdout
    else:
        assert done.returncode == 0 and done.stdout == b"past\n"
