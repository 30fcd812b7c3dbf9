"""Move bytes along a `plan_transfers` plan: local copies, then one all_to_all.

Every rank computes the same plan from the two layouts (pure, cached), so no
metadata is exchanged: each rank packs what it sends into one buffer ordered
by destination rank, calls `all_to_all_single` once, and unpacks what it
receives straight into its destination shards. Elements the rank already
holds are copied locally and never touch the network. Bytes travel as uint8
so any dtype (bool, complex, float8) works on any backend.
"""

from __future__ import annotations

from functools import lru_cache
import torch
import torch.distributed as dist

from ..errors import LayoutError
from ..layout import Layout, Transfer, plan_transfers
from ..tensor import ShardedTensor

__all__ = ["move", "cached_plan"]


@lru_cache(maxsize=128)
def cached_plan(src: Layout, dst: Layout) -> tuple[Transfer, ...]:
    """Plans are pure functions of two layouts; training loops repeat them."""
    return tuple(plan_transfers(src, dst))


def _view(shard: torch.Tensor, block_offsets: tuple[int, ...], t: Transfer) -> torch.Tensor:
    region = t.region
    return shard[tuple(slice(o - b, o - b + s) for o, b, s in zip(region.offsets, block_offsets, region.sizes))]


def move(
    st: ShardedTensor, dst: Layout, stats: dict[str, int] | None = None
) -> list[torch.Tensor]:
    """This rank's shards of `dst`, filled from `st`. Collective over `st.group`.

    `stats`, when given, receives `bytes_sent` and `bytes_received` as
    actually handed to the collective.
    """
    src = st.layout_spec
    if src.global_shape != dst.global_shape:
        raise LayoutError(
            f"cannot redistribute global shape {src.global_shape} to {dst.global_shape}"
        )
    if dst.world_size != src.world_size:
        raise LayoutError(
            f"the new layout spans {dst.world_size} ranks but the tensor's group has "
            f"{src.world_size}"
        )
    me, world = st.rank, src.world_size
    src_blocks, dst_blocks = src.blocks_of(me), dst.blocks_of(me)
    shards = st.local_shards()
    out = [torch.empty(b.sizes, dtype=st.dtype, device=st.device) for b in dst_blocks]
    sends: list[list[Transfer]] = [[] for _ in range(world)]
    recvs: list[list[Transfer]] = [[] for _ in range(world)]
    plan = cached_plan(src, dst)
    remote = False
    for t in plan:
        if t.src_rank == me and t.dst_rank == me:
            target = _view(out[t.dst_block_index], dst_blocks[t.dst_block_index].offsets, t)
            target.copy_(_view(shards[t.src_block_index], src_blocks[t.src_block_index].offsets, t))
        elif t.src_rank != t.dst_rank:
            remote = True
            if t.src_rank == me:
                sends[t.dst_rank].append(t)
            elif t.dst_rank == me:
                recvs[t.src_rank].append(t)
    sent = received = 0
    if remote:  # every rank sees the same plan, so all agree on calling the collective
        send_counts = [sum(t.region.numel for t in ts) for ts in sends]
        recv_counts = [sum(t.region.numel for t in ts) for ts in recvs]
        send_buf = torch.empty(sum(send_counts), dtype=st.dtype, device=st.device)
        offset = 0
        for ts in sends:
            for t in ts:
                n = t.region.numel
                piece = _view(shards[t.src_block_index], src_blocks[t.src_block_index].offsets, t)
                send_buf[offset : offset + n].view(t.region.sizes).copy_(piece)
                offset += n
        recv_buf = torch.empty(sum(recv_counts), dtype=st.dtype, device=st.device)
        size = st.element_size()
        dist.all_to_all_single(
            recv_buf.view(torch.uint8),
            send_buf.view(torch.uint8),
            [c * size for c in recv_counts],
            [c * size for c in send_counts],
            group=st.group,
        )
        offset = 0
        for ts in recvs:
            for t in ts:
                n = t.region.numel
                target = _view(out[t.dst_block_index], dst_blocks[t.dst_block_index].offsets, t)
                target.copy_(recv_buf[offset : offset + n].view(t.region.sizes))
                offset += n
        sent, received = send_buf.numel() * size, recv_buf.numel() * size
    if stats is not None:
        stats["bytes_sent"] = sent
        stats["bytes_received"] = received
    return out

