"""`scatter_tensor`: PhysicsNeMo's call, as its users write it, returning a ShardedTensor.

    from physicsnemo.domain_parallel import scatter_tensor   # before
    from shardwise import scatter_tensor                     # after: same arguments

Same argument names and defaults as `physicsnemo.domain_parallel.scatter_tensor`
(2.2.2), plus `sharding_shapes` in the forms PhysicsNeMo's
`ShardTensor.from_local` takes, so uneven pieces need no second call:

- `"chunk"` (default) and `"infer"`: `torch.chunk` sizes along each sharded
  dimension, what PhysicsNeMo's `scatter_tensor` produces (there is no local
  piece to infer from, so both mean the same here). Ranks past the last chunk
  hold nothing (PhysicsNeMo 2.2.2 fails with `IndexError` there).
- `{mesh_dim: sizes}`: the pieces' sizes along the tensor dimension that mesh
  dimension shards, one per mesh coordinate, as ints or as PhysicsNeMo's piece
  shapes (`from_local`'s convention, the sharded dimension is read off them).

Built on `shardwise.distribute`: only the source holds the tensor and each rank
receives only its own block (PhysicsNeMo broadcasts the whole tensor). Every
problem, on any rank, raises the same error on every rank. Runs over the
mesh's ranks only (`shardwise.comm.group.mesh_group`), on any mesh or sub-mesh.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from ..comm import distribute
from ..comm.agreement import exchange, odd_ranks
from ..comm.group import agreement_group, mesh_group, mesh_ranks
from ..errors import ArgumentMismatchError, InvalidArgumentError, InvalidTypeError, LayoutError
from ..layout import Layout
from ..layout.layout import _chunk_sizes, mesh_coordinates
from ..tensor import ShardedTensor
from .agreed import mesh_position
from .physicsnemo import _grid_layout, _sharded_dims

__all__ = ["scatter_tensor"]

ShardingShapes = str | Mapping[int, Sequence[Any]]


def scatter_tensor(
    tensor: torch.Tensor | None,
    global_src: int,
    mesh: Any,
    placements: Sequence[Any],
    global_shape: Sequence[int] | None = None,
    dtype: torch.dtype | None = None,
    requires_grad: bool = False,
    sharding_shapes: ShardingShapes = "chunk",
) -> ShardedTensor:
    """Scatter `tensor` from global rank `global_src` over `mesh` as `placements` say.

    Collective over the mesh's ranks (any mesh or sub-mesh: ranks of other
    sub-meshes scatter their own tensors at the same time); ranks other than
    `global_src`, a global rank of the mesh, may pass None. `global_shape` /
    `dtype`, when given, are checked against the source's tensor. The result is
    a leaf ShardedTensor (`requires_grad` as asked) whose `offsets()` are
    PhysicsNeMo's.
    """
    problem: BaseException | None = None
    claim: tuple[Any, Any] = (None, dtype)
    source_meta = None
    group, rank, src = None, 0, 0
    try:
        ranks = mesh_ranks(mesh)
        group = mesh_group(mesh)
        rank = mesh_position(mesh)
        if global_shape is not None:
            claim = (_global_shape(global_shape), dtype)
        if isinstance(global_src, bool) or not isinstance(global_src, int):
            raise InvalidArgumentError(f"global_src must be an integer rank, got {global_src!r}")
        if global_src not in ranks:
            raise InvalidArgumentError(
                f"global_src {global_src} is not a rank of the mesh (ranks {ranks})"
            )
        src = ranks.index(global_src)
        if dist.get_rank() == global_src:
            if not isinstance(tensor, torch.Tensor) or isinstance(tensor, ShardedTensor):
                got = "None" if tensor is None else f"a {type(tensor).__name__}"
                raise InvalidTypeError(f"the source rank must pass a plain tensor, got {got}")
            source_meta = (tuple(tensor.shape), tensor.dtype)
    except Exception as e:  # noqa: BLE001 - every rank raises it, through the exchange
        problem = e
    group = agreement_group(group)
    everyone = exchange(problem, (claim, source_meta), group)
    shape, src_dtype = everyone[src][1]
    _check_claims([c for c, _ in everyone], shape, src_dtype)
    layout, offsets = None, None
    try:
        layout, offsets = _plan(shape, tuple(mesh.shape), tuple(placements), sharding_shapes, rank)
    except Exception as e:  # noqa: BLE001 - as above
        problem = e
    hashes = exchange(problem, hash(layout), group)
    ref, odd = odd_ranks(hashes)
    if odd:
        raise LayoutError(
            f"ranks {odd} passed other placements or sharding_shapes to scatter_tensor than "
            f"rank {ref}; every rank must pass the same"
        )
    assert layout is not None  # the exchange raised otherwise
    if rank == src:
        assert tensor is not None
        tensor = tensor.to(device=_device_of(mesh, tensor))
    with torch.no_grad():
        out = distribute(tensor if rank == src else None, layout, src, group=mesh)
    out._mesh_offsets = offsets
    out._placements = tuple(placements)
    if requires_grad:
        out.requires_grad_(True)  # a leaf, as PhysicsNeMo's
    return out


def _check_claims(
    claims: list[tuple[Any, Any]], shape: tuple[int, ...], src_dtype: torch.dtype
) -> None:
    """Raise, alike on every rank (the claims are exchanged), where a rank's
    `global_shape` / `dtype` is not the source tensor's."""
    for what, index, truth in (("global_shape", 0, shape), ("dtype", 1, src_dtype)):
        wrong = [r for r, c in enumerate(claims) if c[index] is not None and c[index] != truth]
        if wrong:
            raise ArgumentMismatchError(
                f"ranks {wrong} passed {what}={claims[wrong[0]][index]} but the source's tensor "
                f"has {truth}; pass the source's {what} or None"
            )


def _global_shape(global_shape: Any) -> tuple[int, ...]:
    """`global_shape` as a tuple of ints, each a whole size (never truncated: a
    fractional size is a wrong claim, not one to round)."""
    try:
        given = tuple(global_shape) if not isinstance(global_shape, (str, bytes)) else None
    except TypeError:
        given = None
    if given is None:
        raise InvalidArgumentError(
            f"global_shape must be a sequence of ints (a torch.Size, a tuple), got {global_shape!r}"
        )
    shape = []
    for d, size in enumerate(given):
        if isinstance(size, bool) or not hasattr(size, "__index__") or size.__index__() < 0:
            raise InvalidArgumentError(
                f"global_shape={given!r} gives size {size!r} for dimension {d}: a size must be "
                "an int, 0 or more"
            )
        shape.append(size.__index__())
    return tuple(shape)


def _device_of(mesh: Any, tensor: torch.Tensor) -> torch.device:
    """The mesh's device type, as PhysicsNeMo places local tensors."""
    if mesh.device_type == tensor.device.type:
        return tensor.device
    if mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(mesh.device_type)


def _sizes(
    sharding_shapes: Mapping[int, Sequence[Any]],
    mesh_shape: tuple[int, ...],
    sharded: dict[int, int],
    ndim: int,
) -> dict[int, list[int]]:
    """Per sharded mesh dimension, piece sizes along its tensor dimension, from ints or shapes."""
    if set(sharding_shapes) != set(sharded):
        raise LayoutError(
            f"sharding_shapes names mesh dimensions {sorted(sharding_shapes)} but the placements "
            f"shard along mesh dimensions {sorted(sharded)}; give one entry per sharded mesh "
            f"dimension"
        )
    sizes: dict[int, list[int]] = {}
    for m, pieces in sharding_shapes.items():
        pieces = list(pieces)
        if len(pieces) != mesh_shape[m]:
            raise LayoutError(
                f"sharding_shapes[{m}] lists {len(pieces)} pieces for mesh dimension {m} of "
                f"size {mesh_shape[m]}; give one per mesh coordinate"
            )
        sizes[m] = [_size(m, k, _along(m, k, p, sharded[m], ndim)) for k, p in enumerate(pieces)]
    return sizes


def _along(mesh_dim: int, coordinate: int, piece: Any, dim: int, ndim: int) -> Any:
    """A piece's size along tensor dimension `dim`: the int itself, or read off a
    piece shape, which has the tensor's `ndim` dimensions (`from_local`'s convention)."""
    if not isinstance(piece, Sequence) or isinstance(piece, (str, bytes)):
        return piece
    if len(piece) != ndim:
        raise InvalidArgumentError(
            f"sharding_shapes[{mesh_dim}] gives shape {tuple(piece)} for mesh coordinate "
            f"{coordinate}, of {len(piece)} dimensions, but the tensor has {ndim}; give each "
            f"piece's full shape, or its size along dimension {dim} as an int"
        )
    return piece[dim]


def _size(mesh_dim: int, coordinate: int, size: Any) -> int:
    """One piece's size, refused unless a whole number of elements, 0 or more."""
    if isinstance(size, bool) or not isinstance(size, int) or size < 0:
        raise InvalidArgumentError(
            f"sharding_shapes[{mesh_dim}] gives size {size!r} for mesh coordinate "
            f"{coordinate}: a size must be an int, 0 or more"
        )
    return size


def _plan(
    shape: tuple[int, ...],
    mesh_shape: tuple[int, ...],
    placements: tuple[Any, ...],
    sharding_shapes: ShardingShapes,
    rank: int,
) -> tuple[Layout, tuple[int, ...] | None]:
    """The layout, and this rank's PhysicsNeMo `offsets()` (None where one tensor
    dimension is sharded by several mesh dimensions: those have no per-mesh offset)."""
    if len(placements) != len(mesh_shape):
        raise LayoutError(
            f"{len(placements)} placements for a {len(mesh_shape)}-d mesh {mesh_shape}"
        )
    if isinstance(sharding_shapes, str):
        if sharding_shapes not in ("chunk", "infer"):
            raise InvalidArgumentError(
                f"sharding_shapes={sharding_shapes!r}: a string must be 'chunk' or 'infer' "
                f"(or pass {{mesh_dim: sizes}})"
            )
        layout = Layout.from_dtensor_spec(mesh_shape, placements, shape)
        try:
            sharded = _sharded_dims(placements, len(shape))
        except LayoutError:  # nested sharding: DTensor's layout, no per-mesh offsets
            return layout, None
        sizes = {m: _chunk_sizes(shape[d], mesh_shape[m]) for m, d in sharded.items()}
    elif isinstance(sharding_shapes, Mapping):
        sharded = _sharded_dims(placements, len(shape))
        sizes = _sizes(sharding_shapes, mesh_shape, sharded, len(shape))
        for m, d in sharded.items():
            if sum(sizes[m]) != shape[d]:
                raise LayoutError(
                    f"sharding_shapes[{m}] gives sizes {sizes[m]} along dimension {d}, which "
                    f"add up to {sum(sizes[m])}, not the tensor's {shape[d]} (0 is allowed)"
                )
        layout = _grid_layout(shape, mesh_shape, sharded, sizes)
    else:
        raise InvalidTypeError(
            f"sharding_shapes must be 'chunk', 'infer' or {{mesh_dim: sizes}}, got "
            f"{type(sharding_shapes).__name__}"
        )
    coords = mesh_coordinates(rank, mesh_shape)
    offsets = tuple(sum(sizes[m][: coords[m]]) if m in sizes else 0 for m in range(len(mesh_shape)))
    return layout, offsets
