"""Comparing what a rank body observed with torch's legacy module and with ours."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

# the legacy `except` clauses, most specific first (NotImplementedError is a RuntimeError)
CLAUSES = (NotImplementedError, TypeError, ValueError, RuntimeError, AttributeError)


def caught(fn: Callable[[], Any]) -> tuple[str, bool]:
    """Which legacy `except` clause catches `fn()`'s error ("ok" when none is raised),
    and whether the error is a `ShardwiseError` (ours must be; torch's are not)."""
    from shardwise.errors import ShardwiseError

    try:
        fn()
    except CLAUSES as e:
        clause = next(c for c in CLAUSES if isinstance(e, c))
        return clause.__name__, isinstance(e, ShardwiseError)
    return "ok", False


def differences(ours: Any, theirs: Any, where: str = "") -> list[str]:
    """Where `ours` differs from `theirs` (tensors by torch.equal, dtype included;
    containers and scalars by type and value)."""
    if isinstance(theirs, torch.Tensor) or isinstance(ours, torch.Tensor):
        if not (
            isinstance(ours, torch.Tensor)
            and isinstance(theirs, torch.Tensor)
            and ours.dtype == theirs.dtype
            and ours.shape == theirs.shape
            and torch.equal(ours, theirs)
        ):
            return [f"{where}: {ours!r} != {theirs!r}"]
        return []
    if isinstance(theirs, dict) and isinstance(ours, dict):
        if sorted(ours) != sorted(theirs):
            return [f"{where}: keys {sorted(ours)} != {sorted(theirs)}"]
        return [d for k in theirs for d in differences(ours[k], theirs[k], f"{where}[{k!r}]")]
    if isinstance(theirs, (list, tuple)) and isinstance(ours, (list, tuple)):
        if type(ours) is not type(theirs) or len(ours) != len(theirs):
            return [f"{where}: {ours!r} != {theirs!r}"]
        return [
            d
            for i, (a, b) in enumerate(zip(ours, theirs))
            for d in differences(a, b, f"{where}[{i}]")
        ]
    if type(ours) is not type(theirs) or ours != theirs:
        return [f"{where}: {ours!r} != {theirs!r}"]
    return []
