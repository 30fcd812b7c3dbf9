"""Build a ShardedTensor from what each rank holds: validated collectively.

`from_local_shards` learns the layout by all-gathering every rank's block
offsets and sizes (metadata only, one `all_gather_object`), so ranks need
not agree on anything beforehand; a problem on any rank is raised on all.
`from_local_blocks` builds the same tensor with no communication, as
`LocalShardsWrapper` is built, and leaves that exchange for later
(`PendingLayout`, the first time an operation needs the global layout).
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from ..errors import InvalidTypeError, LayoutError, ShardMismatchError, UsageError
from ..layout import Block, Layout
from ..tensor import ShardedTensor
from ..tensor.construction import PendingLayout
from .agreement import exchange, odd_ranks, raise_agreed, require_same
from .group import resolve_group

__all__ = ["from_local_blocks", "from_local_shards"]


def _check_local(
    shards: Sequence[torch.Tensor], offsets: Sequence[Sequence[int]], contiguous: bool = True
) -> tuple[BaseException | None, list[tuple[tuple[int, ...], tuple[int, ...]]]]:
    """This rank's blocks, or the first problem with its input (`contiguous`: views refused)."""
    if len(shards) != len(offsets):
        return ShardMismatchError(f"{len(shards)} shards but {len(offsets)} offsets"), []
    blocks = []
    for i, (shard, offset) in enumerate(zip(shards, offsets)):
        if not isinstance(shard, torch.Tensor) or isinstance(shard, ShardedTensor):
            return InvalidTypeError(
                f"shard {i} is a {type(shard).__name__}, not a plain tensor"
            ), []
        try:
            offset = tuple(operator.index(o) for o in offset)
        except TypeError:
            return InvalidTypeError(
                f"the offsets of shard {i} must be a sequence of ints, got {offset!r}"
            ), []
        if len(offset) != shard.dim():
            return ShardMismatchError(
                f"shard {i} is {shard.dim()}-d but its offsets {offset} have {len(offset)} entries"
            ), []
        if min(offset, default=0) < 0:
            return LayoutError(f"shard {i} has negative offsets {offset}"), []
        if contiguous and not shard.is_contiguous():
            return ShardMismatchError(
                f"shard {i} at offsets {offset} is not contiguous; call .contiguous() on it"
            ), []
        if shard.dim() != shards[0].dim():
            return LayoutError(
                f"shard {i} is {shard.dim()}-d but shard 0 is {shards[0].dim()}-d (ndim)"
            ), []
        if shard.dtype != shards[0].dtype:
            return InvalidTypeError(
                f"shard {i} is {shard.dtype} but shard 0 is {shards[0].dtype}; use one dtype"
            ), []
        if shard.device != shards[0].device:
            return ShardMismatchError(
                f"shard {i} is on {shard.device} but shard 0 is on {shards[0].device}"
            ), []
        blocks.append((offset, tuple(shard.shape)))
    return None, blocks


def from_local_shards(
    shards: Sequence[torch.Tensor],
    offsets: Sequence[Sequence[int]],
    global_shape: Sequence[int] | None = None,
    group: Any = None,
) -> ShardedTensor:
    """Collective: every rank passes its shards and their global offsets.

    The global shape is inferred as the bounding box of all blocks when not
    given. `group` is a ProcessGroup (None: the default) or a DeviceMesh /
    sub-mesh: the exchange and every later collective run over its ranks only.
    Overlaps, holes, bounds, dtype/device mismatches and non-contiguous
    shards raise the same exception on every rank, naming the faulty rank.
    """
    return from_local_shards_checked(shards, offsets, global_shape, group)


def from_local_shards_checked(
    shards: Any,
    offsets: Any,
    global_shape: Any,
    group: Any,
    problem: BaseException | None = None,
    *,
    contiguous: bool = True,
) -> ShardedTensor:
    """`from_local_shards`, taking a problem the caller found first (`from_dtensor`'s)
    into the same exchange, so that it too raises on every rank. `group` is a
    ProcessGroup or a DeviceMesh / sub-mesh (layout rank r = its position r);
    `contiguous=False` accepts strided views (what `from_local_blocks` holds)."""
    group, mesh = resolve_group(group)
    blocks: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
    shape = None
    try:
        shards, offsets = list(shards), list(offsets)
    except TypeError:
        shards, offsets = [], []
        problem = problem or InvalidTypeError(
            "shards and offsets must be sequences (one entry per shard)"
        )
    if problem is None:
        problem, blocks = _check_local(shards, offsets, contiguous)
    if problem is None and global_shape is not None:
        try:
            shape = tuple(operator.index(s) for s in global_shape)
        except TypeError:
            problem = InvalidTypeError(
                f"global_shape must be a sequence of ints, got {global_shape!r}"
            )
    ok = problem is None
    meta = {
        "blocks": blocks,
        "dtype": shards[0].dtype if shards and ok else None,
        "device_type": shards[0].device.type if shards and ok else None,
        "requires_grad": ok and any(s.requires_grad for s in shards),
        "shape": shape,
    }
    everyone = exchange(problem, meta, group)
    # From here on every rank reasons over identical data, so raises identically.
    problems: list[Any] = [None] * len(everyone)
    holders = [(r, m) for r, m in enumerate(everyone) if m["dtype"] is not None]
    if holders:
        ref_rank, ref = holders[0]
        for r, m in holders[1:]:
            if m["dtype"] != ref["dtype"] and problems[r] is None:
                problems[r] = (
                    InvalidTypeError,
                    f"its shards are {m['dtype']} but rank {ref_rank}'s are {ref['dtype']}",
                )
            elif m["device_type"] != ref["device_type"] and problems[r] is None:
                problems[r] = (
                    ShardMismatchError,
                    f"its shards are on {m['device_type']} but rank {ref_rank}'s on "
                    f"{ref['device_type']}",
                )
    ndims = {r: len(m["blocks"][0][0]) for r, m in holders}
    if ndims:
        ref_rank, odd = odd_ranks(list(ndims.values()))
        ranks = list(ndims)
        for r in (ranks[i] for i in odd):
            if problems[r] is None:
                problems[r] = (
                    LayoutError,
                    f"its shards are {ndims[r]}-d but rank {ranks[ref_rank]}'s are "
                    f"{ndims[ranks[ref_rank]]}-d (ndim)",
                )
    ref_rank, odd = odd_ranks([m["shape"] for m in everyone])
    for r in odd:
        if problems[r] is None:
            problems[r] = (
                ShardMismatchError,
                f"it passed global_shape {everyone[r]['shape']} but rank {ref_rank} passed "
                f"{everyone[ref_rank]['shape']}; every rank must pass the same (or None "
                "everywhere)",
            )
    raise_agreed(problems)
    all_blocks = {r: [Block(o, s) for o, s in m["blocks"]] for r, m in enumerate(everyone)}
    shape = everyone[0]["shape"]
    if shape is None:
        shape = _bounding_shape(all_blocks)
    layout = Layout(shape, all_blocks, len(everyone))
    rank = dist.get_rank(group)
    dtype = holders[0][1]["dtype"] if holders else torch.get_default_dtype()
    device = (
        shards[0].device
        if shards
        else _default_device(holders[0][1]["device_type"] if holders else "cpu")
    )
    return ShardedTensor(
        layout,
        shards,
        rank,
        dtype=dtype,
        device=device,
        group=group,
        requires_grad=any(m["requires_grad"] for m in everyone),
        mesh=mesh,
    )


# -----------------------------------------------------------------------------
# Built locally, learned later: LocalShardsWrapper's construction.
#
# TorchRec and FSDP build `LocalShardsWrapper(shards, offsets)` where no process
# group may exist yet, and save it with DCP, which needs each rank's own chunks
# only. `from_local_blocks` builds a ShardedTensor the same way: it checks what
# this rank holds against the global shape, and its layout is a `PendingLayout`
# that knows this rank's blocks. The global layout is learned by `_learn`,
# `from_local_shards`' exchange and validation, the first time an operation
# reads it (redistribute, full_tensor, gather, op rules, `layout_spec`), or
# when the caller asks (`st.learn_layout()`, `check="now"`).
#
# Cost per rank: construction is local (no communication, O(blocks) checks);
# learning, once per family of tensors, is one `all_gather_object` of this
# rank's block metadata (O(its blocks) sent, O(all blocks) received), then the
# O(all blocks) layout validation every rank runs alike.
# -----------------------------------------------------------------------------


def from_local_blocks(
    shards: Sequence[torch.Tensor],
    offsets: Sequence[Sequence[int]],
    global_shape: Sequence[int] | None,
    group: Any = None,
    *,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
) -> ShardedTensor:
    """This rank's shards (strided views allowed) at their global `offsets`, with no
    communication; the layout is learned later (`PendingLayout.learn`). `dtype` /
    `device` are those of a rank that holds no shard (default: the default dtype, CPU);
    learning checks that every rank's agree.

    Local: a problem with this rank's input (shard count, types, offsets outside
    `global_shape`, mixed dtypes or devices) raises here, on this rank only. With
    no process group initialised the tensor is rank 0's; learning then needs one.
    `group` is a ProcessGroup or None (the default group); a DeviceMesh resolves
    to its group here (collective for an n-d sub-mesh, see `mesh_group`).
    """
    if global_shape is None:
        raise UsageError(
            "from_local_blocks needs global_shape: a rank knows only its own blocks; "
            "ShardedTensor.from_local_shards infers it collectively"
        )
    try:
        shape = tuple(operator.index(s) for s in global_shape)
        shards, offsets = list(shards), list(offsets)
    except TypeError:
        raise InvalidTypeError(
            f"from_local_blocks takes sequences of shards and offsets and a global_shape of "
            f"ints, got {type(shards).__name__}, {type(offsets).__name__}, {global_shape!r}"
        ) from None
    problem, pairs = _check_local(shards, offsets, contiguous=False)
    if problem is not None:
        raise problem
    own = [Block(o, s) for o, s in pairs]
    for i, block in enumerate(own):
        if block.ndim != len(shape) or any(e > n for e, n in zip(block.ends, shape)):
            raise LayoutError(
                f"shard {i} {block} does not lie inside the global shape {shape}; "
                f"pass the offsets and global_shape of the whole tensor"
            )
    mesh = None
    if group is not None:
        group, mesh = resolve_group(group)
    rank = 0
    if dist.is_available() and dist.is_initialized():
        rank = dist.get_rank(group)
        if rank < 0:
            raise LayoutError(
                f"rank {dist.get_rank()} is not in the group {group}; only its ranks hold blocks"
            )
    if shards:
        dtype, device = shards[0].dtype, shards[0].device
    else:
        dtype = dtype if dtype is not None else torch.get_default_dtype()
        device = torch.device(device) if device is not None else torch.device("cpu")
    learn = functools.partial(_learn, group=group, dtype=dtype, device=device)
    return ShardedTensor(
        PendingLayout(shape, rank, own, learn),
        shards,
        rank,
        dtype=dtype,
        device=device,
        group=group,
        requires_grad=any(s.requires_grad for s in shards),
        mesh=mesh,
    )


def _learn(
    pending: PendingLayout, *, group: Any, dtype: torch.dtype, device: torch.device
) -> Layout:
    """`from_local_shards`' exchange and checks over `pending`'s own blocks, with
    stand-ins of their shape, dtype and device (an expanded scalar: no memory)."""
    if group is None and not (dist.is_available() and dist.is_initialized()):
        raise UsageError(
            "learning the layout of a tensor built with from_local_blocks needs a process "
            "group (every rank's blocks are exchanged): call init_process_group first"
        )
    problem = None
    rank = dist.get_rank(group)
    if rank != pending._rank:
        problem = UsageError(
            f"this tensor was built as rank {pending._rank} of its group but this process is "
            f"rank {rank}; build it after init_process_group"
        )
    # A rank holding nothing has no shard to show its dtype in the exchange below: the
    # ranks agree on dtype and device type first (fixed-size), so a mismatch raises on all.
    kinds = exchange(problem, (str(dtype), device.type), group)
    require_same(
        kinds,
        "the dtype and device type of a tensor built by from_local_blocks",
        fix="a rank holding no block must pass dtype= and device= to from_local_blocks",
    )
    own = pending.blocks_of(pending._rank)
    stand_ins = [torch.zeros((), dtype=dtype, device=device).expand(b.sizes) for b in own]
    offsets = [b.offsets for b in own]
    out = from_local_shards_checked(
        stand_ins, offsets, pending.global_shape, group, contiguous=False
    )
    return out._layout


def _bounding_shape(blocks: dict[int, list[Block]]) -> tuple[int, ...]:
    every = [b for bs in blocks.values() for b in bs]
    if not every:
        raise LayoutError(
            "no rank holds a shard, so the global shape cannot be inferred; pass global_shape"
        )
    ndims = {b.ndim for b in every}
    if len(ndims) > 1:
        raise LayoutError(f"ranks hold shards of different ndim {sorted(ndims)} (ndim)")
    return tuple(max(b.ends[d] for b in every) for d in range(every[0].ndim))


def _default_device(device_type: str) -> torch.device:
    """The device this rank would use for `device_type` (its current CUDA device)."""
    if device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(device_type)
