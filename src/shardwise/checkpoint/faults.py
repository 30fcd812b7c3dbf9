"""Failpoints for crash tests: `SHARDWISE_FAILPOINT=name[@rank]` kills this process there.

The reliability suite sets it in a subprocess to SIGKILL a save at a chosen
step (optionally on one rank only) and then checks that nothing committed
earlier was lost. Unset, a failpoint costs one dictionary lookup.

Points, in the order a save reaches them: before-write, mid-data (after the
first item of a data file), after-data (data fsynced), before-commit,
between-records (`.metadata` in place, the manifest not yet), before-collect
(committed, the replaced files not yet removed), mid-collect (after the first
removal). See `commit.py` for what each step leaves on disk.
"""

from __future__ import annotations

import os
import signal

__all__ = ["failpoint"]


def failpoint(name: str) -> None:
    spec = os.environ.get("SHARDWISE_FAILPOINT")
    if not spec:
        return
    point, _, rank = spec.partition("@")
    if point != name:
        return
    if rank and os.environ.get("SHARDWISE_RANK", os.environ.get("RANK")) != rank:
        return
    os.kill(os.getpid(), signal.SIGKILL)
