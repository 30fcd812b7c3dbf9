"""Every exception shardwise raises on purpose, in one place.

Hierarchy::

    ShardwiseError                  base of everything below
    ├── LayoutError                 (ValueError) a block or layout breaks a geometric rule
    ├── ShardMismatchError          (ValueError) local shards disagree with their layout
    │   └── SingleShardError        (NotImplementedError) ... in number, for a call that
    │                                            takes exactly one (`local_tensor()`), as the
    │                                            legacy API raises it
    ├── ShardCountError             (RuntimeError) legacy shards and the global metadata
    │                                            given with them differ in count (legacy's
    │                                            RuntimeError; not a ValueError, which legacy
    │                                            raises for other problems of the same call)
    ├── CheckpointMismatchError     (ValueError) state dict and checkpoint disagree:
    │                                            keys, shapes, dtypes
    ├── ArgumentMismatchError       (ValueError) ranks of one collective call passed
    │                                            different arguments or hold different values
    ├── InvalidArgumentError        (ValueError) an argument value no rule above covers:
    │                                            a rank outside the group, an unknown mode
    ├── InvalidTypeError            (TypeError) an argument of a type the call does not take
    ├── UsageError                  (RuntimeError) a call its contract rules out here: a
    │                                            DCP storage method out of order, an
    │                                            existing checkpoint under DCP's overwrite=False
    ├── RankFailureError            (RuntimeError) ranks spawned by `testing.run_ranks`
    │   │                                        died without a result
    │   ├── RankTimeoutError        (TimeoutError) ... or did not finish in time
    │   └── testing.RanksFailed     ... or raised (`errors` maps rank to exception)
    ├── CorruptCheckpointError      (OSError) stored bytes fail their checksum
    ├── IncompleteCheckpointError   (OSError) a checkpoint whose commit never finished
    ├── CheckpointBusyError         (OSError) another save of the same path holds its lease
    ├── CheckpointExistsError       (FileExistsError) a save, conversion or reshard would
    │                                            replace a checkpoint (or a file in its
    │                                            way) without overwrite=True
    ├── CheckpointNotFoundError     (FileNotFoundError) no checkpoint at the path read
    ├── UnsafeMetadataError         (pickle.UnpicklingError) a stock `.metadata` pickle
    │                                            names a global DCP writers never store,
    │                                            or a stored object `weights_only` refuses
    └── UnsupportedStorageError     (ValueError) a location no installed storage backend
                                                 serves (a URL scheme, a URL missing '//'),
                                                 or a stream extension no registry knows

`except shardwise.ShardwiseError` catches every failure of shardwise's own rules
and of the data it reads. Subclassing the builtin that a caller would naturally
catch (``ValueError`` for bad geometry, ``OSError`` for damaged files,
``pickle.UnpicklingError`` for a refused pickle) keeps ``except ValueError`` and
friends working for code that predates the tree.

Left as builtins on purpose, as every mapping does: ``KeyError`` / ``IndexError``
for a lookup that misses (a checkpoint key, a rank, an op that `unregister_op`
does not know), ``AttributeError`` for writing to a frozen value,
``NotImplementedError`` for an op shardwise does not run, and the file system's
own ``FileExistsError`` from an exclusive create.

`testing.RanksFailed` lives with the harness that raises it, beside
`testing.RankFailure`, which stands in for a rank's exception that could not be
pickled back. Two ShardwiseErrors never reach a caller, so they live beside what
raises them:
``FieldError`` (a malformed `shardwise.json` field, `checkpoint.format.field_table`)
and ``ArchiveError`` (a `torch.save` record that is not one plain tensor,
`checkpoint.format.zip_format`). Both are ``ValueError``s, caught by their readers
and raised again as ``CorruptCheckpointError`` naming the file.

The two checkpoint-damage errors carry ``problems``: every problem found, one
line each (``verify`` lists them all; elsewhere it is the message alone).
"""

from __future__ import annotations

import pickle
from collections.abc import Sequence

__all__ = [
    "ArgumentMismatchError",
    "CheckpointBusyError",
    "CheckpointExistsError",
    "CheckpointMismatchError",
    "CheckpointNotFoundError",
    "CorruptCheckpointError",
    "IncompleteCheckpointError",
    "InvalidArgumentError",
    "InvalidTypeError",
    "LayoutError",
    "RankFailureError",
    "RankTimeoutError",
    "ShardCountError",
    "ShardMismatchError",
    "ShardwiseError",
    "SingleShardError",
    "UnsafeMetadataError",
    "UnsupportedStorageError",
    "UsageError",
]


class ShardwiseError(Exception):
    """Base class of every shardwise exception."""


class LayoutError(ShardwiseError, ValueError):
    """A block or layout breaks a rule: bounds, ndim, overlap or coverage."""


class ShardMismatchError(ShardwiseError, ValueError):
    """Local shards do not match the layout they claim (count, sizes, device)."""


class SingleShardError(ShardMismatchError, NotImplementedError):
    """A call that takes exactly one local shard (`local_tensor()`) found another number.

    Also a `NotImplementedError`, which legacy `torch.distributed._shard` code catches."""


class ShardCountError(ShardwiseError, RuntimeError):
    """A rank's legacy `Shard` objects and the global metadata given with them differ in count.

    A `RuntimeError` and not a `ValueError`, as legacy raises it: legacy code tells it
    apart from the constructor's ValueErrors (a shard's size, dtype, device)."""


class CheckpointMismatchError(ShardwiseError, ValueError):
    """A state dict and a checkpoint disagree: keys missing from the checkpoint, shapes, dtypes."""


class ArgumentMismatchError(ShardwiseError, ValueError):
    """Ranks of one collective call passed different arguments (a path, a flag, a layout)
    or hold different values where each must hold the same; raised alike on every rank,
    naming the ranks that differ from the majority (`comm.agreement.require_same`)."""


class InvalidArgumentError(ShardwiseError, ValueError):
    """An argument value out of range or unknown (a rank outside the group, a mode string,
    a format name) that no more specific error above describes."""


class InvalidTypeError(ShardwiseError, TypeError):
    """An argument of a type the call does not take (a dtype mix, a non-tensor where a
    tensor goes, a spec class it does not read)."""


class UsageError(ShardwiseError, RuntimeError):
    """A call its contract rules out in this state: a DCP storage method before the one
    it needs, a method whose implementation was never imported, a checkpoint already
    in place under DCP's `overwrite=False` (stock raises `RuntimeError` there)."""


class RankFailureError(ShardwiseError, RuntimeError):
    """Ranks spawned by `shardwise.testing.run_ranks` failed: one died without reporting a
    result (this class), hung (`RankTimeoutError`) or raised (`testing.RanksFailed`)."""


class RankTimeoutError(RankFailureError, TimeoutError):
    """Ranks spawned by `run_ranks` did not finish in time (a hang); all were killed."""


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


class CheckpointBusyError(ShardwiseError, OSError):
    """Another save of the same path is in flight: it holds the path's lease
    (`checkpoint.lease`). The message names the holder (host, pid, since when) and
    the fix: wait for it (`wait=` on `save`, `async_save`, `Writer`) or, if that
    process is gone for good, remove the lock file it names."""


class CheckpointExistsError(ShardwiseError, FileExistsError):
    """A save, conversion or reshard found a checkpoint (or a file, or a foreign
    `metadata.json`) where it would write, and was not told `overwrite=True`."""


class CheckpointNotFoundError(ShardwiseError, FileNotFoundError):
    """No checkpoint at the path read. A `FileNotFoundError`, which `dcp.load` relies
    on: `Reader.read_metadata()` raising it makes DCP retry per rank."""


class UnsafeMetadataError(ShardwiseError, pickle.UnpicklingError):
    """A stock DCP `.metadata` pickle names a global, or does something, DCP writers never do;
    or a stored object, loaded without `trust_objects=True`, names a global that
    `torch.load(weights_only=True)` refuses.

    Raised before the refused global is looked up, so nothing in the file ran.
    """


class UnsupportedStorageError(ShardwiseError, ValueError):
    """A location no installed storage backend serves: an unknown URL scheme, a backend
    whose package is missing (the message names the extra to install), `s3:/x`; or
    records written through a stream extension the reader's registry does not know."""
