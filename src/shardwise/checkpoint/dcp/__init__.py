"""`Writer` and `Reader`: the engine under stock `dcp.save` / `dcp.load`, as a
DCP `StorageWriter` / `StorageReader`.
"""
