"""Megatron-Core checkpoints: `read_common_state(path)` reads the common (non-tensor)
state of a checkpoint Megatron or `swc.save(..., megatron=True)` wrote, without
running pickled code. The adapters behind `swc.save`/`swc.load` are
`checkpoint.clients.megatron`'s.
"""

from .clients import read_common_state

__all__ = ["read_common_state"]
