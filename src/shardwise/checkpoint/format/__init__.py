"""What a checkpoint is on disk: the manifest and its fields, `torch.save` records,
checksum tiles and pages, DCP's `.metadata`, and the safe reading of each.

Plain data and byte rules, no I/O scheduling and no process group: everything
above (`io`, `engine`, `dcp`, `offline`) reads and writes through these.
"""
