"""Snapshot a state dict into buffers kept between saves, for `async_save`.

The blocking part of an asynchronous save is this snapshot. Buffers are keyed
by the value's path in the state dict and reused while its shape and dtype
stay the same, so from the second save on the snapshot is a memcpy into warm
memory (pinned host memory for CUDA tensors), not an allocation per save.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._shards_wrapper import LocalShardsWrapper

from ..interop import from_torch_sharded_tensor
from ..tensor import ShardedTensor

__all__ = ["Stager"]


class Stager:
    """Copies state dicts into host buffers it owns. One per process is enough."""

    def __init__(self) -> None:
        self._buffers: dict[tuple[Any, ...], torch.Tensor] = {}

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self._buffers.values())

    def _copy(self, key: tuple[Any, ...], t: torch.Tensor) -> torch.Tensor:
        t = t.detach()
        buf = self._buffers.get(key)
        if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
            buf = torch.empty(t.shape, dtype=t.dtype, pin_memory=t.is_cuda)
            self._buffers[key] = buf
        buf.copy_(t, non_blocking=t.is_cuda)
        return buf

    def stage(self, state: Any, path: tuple[Any, ...] = ()) -> Any:
        """A copy of `state` whose tensors live in this stager's buffers."""
        if isinstance(state, dict):
            return {k: self.stage(v, path + (k,)) for k, v in state.items()}
        if isinstance(state, (list, tuple)) and not hasattr(state, "_fields"):
            return type(state)(self.stage(v, path + (i,)) for i, v in enumerate(state))
        if isinstance(state, ShardedTensor):
            shards = [self._copy(path + (i,), s) for i, s in enumerate(state.local_shards())]
            return ShardedTensor(
                state.layout_spec,
                shards,
                state.rank,
                dtype=state.dtype,
                device=torch.device("cpu"),
                group=state.group,
            )
        if isinstance(state, DTensor):
            local = state._local_tensor
            if isinstance(local, LocalShardsWrapper):
                shards = [self._copy(path + (i,), s) for i, s in enumerate(local.local_shards())]
                offsets = [tuple(o) for o in local.local_offsets()] if shards else []
                staged: torch.Tensor = LocalShardsWrapper(shards, offsets)
            else:
                staged = self._copy(path, local)
            return DTensor.from_local(
                staged,
                state.device_mesh,
                state.placements,
                run_check=False,
                shape=state.shape,
                stride=state.stride(),
            )
        if isinstance(state, torch.Tensor):
            if hasattr(state, "metadata") and hasattr(
                state, "local_shards"
            ):  # legacy ShardedTensor
                return self.stage(from_torch_sharded_tensor(state), path)
            return self._copy(path, state)
        return copy.deepcopy(state)

    def synchronize(self) -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
