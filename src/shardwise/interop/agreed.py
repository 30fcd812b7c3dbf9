"""What every conversion into a ShardedTensor shares: inspect locally, agree once.

Conversions are collective, as every entry point of `shardwise.comm`: each rank
inspects its own value, then one `all_gather_object` of metadata lets every
rank check the global layout and raise the same error, naming the faulty rank,
or none. A rank that raised alone (an unevenly built DTensor, a value of
another kind) would leave the others waiting in their next collective.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._shards_wrapper import LocalShardsWrapper

from ..comm.agreement import Problem, exchange, odd_ranks, raise_agreed
from ..comm.group import agreement_group, mesh_group, mesh_ranks
from ..comm.local import wrap_local
from ..errors import InvalidTypeError, LayoutError
from ..layout import Layout
from ..tensor import ShardedTensor

__all__ = [
    "DTENSOR",
    "SHARD_TENSOR",
    "WRAPPED",
    "Inspection",
    "base_meta",
    "convert_agreed",
    "is_shard_tensor",
    "kind_of",
    "mesh_position",
    "shared_local",
    "value_group",
]

DTENSOR = "a DTensor"
WRAPPED = "a DTensor over LocalShardsWrapper"
SHARD_TENSOR = "a PhysicsNeMo ShardTensor"


def mesh_position(mesh: Any) -> int:
    """This rank's row-major position in `mesh` (any mesh or sub-mesh it belongs to):
    its rank in the layout, and in the mesh's process group (`mesh_group`)."""
    ranks, me = mesh_ranks(mesh), dist.get_rank()
    if me not in ranks:
        raise LayoutError(
            f"rank {me} is not in the device mesh of ranks {ranks}; only the mesh's ranks "
            f"hold a piece of a tensor on it"
        )
    return ranks.index(me)


def value_group(value: Any) -> tuple[Any, Any]:
    """(process group, device mesh) of a DTensor / ShardTensor: its mesh's `mesh_group`;
    (None, None) for anything else (it then meets the others on the default group)."""
    if not (dist.is_available() and dist.is_initialized()):
        return None, None
    if is_shard_tensor(value):
        return mesh_group(value._spec.mesh), value._spec.mesh
    if isinstance(value, DTensor):
        return mesh_group(value.device_mesh), value.device_mesh
    return None, None


@dataclass
class Inspection:
    """One rank's view of its value before the ranks compare notes.

    `meta` is exchanged (picklable, small): `kind`, `key` (what every rank must
    agree on: mesh shape, placements, global shape), `dtype`, `device`, plus
    what `finish` needs from the other ranks. `finish(everyone, group, mesh)` runs
    on every rank once all agree and builds the ShardedTensor on the value's
    process group and mesh (it may raise, but only from data identical on every
    rank, so identically everywhere).
    """

    meta: dict[str, Any]
    finish: Callable[[list[dict[str, Any]], Any, Any], ShardedTensor]
    check: Callable[[list[dict[str, Any]]], list[Problem]] | None = None


def is_shard_tensor(value: Any) -> bool:
    """True for a PhysicsNeMo ShardTensor; never imports PhysicsNeMo (without it
    loaded, no value can be one)."""
    module = sys.modules.get("physicsnemo.domain_parallel.shard_tensor")
    return module is not None and isinstance(value, module.ShardTensor)


def kind_of(value: Any) -> str:
    if is_shard_tensor(value):
        return SHARD_TENSOR
    if isinstance(value, DTensor):
        return WRAPPED if isinstance(value._local_tensor, LocalShardsWrapper) else DTENSOR
    return "None" if value is None else f"a {type(value).__module__}.{type(value).__name__}"


def convert_agreed(
    value: Any,
    inspectors: Mapping[str, Callable[[Any], Inspection]],
    entry: str,
    takes: str,
) -> ShardedTensor:
    """Inspect `value` locally, exchange once, check the global picture, build.

    `inspectors` maps the kinds `entry` (the public function's name) takes to
    their inspection, `takes` says so in words; any other value is refused with
    an InvalidTypeError (a TypeError) on every rank.

    The exchange runs over the value's mesh's process group (the default group
    when the mesh spans every rank in order), so ranks on other sub-meshes
    convert their own tensors at the same time; a rank that passed no DTensor
    meets the others on the default group (on a sub-mesh it cannot know theirs).
    Per rank: one `all_gather_object` of a few hundred bytes over the mesh's ranks.
    """
    problem: BaseException | None = None
    inspection: Inspection | None = None
    kind = kind_of(value)
    group = mesh = None
    try:
        group, mesh = value_group(value)
        if kind not in inspectors:
            raise InvalidTypeError(f"{entry} takes {takes}, got {kind}")
        inspection = inspectors[kind](value)
    except Exception as e:  # whatever fails here must reach the exchange, not skip it
        problem = e
    meta = inspection.meta if inspection is not None else None
    if dist.is_available() and dist.is_initialized():
        everyone = exchange(problem, meta, agreement_group(group))
    else:
        raise_agreed([None if problem is None else (type(problem), str(problem))])
        everyone = [meta]
    raise_agreed(_disagreements(everyone))
    assert inspection is not None  # any rank's problem was raised above
    if inspection.check is not None:
        raise_agreed(inspection.check(everyone))
    return inspection.finish(everyone, group, mesh)


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
                    f"it passed {mine} but rank {ref} passed {theirs}; every rank must pass the "
                    "same",
                )

    flag("kind", InvalidTypeError, str)
    if any(problems):
        return problems  # the other fields mean nothing across kinds
    flag("key", LayoutError, _words)
    flag("dtype", InvalidTypeError, lambda d: f"a {d} value")
    flag("device", LayoutError, lambda d: f"a value on {d}")
    return problems


def _words(key: tuple[Any, ...]) -> str:
    mesh, placements, shape = key
    if mesh is None:
        return f"a value of global shape {shape}"
    return f"placements {placements} on a mesh of shape {mesh} with global shape {shape}"


def base_meta(value: Any, kind: str) -> dict[str, Any]:
    mesh = value.device_mesh
    key = (tuple(mesh.shape), str(tuple(value.placements)), tuple(value.shape))
    return {"kind": kind, "key": key, "dtype": str(value.dtype), "device": value.device.type}


def shared_local(value: Any, layout: Layout, rank: int, group: Any, mesh: Any) -> ShardedTensor:
    """`value`'s (a DTensor's, a ShardTensor's) very local tensor as this rank's block.

    A non-leaf value (the result of an op in an autograd graph) goes through its
    own differentiable `to_local()`, so gradients reach its graph as its library
    routes them; the shard is still a view of the same memory. A leaf is shared
    as is (a parameter stays a parameter, filled in place by checkpoint loads)."""
    local = value._local_tensor
    if value.grad_fn is not None and torch.is_grad_enabled():
        return wrap_local(value.to_local(), layout, rank, group, mesh)
    shards = [local] if layout.blocks_of(rank) else []
    return ShardedTensor(
        layout, shards, rank, dtype=value.dtype, device=local.device, group=group, mesh=mesh
    )
