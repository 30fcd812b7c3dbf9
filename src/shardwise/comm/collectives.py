"""Collectives on ShardedTensors: redistribute, full_tensor, gather, distribute, equal.

All of them are one plan-driven `move` (see `transfer.py`) to a target layout:
`full_tensor` moves to the replicated layout, `gather` to the table-wise one,
`distribute` from a table-wise one. Autograd follows DTensor: the backward of
a move is the move back, and the gradient of a replicated result is taken as
identical on every rank (each shard takes its own slice, nothing is summed).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ..errors import InvalidArgumentError, InvalidTypeError, LayoutError
from ..layout import Layout
from ..tensor import ShardedTensor
from ..tensor.pending import Arriving
from .agreement import exchange, odd_ranks
from .communicator import communicator
from .group import resolve_group
from .transfer import agree, move, post

__all__ = ["distribute", "equal", "full_tensor", "gather", "redistribute"]


def _wrap(layout: Layout, shards: list[torch.Tensor], like: ShardedTensor) -> ShardedTensor:
    """`shards` in `layout`, on `like`'s rank, group and mesh."""
    return ShardedTensor(
        layout,
        shards,
        like.rank,
        dtype=like.dtype,
        device=like.device,
        group=like.group,
        mesh=like._mesh,
    )


def _slice_into(
    full: torch.Tensor, layout: Layout, rank: int, group: Any, mesh: Any = None
) -> ShardedTensor:
    """A full tensor, identical on every rank, as this rank's blocks of `layout`."""
    return ShardedTensor(
        layout,
        [full[b.slices()].contiguous() for b in layout.blocks_of(rank)],
        rank,
        dtype=full.dtype,
        device=full.device,
        group=group,
        mesh=mesh,
    )


class _Redistribute(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, st: ShardedTensor, layout: Layout, stats: dict | None, async_op: bool
    ) -> ShardedTensor:
        ctx.src_layout, ctx.dst_layout = st.layout_spec, layout
        ctx.rank, ctx.group, ctx.mesh = st.rank, st.group, st._mesh
        if not async_op:
            return _wrap(layout, move(st, layout, stats, checked=True), st)
        shards, finish = post(st, layout, stats, checked=True)
        out = _wrap(layout, shards, st)
        out._arriving = Arriving(finish)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[ShardedTensor, None, None, None]:
        if not isinstance(grad, ShardedTensor):
            grad = _slice_into(grad, ctx.dst_layout, ctx.rank, ctx.group, ctx.mesh)
        return _wrap(ctx.src_layout, move(grad, ctx.src_layout), grad), None, None, None


def redistribute(
    st: ShardedTensor,
    layout: Layout,
    *,
    stats: dict[str, int] | None = None,
    async_op: bool = False,
) -> ShardedTensor:
    """A new ShardedTensor with `layout`'s blocks. Collective: every rank calls it.

    Each remote element is sent once, in one `all_to_all`; elements already on
    the rank are copied locally. Differentiable. With `async_op` (DTensor's) it
    returns once the messages are posted; the first read of the result (any op
    on it, `local_shards()`, ...) waits for them, so the move overlaps whatever
    runs in between. Until then the source's shards must not be written, as
    with DTensor: some may be sent as they are.
    """
    agree(st, layout, "redistribute")
    return _Redistribute.apply(st, layout, stats, bool(async_op))


class _FullTensor(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, st: ShardedTensor) -> torch.Tensor:
        ctx.layout = st.layout_spec
        ctx.rank, ctx.group, ctx.mesh = st.rank, st.group, st._mesh
        whole = Layout.replicated(st.shape, st.layout_spec.world_size)
        if st.layout_spec == whole:  # a reduction's result: already whole, nothing to move
            return st._shards[0].view_as(st._shards[0])
        (full,) = move(st, whole)
        return full

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> ShardedTensor:
        return _slice_into(grad, ctx.layout, ctx.rank, ctx.group, ctx.mesh)


def full_tensor(st: ShardedTensor) -> torch.Tensor:
    """The whole tensor on every rank. Collective; differentiable."""
    return _FullTensor.apply(st)


def gather(st: ShardedTensor, dst: int = 0) -> torch.Tensor | None:
    """The whole tensor on rank `dst`, None elsewhere. Collective.

    Empty ranks and zero-size shards take part like any other (no deadlock).
    """
    world = st.layout_spec.world_size
    if not isinstance(dst, int) or not 0 <= dst < world:
        exchange(
            InvalidArgumentError(f"gather destination rank {dst} is outside world size {world}"),
            None,
            st.group,
        )
    target = Layout.table_wise(st.shape, dst, world)
    agree(st, target, "gather", extra=dst)
    shards = move(st, target, checked=True)
    return shards[0] if st.rank == dst else None


def distribute(
    tensor: torch.Tensor | None, layout: Layout, src: int = 0, group: Any = None
) -> ShardedTensor:
    """Scatter `tensor` from rank `src` into `layout`. Collective; others pass None.

    Only rank `src` needs the data; dtype and device type travel with the
    first collective, and each rank receives only its own blocks. `group` is a
    ProcessGroup or a DeviceMesh / sub-mesh; `src` is a rank of it (its position).
    """
    group, mesh = resolve_group(group)
    rank = dist.get_rank(group)
    world = dist.get_world_size(group)
    problem: BaseException | None = None
    meta = None
    # Every check is local and ends in the one exchange below: a rank that
    # raised here alone would leave the others waiting in it.
    if not isinstance(layout, Layout):
        problem = InvalidTypeError(
            f"distribute needs a shardwise.Layout, got a {type(layout).__name__}"
        )
    elif isinstance(src, bool) or not isinstance(src, int) or not 0 <= src < world:
        problem = InvalidArgumentError(f"source rank {src!r} is outside the group of {world} ranks")
    elif layout.world_size != world:
        problem = LayoutError(
            f"the layout spans {layout.world_size} ranks but the group has {world}"
        )
    elif rank == src:
        if not isinstance(tensor, torch.Tensor) or isinstance(tensor, ShardedTensor):
            got = "None" if tensor is None else f"a {type(tensor).__name__}"
            problem = InvalidTypeError(f"the source rank {src} must pass a plain tensor, got {got}")
        elif tuple(tensor.shape) != layout.global_shape:
            problem = LayoutError(
                f"the source tensor has shape {tuple(tensor.shape)} but the layout's global "
                f"shape is {layout.global_shape}"
            )
        else:
            meta = (tensor.dtype, tensor.device.type)
    agreed = (
        hash(layout) if isinstance(layout, Layout) else None,
        src if isinstance(src, int) else None,
    )
    everyone = exchange(problem, (meta, agreed), group)
    ref, odd = odd_ranks([a for _, a in everyone])
    if odd:
        raise LayoutError(
            f"ranks disagree on distribute: ranks {odd} passed another layout or source rank "
            f"than rank {ref}; every rank must pass the same"
        )
    if everyone[src][0] is None:
        raise InvalidArgumentError(f"source rank {src} passed no tensor to distribute")
    dtype, device_type = everyone[src][0]
    whole = Layout.table_wise(layout.global_shape, src, world)
    if rank == src:
        assert tensor is not None  # checked before the exchange
        device = tensor.device
        shards = [tensor.contiguous()]
    else:
        device = (
            torch.device("cuda", torch.cuda.current_device())
            if device_type == "cuda"
            else torch.device(device_type)
        )
        shards = []
    source = ShardedTensor(whole, shards, rank, dtype=dtype, device=device, group=group, mesh=mesh)
    return _wrap(layout, move(source, layout), source)


def equal(a: ShardedTensor, b: ShardedTensor) -> bool:
    """True when both hold the same global values (layouts may differ). Collective."""
    problem: BaseException | None = None
    fingerprint = None
    if not (isinstance(a, ShardedTensor) and isinstance(b, ShardedTensor)):
        problem = InvalidTypeError(
            f"sw.equal compares two ShardedTensors, got {type(a).__name__} and {type(b).__name__}; "
            f"torch.equal compares a ShardedTensor with a plain tensor locally"
        )
    else:
        world = dist.get_world_size(a.group)
        spans = {a.layout_spec.world_size, b.layout_spec.world_size}
        if spans != {world}:
            problem = LayoutError(
                f"the layouts span {sorted(spans)} ranks but the group has {world}"
            )
        else:
            comparable = tuple(a.shape) == tuple(b.shape) and a.dtype == b.dtype
            fingerprint = (comparable, hash(a.layout_spec), hash(b.layout_spec))
    group = next((x.group for x in (a, b) if isinstance(x, ShardedTensor)), None)
    everyone = exchange(problem, fingerprint, group)
    if not all(c for c, _, _ in everyone):
        return False  # decided together: no rank goes on to a collective alone
    ref, odd = odd_ranks([x[1:] for x in everyone])
    if odd:
        raise LayoutError(
            f"ranks disagree on equal: ranks {odd} passed tensors of other layouts than rank "
            f"{ref}; "
            f"every rank must pass the same two tensors"
        )
    if b.layout_spec != a.layout_spec:
        b = _wrap(a.layout_spec, move(b, a.layout_spec, checked=True), b)
    same = all(torch.equal(x, y) for x, y in zip(a._shards, b._shards))
    # an object collective: a CPU bool on any backend, never a device tensor
    return all(communicator(a.group).all_gather_object(same))
