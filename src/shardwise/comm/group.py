"""This process's place in a process group, and the group a tensor lives on.

A ShardedTensor belongs to a group: a `ProcessGroup` (None: the default group)
or a `DeviceMesh`, whole or a sub-mesh, of any dimension. Its layout's rank r
is the mesh's row-major position r and the group's rank r, so every
collective on it runs over a process group of exactly the mesh's ranks, in
that order (`resolve_group`), never over the world.
"""

from __future__ import annotations

import threading
from typing import Any

import torch
import torch.distributed as dist

from ..errors import LayoutError, ShardMismatchError
from ..layout import Layout
from .communicator import communicator

__all__ = [
    "agreement_group",
    "current_rank",
    "is_mesh",
    "mesh_group",
    "mesh_ranks",
    "resolve_group",
]


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


def is_mesh(value: Any) -> bool:
    """True for a torch `DeviceMesh` (duck-typed: its rank tensor and shape)."""
    return hasattr(value, "mesh") and hasattr(value, "get_coordinate") and hasattr(value, "shape")


def mesh_ranks(mesh: Any) -> list[int]:
    """The mesh's global ranks in row-major order (layout rank r is the r-th)."""
    return [int(r) for r in mesh.mesh.flatten().tolist()]


# Groups made for n-d (sub-)meshes, by (global ranks, device type), with the default
# group they were made under (a re-initialised world makes them anew).
_MESH_GROUPS: dict[tuple[tuple[int, ...], str], tuple[Any, Any]] = {}
_LOCK = threading.Lock()


def mesh_group(mesh: Any) -> Any:
    """The process group of exactly `mesh`'s ranks, group rank r = mesh position r.

    Collective over the mesh's ranks only, and only the first time for a set of
    ranks: a 1-d mesh gives its own group (`mesh.get_group()`, nothing made); a
    mesh of every rank in order gives the default group (None) where it has a
    backend for the mesh's device; any other mesh (an n-d sub-mesh, or ranks out
    of order) gets one group made with `new_group(ranks, use_local_synchronization=True)`,
    which the ranks outside the mesh never call (each rank calling for its own
    sub-mesh is fine), then kept. Per rank: one group creation (a store
    rendezvous of the mesh's ranks) per distinct set of ranks, then nothing.
    """
    ranks = mesh_ranks(mesh)
    if dist.get_rank() not in ranks:
        raise LayoutError(
            f"rank {dist.get_rank()} is not in the device mesh of ranks {ranks}; only the "
            f"mesh's ranks hold a tensor on it"
        )
    if mesh.ndim == 1:
        group = mesh.get_group()
        if list(dist.get_process_group_ranks(group)) == ranks:
            return group
    device = torch.device(mesh.device_type)
    world = dist.group.WORLD
    if ranks == list(range(dist.get_world_size())) and _has_backend(world, device):
        return None
    key = (tuple(ranks), mesh.device_type)
    with _LOCK:
        cached = _MESH_GROUPS.get(key)
        if cached is not None and cached[0] is world:
            return cached[1]
    order: dict[str, Any] = {} if ranks == sorted(ranks) else {"sort_ranks": False}
    group = dist.new_group(ranks, use_local_synchronization=True, **order)
    with _LOCK:
        _MESH_GROUPS[key] = (world, group)
    return group


def _has_backend(pg: Any, device: torch.device) -> bool:
    types = getattr(pg, "_device_types", None)
    return not types or torch.device(device.type) in types


def resolve_group(group: Any) -> tuple[Any, Any]:
    """(the process group collectives run on, the device mesh or None) for what a
    caller passed as `group`: a ProcessGroup or None (the default group), or a
    DeviceMesh / sub-mesh (its `mesh_group`). Collective as `mesh_group` is."""
    if is_mesh(group):
        return mesh_group(group), group
    return group, None


def agreement_group(group: Any) -> Any:
    """The group a conversion's agreement exchange runs on: `group`, or the default
    group (None) when `group` spans every rank in order, so that a rank that passed
    no sharded value (and so knows no group) still meets the others there."""
    if group is None or not (dist.is_available() and dist.is_initialized()):
        return None
    if list(dist.get_process_group_ranks(group)) == list(range(dist.get_world_size())):
        return None
    return group
