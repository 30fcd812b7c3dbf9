"""Layout math: blocks, layouts, builders, JSON and transfer planning.

Pure integer geometry. Nothing here imports `torch.distributed` or touches a
process group, so every function can be tested for thousands of ranks in one
process.
"""

from __future__ import annotations

from .block import Block, overlap
from .layout import Layout
from .transfers import BlockIndex, Transfer, plan_transfers

__all__ = ["Block", "BlockIndex", "Layout", "Transfer", "overlap", "plan_transfers"]
