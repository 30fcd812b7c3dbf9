"""Run one bad-input case on a rank and report what that rank saw, for the
"every rank refuses together" tests (module level: run_ranks pickles it)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist


def refuse(call: Callable[[int], object], rank: int) -> tuple[str, str, float]:
    """`(exception type, message, all_reduce of ones)` after `call(rank)`; the
    all-reduce proves the process group still works after the refusal."""
    try:
        call(rank)
    except Exception as e:
        t = torch.ones(1)
        dist.all_reduce(t)
        return type(e).__name__, str(e), t.item()
    return "no error", "", 0.0
