"""What makes a checkpoint Megatron-Core's: its `metadata.json` and its common state.

Megatron's `dist_checkpointing.load` opens a DCP checkpoint whose folder holds
`metadata.json` naming the torch_dist backend, and finds its non-tensor state in
one object stored under `COMMON_STATE_KEY`; `read_common_state` reads that back
from either writer without unpickling code.
"""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import torch

from ...errors import CheckpointExistsError
from ...storage import LocalFolder
from ..offline.opening import open_checkpoint

__all__ = [
    "COMMON_STATE_KEY",
    "METADATA_JSON",
    "metadata_json_problem",
    "read_common_state",
    "write_metadata_json",
]

# Megatron's `ShardedObject("common_state", ..., (1,), (0,)).unique_key`: its non-tensor state.
COMMON_STATE_KEY = "common_state/shard_0_1"
METADATA_JSON = "metadata.json"
_BACKEND = {"sharded_backend": "torch_dist", "sharded_backend_version": 1}


def metadata_json_problem(path: Path) -> BaseException | None:
    """A `metadata.json` already in the folder that is not Megatron's torch_dist one,
    or a legacy `common.pt`, which both readers prefer to the new common state."""
    if (path / "common.pt").exists():
        return CheckpointExistsError(
            f"{path / 'common.pt'} exists (a legacy Megatron common state): Megatron and "
            f"read_common_state would read it instead of this save's; move it away first"
        )
    existing = path / METADATA_JSON
    if not existing.exists():
        return None
    try:
        same = json.loads(existing.read_text()) == _BACKEND
    except (OSError, ValueError):
        same = False
    return (
        None
        if same
        else CheckpointExistsError(
            f"{existing} exists and is not Megatron's torch_dist metadata: it would be overwritten"
        )
    )


def write_metadata_json(path: Path) -> None:
    """Megatron's `metadata.json` (what `verify_checkpoint` looks for), written durably."""
    if (path / METADATA_JSON).exists():
        return  # checked identical before the save
    path.mkdir(parents=True, exist_ok=True)
    LocalFolder(path).write_durably(METADATA_JSON, json.dumps(_BACKEND).encode())


def read_common_state(path: str | Path) -> Any:
    """Megatron's common (non-tensor) state of a checkpoint, read without running
    pickled code (`torch.load(weights_only=True)`, as Megatron itself does): from
    its common state object, or from a legacy `common.pt`."""
    path = Path(path)
    if (path / "common.pt").exists():
        return torch.load(path / "common.pt", map_location="cpu", weights_only=True)
    data = open_checkpoint(path).object_bytes(COMMON_STATE_KEY)
    return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)[0]
