"""Moving a checkpoint's bytes: the chunk writer, ranged reads of stored boxes,
the commit protocol and the save lease.

Built on `storage.Folder` and `format`; knows nothing of state dicts or DCP's
planners.
"""

from .chunks import ArchiveRead, ChunkRead, GatherRead, PendingChunk, words_of
from .commit import (
    commit,
    data_file_name,
    failpoint,
    in_the_way,
    index_file_name,
    leftover_data,
    new_token,
    per_rank_records,
    referenced_files,
)
from .device import Copier, DeviceCopier, HostCopier, slabs_for, staging_bytes
from .lease import Lease, live_scopes
from .read import ReadExecutor
from .write import DataFile, Written, record_bytes, write_archives

__all__ = [
    "ChunkRead",
    "Copier",
    "DataFile",
    "DeviceCopier",
    "GatherRead",
    "HostCopier",
    "Lease",
    "PendingChunk",
    "ReadExecutor",
    "ArchiveRead",
    "Written",
    "commit",
    "data_file_name",
    "failpoint",
    "in_the_way",
    "index_file_name",
    "leftover_data",
    "live_scopes",
    "new_token",
    "per_rank_records",
    "record_bytes",
    "referenced_files",
    "slabs_for",
    "staging_bytes",
    "words_of",
    "write_archives",
]
