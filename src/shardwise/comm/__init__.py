"""The only code that talks to a process group: build, gather, scatter, redistribute.

Every function here is collective over the tensor's group (every rank calls
it, in the same order) and raises the same error on every rank on bad input.
"""

from __future__ import annotations

from ..tensor.provided import provide
from .build import from_local_blocks, from_local_shards
from .collectives import distribute, equal, full_tensor, gather, redistribute
from .group import current_rank, resolve_group
from .local import from_local, to_local

provide(
    current_rank=current_rank,
    resolve_group=resolve_group,
    from_local_blocks=from_local_blocks,
    from_local_shards=from_local_shards,
    full_tensor=full_tensor,
    gather=gather,
    redistribute=redistribute,
    to_local=to_local,
)

__all__ = [
    "distribute",
    "equal",
    "from_local",
    "from_local_shards",
    "full_tensor",
    "gather",
    "redistribute",
    "to_local",
]
