"""A script that uses shardwise's checkpoints and ends without `destroy_process_group()`
exits 0, every time: the library's threads, pools and gloo groups never abort the
interpreter's exit (issue 35, point 14). 20 runs of 4 ranks (`exit_job.py`: each
rank a process with `torchrun`'s environment, leaving by the normal exit)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

import shardwise.checkpoint as swc

pytestmark = pytest.mark.spawned

JOB = Path(__file__).with_name("exit_job.py")
RUNS, RANKS = 20, 4
ABORTS = ("terminate called", "Fatal Python error", "Aborted", "core dumped", "Traceback")


def test_scripts_that_never_destroy_the_group_exit_cleanly_every_time(tmp_path):
    done = subprocess.run(
        [sys.executable, str(JOB), str(RUNS), str(RANKS), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-4000:]
    statuses = re.findall(r"^run (\d+): (\[.*\])$", done.stdout, re.MULTILINE)
    assert [(int(run), text) for run, text in statuses] == [
        (run, str([0] * RANKS)) for run in range(RUNS)
    ], output[-4000:]
    # the ranks share the pipe: their lines may interleave, never lose words
    assert sorted(re.findall(r"rank (\d+) done", done.stdout)) == sorted(
        [str(r) for r in range(RANKS)] * RUNS
    )
    assert [a for a in ABORTS if a in output] == [], output[-4000:]
    for run in range(RUNS):  # the save still in flight at the exit committed first
        for name in ("a", "b", "c"):
            assert swc.verify(tmp_path / f"run{run}" / name) == [], (run, name)
