"""This process's place in a process group, checked against a layout."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from ..errors import ShardMismatchError
from ..layout import Layout
from .communicator import communicator

__all__ = ["current_rank"]


def current_rank(group: Any, layout: Layout) -> int:
    """This process's rank in `group` (or the default group), 0 without one."""
    if group is None and not (dist.is_available() and dist.is_initialized()):
        return 0
    comm = communicator(group)
    size = comm.world_size
    if size != layout.world_size:
        raise ShardMismatchError(
            f"the layout spans {layout.world_size} ranks but the process group has "
            f"{size}; build the layout for the group's world size"
        )
    return comm.rank
