"""Failpoints for crash tests: `SHARDWISE_FAILPOINT=name[@rank]` kills this process there.

The reliability suite sets it in a subprocess to SIGKILL a save at a chosen
step (optionally on one rank only) and then checks that nothing committed
earlier was lost. Unset, a failpoint costs one dictionary lookup.

Points, in the order a save reaches them: before-write, mid-data (after the
first item of a data file), after-data (data fsynced), before-commit,
between-records (`.metadata` in place, the manifest not yet), before-collect
(committed, the replaced files not yet removed), mid-collect (after the first
removal). See `commit.py` for what each step leaves on disk.

`SHARDWISE_PAUSEPOINT=name[@rank]` with `SHARDWISE_PAUSE_DIR=dir` pauses there
instead: the process creates `dir/reached` and waits (up to `PAUSE_S`) until
`dir/go` exists, so a test can act (start a second save, kill this one) while
this save is held at a known step.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

__all__ = ["PAUSE_S", "failpoint"]

PAUSE_S = 120.0


def _here(spec: str, name: str) -> bool:
    point, _, rank = spec.partition("@")
    if point != name:
        return False
    return not rank or os.environ.get("SHARDWISE_RANK", os.environ.get("RANK")) == rank


def failpoint(name: str) -> None:
    spec = os.environ.get("SHARDWISE_FAILPOINT")
    if spec and _here(spec, name):
        os.kill(os.getpid(), signal.SIGKILL)
    pause = os.environ.get("SHARDWISE_PAUSEPOINT")
    if pause and _here(pause, name):
        where = Path(os.environ["SHARDWISE_PAUSE_DIR"])
        (where / "reached").touch()
        deadline = time.monotonic() + PAUSE_S
        while not (where / "go").exists() and time.monotonic() < deadline:
            time.sleep(0.01)
