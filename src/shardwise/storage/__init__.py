"""Where checkpoint bytes live: a local folder or any fsspec URL, behind one small interface.

`open_folder(location)` gives a `Folder`: the flat set of files of one
checkpoint, with the few operations the checkpoint layer needs (list, read a
range, write a new file, replace a record, remove). Local paths go straight
to the OS (`LocalFolder`: `pwritev`/`preadv`, `fsync`, `rename`); URLs go
through fsspec (`FsspecFolder`: ranged GETs, coalesced and issued
concurrently, whole-object PUTs). Which backend serves a scheme is a registry
(`register_backend`, or an entry point in the `shardwise.storage_backends`
group), so a third party adds one without editing shardwise. No process
group, no torch.distributed.
"""

from .folder import Folder, RandomAccess, Sink
from .local import LocalFolder
from .location import (
    BACKEND_EXTRAS,
    ENTRY_POINT_GROUP,
    BackendFactory,
    is_url,
    open_folder,
    register_backend,
    served_url,
    unregister_backend,
)
from .remote import FsspecFolder, SharedReads

__all__ = [
    "BACKEND_EXTRAS",
    "ENTRY_POINT_GROUP",
    "BackendFactory",
    "Folder",
    "FsspecFolder",
    "LocalFolder",
    "RandomAccess",
    "SharedReads",
    "Sink",
    "is_url",
    "open_folder",
    "register_backend",
    "served_url",
    "unregister_backend",
]
