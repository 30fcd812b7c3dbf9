"""Every exception shardwise raises, in one place.

Hierarchy::

    ShardwiseError                      base of everything below
    ├── LayoutError (ValueError)        a block or layout breaks a geometric rule
    ├── ShardMismatchError (ValueError) local shards disagree with their layout
    ├── CheckpointMismatchError (ValueError) state dict and checkpoint disagree (keys, shapes, dtypes)
    ├── CorruptCheckpointError          stored bytes fail their checksum
    └── IncompleteCheckpointError       a checkpoint whose commit never finished

Subclassing the builtin that a caller would naturally catch (``ValueError`` for
bad geometry) keeps ``except ValueError`` working for code that predates us.

The two checkpoint-damage errors carry ``problems``: every problem found, one
line each (``verify`` lists them all; elsewhere it is the message alone).
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = [
    "CheckpointMismatchError",
    "CorruptCheckpointError",
    "IncompleteCheckpointError",
    "LayoutError",
    "ShardMismatchError",
    "ShardwiseError",
]


class ShardwiseError(Exception):
    """Base class of every shardwise exception."""


class LayoutError(ShardwiseError, ValueError):
    """A block or layout breaks a rule: bounds, ndim, overlap or coverage."""


class ShardMismatchError(ShardwiseError, ValueError):
    """Local shards do not match the layout they claim (count, sizes, device)."""


class CheckpointMismatchError(ShardwiseError, ValueError):
    """A state dict and a checkpoint disagree: keys missing from the checkpoint, shapes, dtypes."""


class _ListsProblems(Exception):
    """An error that can report several problems at once, in `problems`."""

    problems: list[str]

    def __init__(self, *args: object, problems: Sequence[str] | None = None) -> None:
        super().__init__(*args)
        self.problems = list(problems) if problems is not None else [str(a) for a in args[:1]]


class CorruptCheckpointError(_ListsProblems, ShardwiseError, OSError):
    """Bytes read from a checkpoint do not match the checksum recorded for them."""


class IncompleteCheckpointError(_ListsProblems, ShardwiseError, OSError):
    """A checkpoint directory whose save never committed (no manifest)."""
