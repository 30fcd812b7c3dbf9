"""Differentiable `from_local` / `to_local`, as DTensor's: one block per rank.

The PhysicsNeMo-style shortcut `from_local(tensor, dim, sharding_shapes=...)`
builds the layout from each rank's piece along one dimension: "chunk" checks
the pieces are `torch.chunk` sizes, "infer" accepts any sizes, and an explicit
list names them.

`from_local` is collective, as every entry point of `shardwise.comm`: each rank
checks its own input, then one `all_gather_object` of metadata (the sizes,
and what the ranks must agree on) lets every rank raise the same error, or
none. A rank that raised alone would leave the others waiting in their next
collective until the process-group timeout.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from ..errors import InvalidArgumentError, InvalidTypeError, LayoutError, ShardMismatchError
from ..layout import Layout
from ..tensor import ShardedTensor
from .agreement import Problem, exchange, odd_ranks, raise_agreed
from .group import resolve_group
from .transfer import move

__all__ = ["GradPlan", "from_local", "to_local", "wrap_local"]


class _FromLocal(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, tensor: torch.Tensor, layout: Layout, rank: int, group: Any, mesh: Any = None
    ) -> ShardedTensor:
        ctx.shape = tensor.shape
        holds = bool(layout.blocks_of(rank))
        # view_as: the output must not be the input object itself (as in DTensor).
        shards = [tensor.view_as(tensor)] if holds else []
        return ShardedTensor(
            layout, shards, rank, dtype=tensor.dtype, device=tensor.device, group=group, mesh=mesh
        )

    @staticmethod
    def backward(ctx: Any, grad: ShardedTensor) -> tuple[torch.Tensor | None, ...]:
        shards = grad._shards
        if not shards:
            return (
                torch.zeros(ctx.shape, dtype=grad.dtype, device=grad.device),
                None,
                None,
                None,
                None,
            )
        return shards[0], None, None, None, None


def wrap_local(
    tensor: torch.Tensor, layout: Layout, rank: int, group: Any, mesh: Any = None
) -> ShardedTensor:
    """`tensor` as this rank's one block of `layout`, differentiably (its graph is kept:
    the gradient of the result's shard flows back to `tensor`). No communication: the
    caller has checked the layout, on every rank."""
    return _FromLocal.apply(tensor, layout, rank, group, mesh)


class GradPlan(NamedTuple):
    """What `to_local(grad_placements=...)`'s backward does with the local gradient:
    sum it over each of `reduce_groups` (the mesh dimensions a `Partial` names), then
    read it as this rank's block of `layout` and move it to the tensor's own layout."""

    layout: Layout
    reduce_groups: tuple[Any, ...]


class _ToLocal(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, st: ShardedTensor, plan: GradPlan | None) -> torch.Tensor:
        # the layout object itself: one built locally is learned only if backward needs it
        ctx.layout, ctx.rank, ctx.group, ctx.mesh = st._layout, st.rank, st.group, st._mesh
        ctx.plan = plan
        shards = st._shards
        if len(shards) > 1:
            raise LayoutError(
                f"rank {st.rank} holds {len(shards)} blocks; to_local() needs one, "
                f"use local_shards() for several"
            )
        if not shards:
            return torch.empty((0,) * max(st.dim(), 1), dtype=st.dtype, device=st.device)
        return shards[0].view_as(shards[0])

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[ShardedTensor, None]:
        plan: GradPlan | None = ctx.plan
        layout = ctx.layout if plan is None else plan.layout
        if plan is not None and plan.reduce_groups:
            grad = grad.contiguous().clone()
            for group in plan.reduce_groups:  # a Partial gradient: the ranks' sum
                dist.all_reduce(grad, group=group)
        blocks = layout.blocks_of(ctx.rank)
        if blocks and tuple(grad.shape) != blocks[0].sizes:
            raise ShardMismatchError(
                f"rank {ctx.rank}: the gradient of to_local() has shape {tuple(grad.shape)} but "
                f"grad_placements give this rank's block {blocks[0]}"
            )
        out = ShardedTensor(
            layout,
            [grad] if blocks else [],
            ctx.rank,
            dtype=grad.dtype,
            device=grad.device,
            group=ctx.group,
            mesh=ctx.mesh,
        )
        if layout != ctx.layout:  # the gradient's placements are not the tensor's: move it
            out = out._with_layout(ctx.layout, move(out, ctx.layout))
        return out, None


def to_local(st: ShardedTensor, plan: GradPlan | None = None) -> torch.Tensor:
    """This rank's single shard (an empty tensor on a rank holding none). Differentiable:
    the gradient is this rank's block, or as `plan` (DTensor's `grad_placements`) says."""
    return _ToLocal.apply(st, plan)


def from_local(
    tensor: torch.Tensor,
    layout: Layout | int,
    sharding_shapes: str | Sequence[int] = "infer",
    *,
    group: Any = None,
    run_check: bool = True,
) -> ShardedTensor:
    """Wrap this rank's one block; differentiable like `DTensor.from_local`.

    `layout` is a `Layout`, or the dimension along which the ranks' tensors
    are consecutive pieces, with `sharding_shapes` "chunk" (the pieces must be
    `torch.chunk`'s), "infer" (any sizes) or an explicit list of per-rank sizes
    along that dimension.

    Collective: every rank calls it. The ranks exchange their metadata once and
    check that they passed the same layout (or dimension and sizes), tensors of
    one dtype and device type and of the same extent outside the split
    dimension; a bad input on any rank raises the same exception on every
    rank, naming the faulty rank, and the group stays usable. `run_check=False`
    skips the exchange for a `Layout` or an explicit list of sizes (as
    `DTensor.from_local(run_check=False)`): the caller vouches that the ranks
    agree, and a bad input raises on its own rank only. `group` is a
    ProcessGroup or a DeviceMesh / sub-mesh (layout rank r = its position r).
    """
    distributed = dist.is_available() and dist.is_initialized()
    group, mesh = resolve_group(group) if distributed else (group, None)
    rank = dist.get_rank(group) if distributed else 0
    world = dist.get_world_size(group) if distributed else 1
    problem: BaseException | None = None
    meta: dict[str, Any] | None = None
    try:
        meta = _local_meta(tensor, layout, sharding_shapes, rank, world)
    except Exception as e:  # whatever fails here must reach the exchange, not skip it
        problem = e
    needs_sizes = not isinstance(layout, Layout) and isinstance(sharding_shapes, str)
    if distributed and (run_check or needs_sizes):
        everyone = exchange(problem, meta, group)
    else:
        mine: list[Problem] = [None] * (rank + 1)
        mine[rank] = None if problem is None else (type(problem), str(problem))
        raise_agreed(mine)
        everyone = [meta]
    raise_agreed(_disagreements(everyone))
    assert meta is not None  # for type checkers: any rank's problem was raised above
    if isinstance(layout, Layout):
        built = layout
    else:
        built = _layout_along(everyone, meta, world)
    return _FromLocal.apply(tensor, built, rank, group, mesh)


def _local_meta(
    tensor: Any, layout: Any, sharding_shapes: Any, rank: int, world: int
) -> dict[str, Any]:
    """What the ranks compare, or an exception for this rank's own input (no communication)."""
    if not isinstance(tensor, torch.Tensor) or isinstance(tensor, ShardedTensor):
        raise InvalidTypeError(f"from_local takes this rank's plain tensor, got {_kind(tensor)}")
    shape = tuple(tensor.shape)
    meta: dict[str, Any] = {"dtype": tensor.dtype, "device": tensor.device.type, "shape": shape}
    if isinstance(layout, Layout):
        if layout.world_size != world:
            raise ShardMismatchError(
                f"the layout spans {layout.world_size} ranks but the process group has "
                f"{world}; build the layout for the group's world size"
            )
        blocks = layout.blocks_of(rank)
        if len(blocks) > 1:
            raise ShardMismatchError(
                f"it holds {len(blocks)} blocks of the layout; from_local takes one tensor "
                f"per rank, use ShardedTensor.from_layout for several"
            )
        if blocks and shape != blocks[0].sizes:
            raise ShardMismatchError(
                f"its tensor has shape {shape} but its block {blocks[0]} has sizes "
                f"{blocks[0].sizes}"
            )
        if not blocks and tensor.numel():
            raise ShardMismatchError(
                f"it holds no block of the layout but was given {tensor.numel()} elements; "
                f"pass an empty tensor"
            )
        return {**meta, "key": ("layout", hash(layout)), "global_shape": layout.global_shape}
    try:
        dim = operator.index(layout)
    except TypeError:
        raise InvalidTypeError(
            f"from_local needs a shardwise.Layout or a dimension (int), got {_kind(layout)}"
        ) from None
    if tensor.dim() == 0:
        raise LayoutError("its tensor is 0-d: there is no dimension to split along; pass a Layout")
    if not -tensor.dim() <= dim < tensor.dim():
        raise LayoutError(f"dimension {dim} is out of range for its {tensor.dim()}-d tensor")
    d = dim % tensor.dim()
    mode: str | tuple[int, ...]
    if isinstance(sharding_shapes, str):
        if sharding_shapes not in ("chunk", "infer"):
            raise InvalidArgumentError(
                "sharding_shapes must be 'chunk', 'infer' or a list of sizes, got "
                f"{sharding_shapes!r}"
            )
        mode = sharding_shapes
    else:
        try:
            mode = tuple(operator.index(s) for s in sharding_shapes)
        except TypeError:
            raise InvalidTypeError(
                "sharding_shapes must be 'chunk', 'infer' or a list of ints, got "
                f"{sharding_shapes!r}"
            ) from None
        if len(mode) != world:
            raise ShardMismatchError(f"sharding_shapes lists {len(mode)} sizes for {world} ranks")
        if min(mode) < 0:
            raise LayoutError(f"sharding_shapes {list(mode)} has a negative size")
        if mode[rank] != shape[d]:
            raise ShardMismatchError(
                f"sharding_shapes gives it {mode[rank]} along dimension {d} but its tensor "
                f"has shape {shape}"
            )
    # the dimension as passed: -1 on tensors of different ndim is a shape problem, not a
    # disagreement
    return {
        **meta,
        "key": ("dim", dim, mode),
        "d": d,
        "size": shape[d],
        "others": shape[:d] + shape[d + 1 :],
    }


def _kind(x: Any) -> str:
    return "None" if x is None else f"a {type(x).__name__}"


def _describe(meta: dict[str, Any], other: dict[str, Any] | None = None) -> str:
    """What a rank asked for, in words; `other` names the rank it is contrasted with."""
    if meta["key"][0] == "layout":
        if (
            other is not None
            and other["key"][0] == "layout"
            and other["global_shape"] == meta["global_shape"]
        ):
            return "a layout of the same global shape with other blocks"
        return f"a layout of global shape {meta['global_shape']}"
    _, dim, mode = meta["key"]
    return (
        f"dimension {dim} with sharding_shapes={list(mode) if isinstance(mode, tuple) else mode!r}"
    )


def _disagreements(everyone: list[dict[str, Any]]) -> list[Problem]:
    """Each rank's problem with the metadata of all (identical on every rank)."""
    problems: list[Problem] = [None] * len(everyone)

    def flag(field: str, kind: type, say: Any) -> None:
        ref, odd = odd_ranks([m[field] for m in everyone])
        for r in odd:
            if problems[r] is None:
                problems[r] = (kind, say(everyone[r], everyone[ref], ref))

    flag(
        "key",
        LayoutError,
        lambda m, ref, rr: (
            f"it passed {_describe(m)} but rank {rr} passed {_describe(ref, m)}; every rank must "
            "pass the same"
        ),
    )
    if any(problems):
        return problems  # the other fields mean nothing across different requests
    flag(
        "dtype",
        InvalidTypeError,
        lambda m, ref, rr: (
            f"its tensor is {m['dtype']} but rank {rr}'s is {ref['dtype']}; convert them to one "
            "dtype"
        ),
    )
    flag(
        "device",
        ShardMismatchError,
        lambda m, ref, rr: f"its tensor is on {m['device']} but rank {rr}'s is on {ref['device']}",
    )
    if everyone[0]["key"][0] == "dim":
        flag(
            "others",
            ShardMismatchError,
            lambda m, ref, rr: (
                f"its tensor has shape {m['shape']} but rank {rr}'s has {ref['shape']}: they may "
                f"differ only along dimension {ref['d']}"
            ),
        )
        if not any(problems) and everyone[0]["key"][2] == "chunk":
            sizes = [m["size"] for m in everyone]
            chunked = Layout.chunked((sum(sizes),), 0, len(sizes))
            expected = [bs[0].sizes[0] if bs else 0 for bs in chunked.blocks]
            for r, (got, want) in enumerate(zip(sizes, expected)):
                if got != want:
                    problems[r] = (
                        LayoutError,
                        (
                            f"its piece has {got} along dimension {everyone[r]['d']} but "
                            "torch.chunk "
                            f"gives {want} (pieces {sizes}, torch.chunk {expected}); use "
                            f"sharding_shapes='infer'"
                        ),
                    )
    return problems


def _layout_along(everyone: list[dict[str, Any]], meta: dict[str, Any], world: int) -> Layout:
    """The layout of consecutive pieces along `meta["d"]`, from every rank's metadata."""
    mode = meta["key"][2]
    sizes = list(mode) if isinstance(mode, tuple) else [m["size"] for m in everyone]
    d, others = meta["d"], meta["others"]
    global_shape = others[:d] + (sum(sizes),) + others[d:]
    return Layout.along(global_shape, d, sizes, world_size=world)
