"""Other libraries' values in checkpoints, one module per client, each registering
its `engine.inventory.ValueAdapter` on import: `dtensor` (DTensor and
`LocalShardsWrapper`, described in place), `physicsnemo` (ShardTensor),
`megatron` (Megatron-Core's values, and checkpoints Megatron opens) with
`clients.megatron` (its state dicts as `sharded_state_dict()` returns them).
"""

from . import dtensor, megatron, physicsnemo  # noqa: F401  (importing registers their adapters)
from .megatron import MEGATRON
from .megatron_format import metadata_json_problem, read_common_state, write_metadata_json

__all__ = [
    "MEGATRON",
    "metadata_json_problem",
    "read_common_state",
    "write_metadata_json",
]
