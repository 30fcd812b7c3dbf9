"""Conversions with PyTorch's sharded types: DTensor (with or without
LocalShardsWrapper inside) and the legacy `torch.distributed._shard` ShardedTensor.

Shard data is never copied: the ShardedTensor holds the very local tensors
of its source, and `to_dtensor` hands its shard to `DTensor.from_local`.

`from_dtensor` (and `from_shard_tensor`, which shares its machinery) is
collective, as every entry point of `shardwise.comm`: each rank inspects its
own value, then one `all_gather_object` of metadata lets every rank check the
global layout and raise the same error, naming the faulty rank, or none. A
rank that raised alone (an unevenly built DTensor, a value of another kind)
would leave the others waiting in their next collective.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._shards_wrapper import LocalShardsWrapper
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from ..comm.agreement import Problem, exchange, odd_ranks, raise_agreed
from ..comm.build import _from_local_shards
from ..errors import LayoutError
from ..layout import Block, Layout
from ..tensor import ShardedTensor

__all__ = ["from_dtensor", "from_torch_sharded_tensor", "to_dtensor"]

DTENSOR = "a DTensor"
WRAPPED = "a DTensor over LocalShardsWrapper"
SHARD_TENSOR = "a PhysicsNeMo ShardTensor"


def _mesh_position(mesh: Any) -> int:
    """This rank's row-major position in `mesh`, which must list the world's ranks in order."""
    ranks = mesh.mesh.flatten().tolist()
    if ranks != list(range(dist.get_world_size())):
        raise LayoutError(
            f"the device mesh lists ranks {ranks}; shardwise maps mesh positions to "
            f"ranks of the default group, so the mesh must hold ranks 0..N-1 in order"
        )
    return dist.get_rank()


@dataclass
class Inspection:
    """One rank's view of its value before the ranks compare notes.

    `meta` is exchanged (picklable, small): `kind`, `key` (what every rank must
    agree on: mesh shape, placements, global shape), `dtype`, `device`, plus
    what `finish` needs from the other ranks. `finish(everyone)` runs on every
    rank once all agree and builds the ShardedTensor (it may raise, but only
    from data identical on every rank, so identically everywhere).
    """

    meta: dict[str, Any]
    finish: Callable[[list[dict[str, Any]]], ShardedTensor]
    check: Callable[[list[dict[str, Any]]], list[Problem]] | None = None


def is_shard_tensor(value: Any) -> bool:
    """True for a PhysicsNeMo ShardTensor; never imports PhysicsNeMo (without it
    loaded, no value can be one)."""
    module = sys.modules.get("physicsnemo.domain_parallel.shard_tensor")
    return module is not None and isinstance(value, module.ShardTensor)


def _kind(value: Any) -> str:
    if is_shard_tensor(value):
        return SHARD_TENSOR
    if isinstance(value, DTensor):
        return WRAPPED if isinstance(value._local_tensor, LocalShardsWrapper) else DTENSOR
    return "None" if value is None else f"a {type(value).__module__}.{type(value).__name__}"


def convert_agreed(value: Any, accepted: Sequence[str], entry: str, takes: str) -> ShardedTensor:
    """Inspect `value` locally, exchange once, check the global picture, build.

    `accepted` lists the kinds `entry` (the public function's name) takes,
    `takes` says so in words; any other value is refused with a TypeError on
    every rank.
    """
    problem: BaseException | None = None
    inspection: Inspection | None = None
    kind = _kind(value)
    try:
        if kind not in accepted:
            raise TypeError(f"{entry} takes {takes}, got {kind}")
        inspection = _inspect(value, kind)
    except Exception as e:  # whatever fails here must reach the exchange, not skip it
        problem = e
    meta = inspection.meta if inspection is not None else None
    if dist.is_available() and dist.is_initialized():
        everyone = exchange(problem, meta, None)
    else:
        raise_agreed([None if problem is None else (type(problem), str(problem))])
        everyone = [meta]
    raise_agreed(_disagreements(everyone))
    assert inspection is not None  # any rank's problem was raised above
    if inspection.check is not None:
        raise_agreed(inspection.check(everyone))
    return inspection.finish(everyone)


def _inspect(value: Any, kind: str) -> Inspection:
    if kind == SHARD_TENSOR:
        from .physicsnemo import inspect_shard_tensor

        return inspect_shard_tensor(value)
    if kind == WRAPPED:
        return _inspect_wrapped(value)
    return _inspect_dtensor(value)


def _disagreements(everyone: list[dict[str, Any]]) -> list[Problem]:
    """Each rank's disagreement with the majority (identical on every rank)."""
    problems: list[Problem] = [None] * len(everyone)

    def flag(field: str, kind: type, what: Callable[[Any], str]) -> None:
        ref, odd = odd_ranks([m[field] for m in everyone])
        for r in odd:
            if problems[r] is None:
                mine, theirs = what(everyone[r][field]), what(everyone[ref][field])
                problems[r] = (
                    kind,
                    f"it passed {mine} but rank {ref} passed {theirs}; every rank must pass the same",
                )

    flag("kind", TypeError, str)
    if any(problems):
        return problems  # the other fields mean nothing across kinds
    flag("key", LayoutError, _words)
    flag("dtype", TypeError, lambda d: f"a {d} value")
    flag("device", LayoutError, lambda d: f"a value on {d}")
    return problems


def _words(key: tuple[Any, ...]) -> str:
    mesh, placements, shape = key
    if mesh is None:
        return f"a value of global shape {shape}"
    return f"placements {placements} on a mesh of shape {mesh} with global shape {shape}"


def _base_meta(value: Any, kind: str) -> dict[str, Any]:
    mesh = value.device_mesh
    key = (tuple(mesh.shape), str(tuple(value.placements)), tuple(value.shape))
    return {"kind": kind, "key": key, "dtype": str(value.dtype), "device": value.device.type}


def _inspect_dtensor(dt: DTensor) -> Inspection:
    """A plain DTensor: its layout follows from mesh, placements and shape; the
    local tensor must be what they give (DTensors built unevenly are refused)."""
    position = _mesh_position(dt.device_mesh)
    local = dt._local_tensor
    layout = Layout.from_dtensor_spec(dt.device_mesh.shape, dt.placements, tuple(dt.shape))
    blocks = layout.blocks_of(position)
    expected = blocks[0].sizes if blocks else None
    if expected is not None and tuple(local.shape) != expected:
        raise LayoutError(
            f"its DTensor's local tensor has shape {tuple(local.shape)} but its placements "
            f"{tuple(dt.placements)} give {expected} (torch.chunk sizes); an unevenly built "
            f"DTensor has no layout shardwise can trust (for uneven pieces use "
            f"sw.from_local(local, dim, sharding_shapes='infer'))"
        )
    if expected is None and local.numel():
        raise LayoutError(
            f"its DTensor's placements give it no element but its local tensor has shape "
            f"{tuple(local.shape)}; an unevenly built DTensor has no layout shardwise can trust"
        )

    def finish(everyone: list[dict[str, Any]]) -> ShardedTensor:
        return ShardedTensor(
            layout, [local] if blocks else [], position, dtype=dt.dtype, device=local.device
        )

    return Inspection(_base_meta(dt, DTENSOR), finish)


def _inspect_wrapped(dt: DTensor) -> Inspection:
    """A DTensor over LocalShardsWrapper: only the wrappers know the blocks, so
    `from_local_shards` learns them (a second exchange, on every rank alike)."""
    _mesh_position(dt.device_mesh)
    local = dt._local_tensor
    shards = local.local_shards()
    # an empty wrapper reports one fake chunk
    offsets = [tuple(o) for o in local.local_offsets()] if shards else []
    meta = _base_meta(dt, WRAPPED)
    meta["key"] = (None, None, meta["key"][2])  # placements say nothing about the blocks here

    def finish(everyone: list[dict[str, Any]]) -> ShardedTensor:
        return _from_local_shards(shards, offsets, tuple(dt.shape), None)

    return Inspection(meta, finish)


def from_dtensor(dt: DTensor) -> ShardedTensor:
    """The same data as a ShardedTensor, sharing the local tensor(s). Collective.

    Takes a DTensor (any Shard / Replicate placements, evenly built, or over
    LocalShardsWrapper) or a PhysicsNeMo ShardTensor (see `from_shard_tensor`).
    The ranks exchange their metadata once and check the global layout: an
    unevenly built DTensor, ranks passing different meshes, placements, shapes
    or dtypes, or a value of another type raise the same error on every rank,
    naming the faulty rank.
    """
    return convert_agreed(
        dt,
        (DTENSOR, WRAPPED, SHARD_TENSOR),
        "from_dtensor",
        "a DTensor (plain or over LocalShardsWrapper) or a PhysicsNeMo ShardTensor",
    )


def to_dtensor(st: ShardedTensor, mesh: Any, placements: Sequence[Any]) -> DTensor:
    """A DTensor over `mesh` sharing this rank's shard; the layout must be what
    `placements` produce (`Layout.from_dtensor_spec`), otherwise `LayoutError`."""
    expected = Layout.from_dtensor_spec(mesh.shape, placements, tuple(st.shape))
    if expected != st.layout_spec:
        raise LayoutError(
            f"{st.layout_spec} cannot be expressed as placements {tuple(placements)} on a "
            f"mesh of shape {tuple(mesh.shape)} (they give {expected}); redistribute first"
        )
    _mesh_position(mesh)
    shards = st.local_shards()
    if shards:
        local = shards[0]
    else:
        sizes, _ = compute_local_shape_and_global_offset(st.shape, mesh, placements)
        local = torch.empty(sizes, dtype=st.dtype, device=st.device)
    return DTensor.from_local(
        local, mesh, placements, run_check=False, shape=st.shape, stride=contiguous_stride(st.shape)
    )


def contiguous_stride(shape: Sequence[int]) -> tuple[int, ...]:
    stride, acc = [], 1
    for s in reversed(tuple(shape)):
        stride.append(acc)
        acc *= max(s, 1)
    return tuple(reversed(stride))


def from_torch_sharded_tensor(legacy: Any) -> ShardedTensor:
    """The legacy `torch.distributed._shard` ShardedTensor as a ShardedTensor.

    Its global metadata already lists every shard's rank, so no communication.
    """
    md = legacy.metadata()
    group = getattr(legacy, "_process_group", None)
    blocks: dict[int, list[Block]] = {}
    for shard_md in md.shards_metadata:
        rank = shard_md.placement.rank()
        blocks.setdefault(rank, []).append(Block(shard_md.shard_offsets, shard_md.shard_sizes))
    world = dist.get_world_size(group)
    layout = Layout(tuple(md.size), blocks, world)
    rank = dist.get_rank(group)
    by_offset = {tuple(s.metadata.shard_offsets): s.tensor for s in legacy.local_shards()}
    shards = [by_offset[b.offsets] for b in layout.blocks_of(rank)]
    device = shards[0].device if shards else torch.device("cpu")
    return ShardedTensor(
        layout, shards, rank, dtype=md.tensor_properties.dtype, device=device, group=group
    )
