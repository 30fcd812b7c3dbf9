"""Stagers in each copy mode, shared by the tests of `staging` and `engine.staging`."""

from __future__ import annotations

from typing import Any

from shardwise.checkpoint.engine.staging import Stager


def pooled(threads: int = 3, piece: int = 4096) -> Stager:
    """A stager that sends every contiguous CPU tensor to its pool, in small pieces."""
    stager = Stager(threads=threads)
    stager._pool_min_bytes = 0
    stager._min_piece_bytes = piece
    return stager


def stagers() -> list[Stager]:
    """One stager per copy mode: default threads, one thread, pooled in small pieces."""
    return [Stager(), Stager(threads=1), pooled()]


def cycle(stager: Stager, state: Any) -> Any:
    """One save's staging: stage `state`, then hand the buffers back as the save does
    once it has written them; the staged state (valid until the next `stage`)."""
    staged = stager.stage(state)
    stager.release(staged)
    return staged.state
