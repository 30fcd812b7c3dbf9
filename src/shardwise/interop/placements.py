"""DTensor's surface on a ShardedTensor whose layout placements express.

A layout is expressible on a mesh when some `Shard(d)` / `Replicate()` per mesh
dimension produce it: `Shard(d)` with any (uneven, zero) piece sizes, as
PhysicsNeMo's ShardTensor allows, or DTensor's nested `torch.chunk` sharding of
one tensor dimension by several mesh dimensions. Then a ShardedTensor has
DTensor's `device_mesh`, `placements`, `redistribute(mesh, placements)`,
`to_local(grad_placements=)`, `full_tensor(grad_placements=)`,
`ShardedTensor.from_local(local, mesh, placements, sharding_shapes=)` and
PhysicsNeMo's `offsets()`. Finding the placements is pure integer math on the
layout (cached); only `from_local` with `sharding_shapes="infer"` and the
collectives behind `redistribute` / `full_tensor` communicate.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from functools import lru_cache
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard

from ..comm import from_local as from_local_layout
from ..comm import redistribute
from ..comm.agreement import Problem, exchange, odd_ranks, raise_agreed
from ..comm.group import agreement_group, is_mesh, mesh_group, mesh_ranks
from ..comm.local import GradPlan, wrap_local
from ..errors import InvalidArgumentError, InvalidTypeError, LayoutError, UsageError
from ..layout import Layout
from ..layout.layout import _chunk_sizes, mesh_coordinates
from ..tensor import ShardedTensor
from .agreed import mesh_position
from .physicsnemo import _expresses, _grid_layout, _grid_sizes, _sharded_dims
from .scatter import ShardingShapes, _sizes

__all__ = [
    "device_mesh",
    "from_local",
    "from_local_placements",
    "grad_plan",
    "mesh_offsets",
    "placements_of",
    "redistribute_placements",
]


# -- which placements express a layout ------------------------------------------


def _normalized(placements: Sequence[Any], ndim: int) -> tuple[Any, ...]:
    """Shard(-1) as Shard(ndim - 1), as DTensor stores it; others as they are."""
    out = []
    for p in placements:
        if p.is_shard() and type(p) is Shard and p.dim < 0 and ndim:
            p = Shard(p.dim + ndim)
        out.append(p)
    return tuple(out)


def _layout_for(placements: tuple[Any, ...], mesh_shape: tuple[int, ...], layout: Layout) -> bool:
    """True when `placements` on a mesh of `mesh_shape` give `layout` (any piece sizes
    for distinct sharded dimensions; torch.chunk sizes where one dimension is nested)."""
    shape = layout.global_shape
    dims = [p.dim for p in placements if p.is_shard()]
    try:
        if len(dims) != len(set(dims)):
            return Layout.from_dtensor_spec(mesh_shape, placements, shape) == layout
        sharded = _sharded_dims(placements, len(shape))
    except LayoutError:
        return False
    return _expresses(layout, mesh_shape, sharded, _grid_sizes(layout, mesh_shape, sharded))


@lru_cache(maxsize=256)
def _search(
    layout: Layout, mesh_shape: tuple[int, ...], hint: tuple[Any, ...] | None
) -> tuple[Any, ...] | None:
    if hint is not None and len(hint) == len(mesh_shape) and _layout_for(hint, mesh_shape, layout):
        return hint
    choices = [Replicate()] + [Shard(d) for d in range(layout.ndim)]
    # Replicate first, then the lowest dimension: the simplest answer where several fit
    # (a mesh dimension of size 1 both replicates and shards).
    for candidate in itertools.product(choices, repeat=len(mesh_shape)):
        if _layout_for(candidate, mesh_shape, layout):
            return candidate
    return None


def placements_of(
    layout: Layout, mesh_shape: tuple[int, ...], hint: tuple[Any, ...] | None = None
) -> tuple[Any, ...]:
    """The placements that give `layout` on a mesh of `mesh_shape` (`hint` first, when it
    does), else `LayoutError` naming the layout. Pure; cached per (layout, mesh shape);
    tries at most (ndim + 1) ** mesh ndim candidates, each O(world size)."""
    if math.prod(mesh_shape) != layout.world_size:
        raise LayoutError(
            f"a mesh of shape {mesh_shape} has {math.prod(mesh_shape)} ranks but {layout} spans "
            f"{layout.world_size}"
        )
    found = _search(layout, mesh_shape, hint)
    if found is None:
        raise LayoutError(
            f"{layout} cannot be expressed as placements on a mesh of shape {mesh_shape}: no "
            f"Shard(dim) / Replicate() per mesh dimension gives its blocks (several blocks per "
            f"rank, holes, or pieces that are no grid); redistribute to such a layout first"
        )
    return found


def placements(st: ShardedTensor) -> tuple[Any, ...]:
    """`st.placements`: those of its layout on its mesh. A reduction's result not combined
    yet is `Replicate()`, the placement of its values, which every API returns
    (`to_local()` combines it; `st.pending_reduce` tells the state)."""
    return placements_of(st.layout_spec, st.mesh_shape, st._placements)


def mesh_offsets(st: ShardedTensor) -> tuple[int, ...]:
    """`st.offsets()`: per mesh dimension, this rank's offset along the tensor dimension
    it shards, 0 where it replicates (PhysicsNeMo's `ShardTensor.offsets`)."""
    found, mesh_shape = placements(st), st.mesh_shape
    try:
        sharded = _sharded_dims(found, st.dim())
    except LayoutError as e:
        raise LayoutError(
            f"{st.layout_spec} has placements {found} on a mesh of shape {mesh_shape}, one "
            f"tensor dimension sharded by several mesh dimensions: no per-mesh-dimension "
            f"offsets ({e}); st.local_offsets() gives its block offsets"
        ) from None
    sizes = _grid_sizes(st.layout_spec, mesh_shape, sharded)
    coords = mesh_coordinates(st.rank, mesh_shape)
    return tuple(sum(sizes[m][: coords[m]]) if m in sharded else 0 for m in range(len(mesh_shape)))


def device_mesh(st: ShardedTensor) -> Any:
    """`st.device_mesh`: its mesh, else a 1-d mesh over its process group (made once,
    no communication)."""
    if st._mesh is None:
        if not (dist.is_available() and dist.is_initialized()):
            raise UsageError(
                "this ShardedTensor has no device mesh and there is no process group to make "
                "one over; initialise torch.distributed, or build it on a DeviceMesh"
            )
        group: Any = st.group if st.group is not None else dist.group.WORLD
        st._mesh = DeviceMesh.from_group(group, st.device.type)
    return st._mesh


# -- redistribute, grad_placements -------------------------------------------------


def _target_mesh(st: ShardedTensor, mesh: Any) -> Any:
    """`mesh`, checked to hold exactly `st`'s ranks in order (None: st's own mesh)."""
    own = device_mesh(st)
    if mesh is None or mesh is own:
        return own
    if not is_mesh(mesh):
        raise InvalidTypeError(f"expected a DeviceMesh, got a {type(mesh).__name__}")
    if mesh_ranks(mesh) != mesh_ranks(own):
        raise LayoutError(
            f"the tensor lives on a mesh of ranks {mesh_ranks(own)} but the target mesh holds "
            f"ranks {mesh_ranks(mesh)}; a ShardedTensor moves between placements on one set "
            f"of ranks (the mesh may be reshaped over them)"
        )
    return mesh


def _block_placements(
    given: Sequence[Any] | None, mesh: Any, ndim: int, what: str
) -> tuple[Any, ...]:
    """`given` (None: all Replicate) normalised, one per mesh dimension, no Partial."""
    if given is None:
        return (Replicate(),) * mesh.ndim
    found = _normalized(tuple(given), ndim)
    if len(found) != mesh.ndim:
        raise LayoutError(f"{len(found)} {what} for a {mesh.ndim}-d mesh {tuple(mesh.shape)}")
    for p in found:
        if p.is_partial():
            raise LayoutError(
                f"{what} {found} hold a Partial: a ShardedTensor holds a pending sum only as a "
                f"reduction's result, never by redistribute; use Replicate() or Shard(d)"
            )
    return found


def _layout_of(st: ShardedTensor, target: tuple[Any, ...], mesh_shape: tuple[int, ...]) -> Layout:
    """The layout `target` gives `st`: its own where its placements are `target` on a
    mesh of the same shape (uneven pieces kept, as PhysicsNeMo), else DTensor's
    torch.chunk pieces."""
    if mesh_shape == st.mesh_shape and _layout_for(target, mesh_shape, st.layout_spec):
        return st.layout_spec
    return Layout.from_dtensor_spec(mesh_shape, target, tuple(st.shape))


def redistribute_placements(
    st: ShardedTensor,
    mesh: Any = None,
    target: Sequence[Any] | None = None,
    *,
    async_op: bool = False,
) -> ShardedTensor:
    """`st.redistribute(device_mesh, placements)`: the same values with `placements` on
    `mesh` (None: its own; the same ranks, maybe another shape). Collective, one
    plan-driven move (`shardwise.redistribute`); differentiable. `Shard(-1)` is
    accepted; even targets take DTensor's torch.chunk sizes, the tensor's own
    placements keep its (uneven) sizes. With `async_op` it returns once the
    messages are posted; the first read of the result waits for them."""
    mesh = _target_mesh(st, mesh)
    if target is None:
        target = st.placements  # DTensor: placements default to the current ones
    found = _block_placements(target, mesh, st.dim(), "placements")
    shape = tuple(int(n) for n in mesh.shape)
    layout = _layout_of(st, found, shape)
    out = redistribute(st, layout, async_op=async_op)
    out._mesh, out._placements = mesh, found
    return out


def grad_plan(st: ShardedTensor, grad_placements: Sequence[Any]) -> GradPlan:
    """What `to_local(grad_placements=...)`'s backward does, as DTensor: the local
    gradient is a piece of a tensor with `grad_placements` on the tensor's mesh;
    `Partial()` on a mesh dimension means the ranks along it hold addends, summed
    (one all_reduce per Partial dimension, over that dimension's group) before the
    gradient is moved to the tensor's own layout (no move where the placements are
    its own)."""
    mesh = device_mesh(st)
    given = _normalized(tuple(grad_placements), st.dim())
    if len(given) != mesh.ndim:
        raise LayoutError(
            f"{len(given)} grad_placements for a {mesh.ndim}-d mesh {tuple(mesh.shape)}"
        )
    partial = [m for m, p in enumerate(given) if p.is_partial()]
    for p in given:
        if p.is_partial() and getattr(p, "reduce_op", "sum") != "sum":
            raise LayoutError(f"grad_placements {given}: only Partial('sum') gradients add up")
    filled = tuple(Replicate() if p.is_partial() else p for p in given)
    layout = _layout_of(st, filled, st.mesh_shape)
    groups = tuple(mesh.get_group(m) if mesh.ndim > 1 else mesh.get_group() for m in partial)
    return GradPlan(layout, groups)


# -- from_local with a mesh and placements -------------------------------------------


def from_local_placements(
    local: torch.Tensor,
    mesh: Any,
    given: Sequence[Any] | None = None,
    *,
    sharding_shapes: ShardingShapes = "infer",
    global_shape: Sequence[int] | None = None,
) -> ShardedTensor:
    """`ShardedTensor.from_local(local, device_mesh, placements, sharding_shapes=...)`:
    this rank's piece of a tensor with `placements` on `mesh`, differentiably (the
    gradient of its shard flows back to `local`).

    `sharding_shapes`, as PhysicsNeMo's `ShardTensor.from_local`:
    - `"infer"` (default): the ranks exchange their piece shapes (one
      `all_gather_object` of a few dozen bytes per rank over the mesh's ranks) and
      any grid of pieces is accepted; a rank whose piece does not fit raises the
      same error on every rank;
    - `"chunk"`: torch.chunk pieces of `global_shape` (no communication; each rank
      checks its own piece); without `global_shape`, as "infer" and the pieces
      must be torch.chunk's;
    - `{mesh_dim: [piece shapes or sizes]}`: the pieces as given, one per mesh
      coordinate of each sharded mesh dimension (no communication).
    Placements are `Shard(d)` (distinct tensor dimensions) and `Replicate()`.
    """
    # "infer" exchanges: a problem found on one rank before it goes into that exchange
    exchanging = not isinstance(sharding_shapes, Mapping) and not (
        sharding_shapes == "chunk" and global_shape is not None
    )
    problem: BaseException | None = None
    group, rank, found, sharded = None, 0, (), {}
    try:
        if not isinstance(local, torch.Tensor) or isinstance(local, ShardedTensor):
            raise InvalidTypeError(
                f"ShardedTensor.from_local takes this rank's plain tensor, got "
                f"{type(local).__name__}"
            )
        if not is_mesh(mesh):
            raise InvalidTypeError(
                f"ShardedTensor.from_local takes a DeviceMesh, got a {type(mesh).__name__}; "
                f"shardwise.from_local(tensor, layout) takes a Layout"
            )
        if isinstance(sharding_shapes, str) and sharding_shapes not in ("chunk", "infer"):
            raise InvalidArgumentError(
                f"sharding_shapes={sharding_shapes!r}: give 'chunk', 'infer' or "
                f"{{mesh_dim: [piece shapes]}}"
            )
        if not isinstance(sharding_shapes, (str, Mapping)):
            raise InvalidTypeError(
                f"sharding_shapes must be 'chunk', 'infer' or {{mesh_dim: [piece shapes]}}, got "
                f"a {type(sharding_shapes).__name__}"
            )
        found = _block_placements(given, mesh, local.dim(), "placements")
        group, rank = mesh_group(mesh), mesh_position(mesh)
        sharded = _sharded_dims(found, local.dim())
    except Exception as e:
        if not exchanging:
            raise
        problem = e
    if local.device.type != mesh.device_type and not local.is_meta:
        local = local.to(mesh.device_type)  # as DTensor / PhysicsNeMo do
    mesh_shape = tuple(int(n) for n in mesh.shape)
    held = tuple(local.shape)
    if isinstance(sharding_shapes, Mapping):
        sizes = _sizes(sharding_shapes, mesh_shape, sharded, local.dim())
        layout = _grid(held, mesh_shape, sharded, sizes)
        _check_mine(layout, rank, held)
    elif not exchanging:  # "chunk" of global_shape
        assert global_shape is not None
        shape = tuple(int(n) for n in global_shape)
        sizes = {m: _chunk_sizes(shape[d], mesh_shape[m]) for m, d in sharded.items()}
        layout = _grid_layout(shape, mesh_shape, sharded, sizes)
        _check_mine(layout, rank, held)
    else:
        layout = _inferred(local, found, mesh_shape, sharded, group, sharding_shapes, problem)
    out = wrap_local(local, layout, rank, group, mesh)
    out._placements = found
    return out


def _grid(
    held: tuple[int, ...],
    mesh_shape: tuple[int, ...],
    sharded: dict[int, int],
    sizes: dict[int, list[int]],
) -> Layout:
    shape = list(held)
    for m, d in sharded.items():
        shape[d] = sum(sizes[m])
    return _grid_layout(tuple(shape), mesh_shape, sharded, sizes)


def _check_mine(layout: Layout, rank: int, held: tuple[int, ...]) -> None:
    blocks = layout.blocks_of(rank)
    want = blocks[0].sizes if blocks else None
    if (want is None and 0 not in held) or (want is not None and want != held):
        raise LayoutError(
            f"rank {rank}: its local tensor has shape {held} but the sharding shapes give it "
            f"{want if want is not None else 'nothing'} of {layout}"
        )


def _inferred(
    local: torch.Tensor,
    found: tuple[Any, ...],
    mesh_shape: tuple[int, ...],
    sharded: dict[int, int],
    group: Any,
    mode: str,
    problem: BaseException | None,
) -> Layout:
    """The grid the ranks' pieces form, from one exchange of their shapes (which
    raises any rank's `problem` on every rank)."""
    meta = (tuple(local.shape), str(local.dtype), local.device.type, repr(found))
    everyone = exchange(problem, meta, agreement_group(group))
    problems: list[Problem] = [None] * len(everyone)
    for field, what in ((3, "placements"), (1, "dtype"), (2, "device type")):
        ref, odd = odd_ranks([m[field] for m in everyone])
        for r in odd:
            problems[r] = problems[r] or (
                LayoutError,
                f"it passed {what} {everyone[r][field]} but rank {ref} passed "
                f"{everyone[ref][field]}; every rank must pass the same",
            )
    raise_agreed(problems)
    shapes = [m[0] for m in everyone]
    sizes = {
        m: [
            shapes[_at(mesh_shape, m, k)][d] if len(shapes[_at(mesh_shape, m, k)]) > d else 0
            for k in range(mesh_shape[m])
        ]
        for m, d in sharded.items()
    }
    if mode == "chunk":
        for m, d in sharded.items():
            if sizes[m] != _chunk_sizes(sum(sizes[m]), mesh_shape[m]):
                raise LayoutError(
                    f"the pieces along mesh dimension {m} have sizes {sizes[m]} along dimension "
                    f"{d}, not torch.chunk's {_chunk_sizes(sum(sizes[m]), mesh_shape[m])}; use "
                    f"sharding_shapes='infer'"
                )
    layout = _grid(shapes[0], mesh_shape, sharded, sizes)
    for r, held in enumerate(shapes):  # identical data on every rank: raises alike
        blocks = layout.blocks_of(r)
        want = blocks[0].sizes if blocks else None
        if want != held and not (want is None and math.prod(held) == 0):
            problems[r] = (
                LayoutError,
                f"its local tensor has shape {held} but the pieces of the other ranks give it "
                f"{want if want is not None else 'nothing'} (placements {found} on a mesh of "
                f"shape {mesh_shape}): the pieces form no grid",
            )
    raise_agreed(problems)
    return layout


def _at(mesh_shape: tuple[int, ...], mesh_dim: int, k: int) -> int:
    """The rank at coordinate k along `mesh_dim`, 0 along the others."""
    coords = [0] * len(mesh_shape)
    coords[mesh_dim] = k
    rank = 0
    for c, extent in zip(coords, mesh_shape):
        rank = rank * extent + c
    return rank


def from_local(tensor: torch.Tensor, layout: Any, *args: Any, **kwargs: Any) -> ShardedTensor:
    """This rank's tensor as its block of a ShardedTensor; differentiable, collective.

    `from_local(tensor, layout_or_dim, sharding_shapes="infer", *, group=None,
    run_check=True)` takes a `Layout` or a dimension (`shardwise.comm.from_local`);
    `from_local(tensor, device_mesh, placements, *, sharding_shapes="infer",
    global_shape=None)` takes DTensor's / PhysicsNeMo's form (`ShardedTensor.from_local`).
    """
    if is_mesh(layout):
        return from_local_placements(tensor, layout, *args, **kwargs)
    return from_local_layout(tensor, layout, *args, **kwargs)
