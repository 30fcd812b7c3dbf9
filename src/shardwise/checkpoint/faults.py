"""Failpoints for crash tests: `SHARDWISE_FAILPOINT=name[@rank]` kills this process there.

The reliability suite sets it in a subprocess to SIGKILL a save at a chosen
step (optionally on one rank only) and then checks that nothing committed
earlier was lost. Unset, a failpoint costs one dictionary lookup.

Points, in the order a save reaches them: before-write, mid-data (after the
first item of a data file), after-data (data fsynced), before-manifest,
before-publish (manifest durable, folder not yet renamed), mid-overwrite
(the old checkpoint moved aside, the new one not yet in place).
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
