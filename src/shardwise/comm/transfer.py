"""Move bytes along a `plan_transfers` plan: one `all_to_all_single` round.

Every rank computes the same plan from the two layouts (pure, cached), so no
metadata is exchanged and all ranks agree on calling the collective. What a
rank sends goes into one buffer ordered by destination rank, what it receives
comes out of one ordered by source rank:

* when a rank exchanges with a single peer and the region is contiguous, the
  source shard itself is the send buffer, or the destination shard the
  receive buffer: no copy;
* otherwise regions are packed into (or unpacked from) a staging buffer kept
  between calls, so steady-state moves allocate nothing but their output (a
  move still in flight holds it; one that starts meanwhile takes another).

Elements the rank already holds are copied locally while the collective is in
flight. `post` returns before the messages have landed (`redistribute(...,
async_op=True)`): the caller waits with the `finish` it is handed. Bytes
travel as uint8, so any dtype works on any backend.
(Measured on gloo: one all_to_all_single beats batched isend/irecv of the
same bytes by about 1.5x.)
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from functools import lru_cache
from typing import Any

import torch

from ..errors import InvalidTypeError, LayoutError
from ..layout import Block, Layout, Transfer, plan_transfers
from ..tensor import ShardedTensor
from .agreement import exchange
from .communicator import Communicator, communicator

__all__ = ["agree", "cached_plan", "clear_staging_buffers", "move", "post"]

# One buffer per device and communicator: moves on different groups may overlap.
_STAGING: dict[tuple[torch.device, Hashable], torch.Tensor] = {}


@lru_cache(maxsize=128)
def cached_plan(src: Layout, dst: Layout) -> tuple[Transfer, ...]:
    """Plans are pure functions of two layouts; training loops repeat them."""
    return tuple(plan_transfers(src, dst))


def clear_staging_buffers() -> None:
    """Free the staging memory `move` keeps between calls (it regrows on demand)."""
    _STAGING.clear()


def _staging(nbytes: int, device: torch.device, comm: Communicator) -> torch.Tensor:
    """A staging buffer of at least `nbytes`, checked out: the shared one when no move
    in flight holds it, else a new one. `_give_back` returns it when the move lands."""
    buf = _STAGING.pop((device, comm.key), None)
    if buf is None or buf.numel() < nbytes:
        buf = torch.empty(nbytes, dtype=torch.uint8, device=device)
    return buf


def _give_back(buf: torch.Tensor, device: torch.device, comm: Communicator) -> None:
    """Keep the larger of `buf` and the buffer kept now, for the next move."""
    kept = _STAGING.get((device, comm.key))
    if kept is None or kept.numel() < buf.numel():
        _STAGING[(device, comm.key)] = buf


def _region(shard: torch.Tensor, block: Block, t: Transfer) -> torch.Tensor:
    """The view of `shard` (holding `block`) covering `t.region`."""
    return shard[t.region.relative_to(block).slices()]


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def _empty_bytes(device: torch.device) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=device)


def _check(st: ShardedTensor, dst: Any, what: str) -> BaseException | None:
    """This rank's problem with moving `st` to `dst`, if any (no communication)."""
    src = st.layout_spec
    if not isinstance(dst, Layout):
        return InvalidTypeError(f"{what} needs a shardwise.Layout, got {type(dst).__name__}")
    if src.global_shape != dst.global_shape:
        return LayoutError(f"cannot {what} global shape {src.global_shape} to {dst.global_shape}")
    group_size = communicator(st.group).world_size
    if dst.world_size != group_size or src.world_size != group_size:
        return LayoutError(
            f"layouts span {src.world_size} and {dst.world_size} ranks but the group has "
            f"{group_size}"
        )
    return None


def agree(st: ShardedTensor, dst: Any, what: str, extra: Any = None) -> None:
    """Collective: every rank checks its arguments, then all compare fingerprints of
    (source layout, target layout, `extra`); any problem raises on every rank.

    Without this, one rank passing another layout would post mismatched
    messages and hang the others.
    """
    problem = _check(st, dst, what)
    fingerprint = None if problem else (hash(st.layout_spec), hash(dst), st.dtype, extra)
    everyone = exchange(problem, fingerprint, st.group)
    if len(set(everyone)) > 1:
        odd = [r for r, f in enumerate(everyone) if f != everyone[0]]
        raise LayoutError(
            f"ranks disagree on {what}: ranks {odd} passed a different source layout, target "
            f"layout, dtype or argument than rank 0; every rank must pass the same"
        )


def move(
    st: ShardedTensor, dst: Layout, stats: dict[str, int] | None = None, *, checked: bool = False
) -> list[torch.Tensor]:
    """This rank's shards of `dst`, filled from `st`. Collective over `st.group`.

    Unless `checked` (the caller already ran `agree`), the ranks first agree on
    the layouts. `stats`, when given, receives `bytes_sent` and
    `bytes_received`: what this rank actually handed to the network.
    """
    out, finish = post(st, dst, stats, checked=checked)
    finish()
    return out


def post(
    st: ShardedTensor,
    dst: Layout,
    stats: dict[str, int] | None = None,
    *,
    checked: bool = False,
) -> tuple[list[torch.Tensor], Callable[[], None]]:
    """`move`, split where it waits: this rank's shards of `dst` (allocated, their local
    elements copied, the remote ones on the way) and `finish()`, which waits for the
    messages and unpacks them. Collective over `st.group`; the ranks may `finish`
    in any order. Another move may start before `finish`: the staging buffer is
    checked out until then. The source shards may be sent as they are, so they must
    not be written before `finish` (as for DTensor's `async_op`)."""
    if not checked:
        agree(st, dst, "redistribute")
    src = st.layout_spec
    me = st.rank
    src_blocks, dst_blocks = src.blocks_of(me), dst.blocks_of(me)
    shards = st._shards
    out = [torch.empty(b.sizes, dtype=st.dtype, device=st.device) for b in dst_blocks]
    local: list[Transfer] = []
    sends: dict[int, list[Transfer]] = {}
    recvs: dict[int, list[Transfer]] = {}
    for t in cached_plan(src, dst):
        if t.src_rank == me and t.dst_rank == me:
            local.append(t)
        elif t.src_rank == me:
            sends.setdefault(t.dst_rank, []).append(t)
        elif t.dst_rank == me:
            recvs.setdefault(t.src_rank, []).append(t)

    def src_view(t: Transfer) -> torch.Tensor:
        return _region(shards[t.src_block_index], src_blocks[t.src_block_index], t)

    def dst_view(t: Transfer) -> torch.Tensor:
        return _region(out[t.dst_block_index], dst_blocks[t.dst_block_index], t)

    size = st.element_size()
    world = src.world_size
    send_counts = [sum(t.region.numel for t in sends.get(r, ())) * size for r in range(world)]
    recv_counts = [sum(t.region.numel for t in recvs.get(r, ())) * size for r in range(world)]
    remote = any(t.src_rank != t.dst_rank for t in cached_plan(src, dst))

    def single(messages: dict[int, list[Transfer]], view: Any) -> torch.Tensor | None:
        """The one contiguous region this rank exchanges, usable as the buffer itself."""
        if len(messages) == 1:
            (ts,) = messages.values()
            if len(ts) == 1:
                region = view(ts[0])
                if region.is_contiguous():
                    return _as_bytes(region)
        return None

    send_buf = single(sends, src_view)
    recv_buf = single(recvs, dst_view)
    staged = (0 if send_buf is not None else sum(send_counts)) + (
        0 if recv_buf is not None else sum(recv_counts)
    )
    comm = communicator(st.group)
    held = _staging(staged, st.device, comm) if staged else None
    staging = held[:staged] if held is not None else None
    if send_buf is None:
        send_buf = staging[: sum(send_counts)] if staging is not None else _empty_bytes(st.device)
        offset = 0
        for peer in sorted(sends):
            for t in sends[peer]:
                k = t.region.numel * size
                send_buf[offset : offset + k].view(st.dtype).view(t.region.sizes).copy_(src_view(t))
                offset += k
    unpack = recv_buf is None
    if unpack:
        start = staged - sum(recv_counts)
        recv_buf = staging[start:] if staging is not None else _empty_bytes(st.device)
    assert recv_buf is not None and send_buf is not None  # both set on every path above
    work = None
    if remote:  # the plan is global, so every rank agrees on calling the collective
        work = comm.all_to_all_single(recv_buf, send_buf, recv_counts, send_counts)
    for t in local:  # overlaps with the collective in flight
        dst_view(t).copy_(src_view(t))
    if stats is not None:
        stats["bytes_sent"] = sum(send_counts)
        stats["bytes_received"] = sum(recv_counts)

    def finish() -> None:
        if work is not None:
            work.wait()
        if unpack:
            offset = 0
            for peer in sorted(recvs):
                for t in recvs[peer]:
                    k = t.region.numel * size
                    dst_view(t).copy_(
                        recv_buf[offset : offset + k].view(st.dtype).view(t.region.sizes)
                    )
                    offset += k
        if held is not None:
            _give_back(held, st.device, comm)

    return out, finish
