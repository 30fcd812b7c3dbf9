"""Make every rank raise the same error, or none: the rule for collective entry points.

A collective that fails on one rank and proceeds on the others hangs the job.
So each entry point checks its local input first, then exchanges the verdict
(and whatever metadata it needs); if any rank found a problem, every rank
raises the same exception type with the same message, naming the faulty rank,
and the process group stays usable. A verdict alone, or values every rank must
share, cost one fixed-size `all_reduce` (`agree`, `verdict`): the ranks'
problems and values are gathered only when something is wrong, to name it.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ..errors import ArgumentMismatchError, ShardwiseError
from .communicator import Communicator, communicator

__all__ = [
    "Agreement",
    "Problem",
    "digest",
    "exchange",
    "odd_ranks",
    "raise_agreed",
    "require_same",
]

# (exception type, message) of one rank's problem, or None: picklable by design.
Problem = tuple[type, str] | None


def exchange(problem: BaseException | None, payload: Any, group: Any) -> list[Any]:
    """All-gather `payload` from every rank; raise on all ranks if any had a problem.
    The rank that had `problem` chains it to what it raises (its traceback is kept)."""
    mine: Problem = None if problem is None else (type(problem), str(problem))
    gathered = communicator(group).all_gather_object((mine, payload))
    try:
        raise_agreed([p for p, _ in gathered])
    except Exception as agreed:
        if problem is not None:
            raise agreed from problem
        raise
    return [payload for _, payload in gathered]


def raise_agreed(problems: list[Problem]) -> None:
    """Raise the first rank's problem, listing every faulty rank, on every rank."""
    faulty = [(rank, p) for rank, p in enumerate(problems) if p is not None]
    if not faulty:
        return
    kind, _ = faulty[0][1]
    message = "; ".join(f"rank {rank}: {msg}" for rank, (_, msg) in faulty)
    try:
        error = kind(message)
    except Exception:  # an exception type that wants other arguments
        error = ShardwiseError(message)
    raise error


def odd_ranks(values: list[Any]) -> tuple[int, list[int]]:
    """(a rank holding the most common value, the ranks whose value differs from it).

    The majority is taken as right so that the message names the rank that
    stands out; a tie goes to the lowest rank's value. `values` must be hashable.
    """
    counts = Counter(values)
    ref = min(range(len(values)), key=lambda r: (-counts[values[r]], r))
    return ref, [r for r, v in enumerate(values) if v != values[ref]]


def require_same(
    values: list[Any],
    what: str,
    *,
    shown: Callable[[Any], str] = repr,
    verb: str = "passed",
    fix: str = "every rank must pass the same",
) -> None:
    """Raise `ArgumentMismatchError` unless every rank's gathered value is the same.

    The one "ranks disagree" check: values are compared by `repr` (so lists and
    dicts work), the message names `what`, the ranks that differ from the
    majority and what they and the majority `verb` (as `shown`), and the `fix`.
    `values` came from one exchange, so every rank raises the same message.
    """
    ref, odd = odd_ranks([repr(v) for v in values])
    if odd:
        raise ArgumentMismatchError(
            f"ranks disagree on {what}: ranks {odd} {verb} {shown(values[odd[0]])}, "
            f"rank {ref} {verb} {shown(values[ref])}; {fix}"
        )


@dataclass(frozen=True)
class _Failed:
    """What a rank with a problem routes to every rank instead of its payloads."""

    kind: type
    message: str


def digest(value: Any) -> int:
    """63 bits of a hash of `value`'s repr (how `require_same` compares values)."""
    data = hashlib.blake2b(repr(value).encode(), digest_size=8).digest()
    return int.from_bytes(data, "little") >> 1


class Agreement:
    """One collective call's agreement, created at its API edge and carried through:
    every exchange the call makes goes through it, so a problem found on one rank
    at any step (kept with `defer` until the next exchange) is raised on every
    rank, the arguments every rank must pass alike are compared once (on the first
    exchange), and `exchanges` counts the call's collectives."""

    def __init__(self, comm: Communicator, arguments: tuple[str, Any] | None = None) -> None:
        self.comm = comm
        self.arguments = arguments  # (what they are, their value on this rank)
        self.exchanges = 0
        self._pending: BaseException | None = None

    @property
    def rank(self) -> int:
        return self.comm.rank

    @property
    def world_size(self) -> int:
        return self.comm.world_size

    @property
    def pending(self) -> BaseException | None:
        """This rank's problem kept for the next exchange, if any."""
        return self._pending

    def defer(self, problem: BaseException | None) -> None:
        """Keep this rank's `problem` (the first one) for the next exchange to raise."""
        if self._pending is None:
            self._pending = problem

    def exchange(self, payload: Any = None) -> list[Any]:
        """All-gather `payload`; raise on every rank if any rank had a problem, or (on
        the first exchange) passed different arguments."""
        problem, self._pending = self._pending, None
        if self.comm.world_size == 1:  # alone: the problem itself, its traceback and all
            if problem is not None:
                raise problem
            return [payload]
        first = self.exchanges == 0 and self.arguments is not None
        sent = (payload, self.arguments[1]) if first and self.arguments else (payload, None)
        everyone = exchange(problem, sent, self.comm)
        self.exchanges += 1
        if first and self.arguments is not None:
            require_same([a for _p, a in everyone], self.arguments[0])
        return [p for p, _a in everyone]

    def _take(self) -> BaseException | None:
        """This rank's pending problem, for an exchange other than the call's first
        (which compares the call's arguments: `exchange` only)."""
        alone = self.comm.world_size == 1
        assert self.exchanges or self.arguments is None or alone, "the first is `exchange`"
        problem, self._pending = self._pending, None
        self.exchanges += 1
        return problem

    def agree(self, values: list[int]) -> list[int]:
        """The element-wise maximum of every rank's `values`: a fixed-size exchange
        (one `all_reduce`), whatever the world size. A problem on any rank is raised on
        every rank; only then are the problems gathered, to name every faulty rank. As
        a call's first exchange it compares the call's arguments by a hash, gathering
        them only when they differ (to name the ranks that differ)."""
        first = self.exchanges == 0 and self.arguments is not None
        if self.comm.world_size == 1:
            self.exchange()  # raises this rank's problem, if any
            return list(values)
        mine = digest(self.arguments[1]) if first and self.arguments else 0
        problem = self._pending
        out = self.comm.all_reduce_max([int(problem is not None), mine, -mine, *values])
        if out[0] or out[1] != -out[2]:
            self.exchange()  # the slow path, on every rank: raises the problems or mismatch
        else:
            self._pending = None
            self.exchanges += 1
        return out[3:]

    def verdict(self) -> None:
        """Raise any rank's problem on every rank, or go on: one fixed-size `all_reduce`."""
        self.agree([])

    def route(self, objs: list[Any]) -> list[Any]:
        """`objs[r]` to rank r (one `all_to_all`): what each rank sent this one. Each
        rank receives only what is addressed to it; a rank with a problem sends it to
        every rank instead, and every rank raises them all."""
        problem = self._take()
        if self.comm.world_size == 1:
            if problem is not None:
                raise problem
            return list(objs)
        if problem is not None:
            objs = [_Failed(type(problem), str(problem))] * self.comm.world_size
        got = self.comm.all_to_all_object(objs)
        failed = [(o.kind, o.message) if isinstance(o, _Failed) else None for o in got]
        try:
            raise_agreed(failed)
        except Exception as agreed:
            if problem is not None:
                raise agreed from problem
            raise
        return got
