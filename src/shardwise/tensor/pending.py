"""A reduction whose combine across ranks has not run yet (DTensor's `Partial`).

A sum along a sharded dimension leaves each rank a part of the result: the
value is the sum (or maximum, minimum) of the ranks' parts. DTensor returns
such a result as `Partial` and combines it only when it is used, so a loss
that is only differentiated, or a weight gradient that is accumulated and
then applied, costs no collective at the reduction itself. A `ShardedTensor`
does the same: its `_pending` holds the parts and, once combined, the result.

The record is shared by the tensor and its aliases (`detach`, `alias`), so the
combine runs once for all of them, and it never writes into the parts (a view
of a part taken before the combine keeps its values).
"""

from __future__ import annotations

import torch

__all__ = ["Pending"]

# the combines a pending result can wait for, by DTensor's `Partial(reduce_op)` names
REDUCE_OPS = ("sum", "max", "min")


class Pending:
    """This rank's parts of a result, combined across the group by `op` on first use."""

    __slots__ = ("op", "parts", "combined")

    def __init__(self, op: str, parts: list[torch.Tensor]) -> None:
        self.op = op
        self.parts = parts
        # the combined shards once some holder of the record has used the value
        self.combined: list[torch.Tensor] | None = None

    def __repr__(self) -> str:
        state = "combined" if self.combined is not None else "not combined"
        return f"Pending({self.op!r}, {state})"
