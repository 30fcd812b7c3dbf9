"""Moving a checkpoint's bytes: the chunk writer, ranged reads of stored boxes,
the commit protocol and the save lease.

Built on `storage.Folder` and `format`; knows nothing of state dicts or DCP's
planners.
"""
