"""Save a sharded state to S3 on 2 ranks, load it on 3 ranks in other layouts.

    export AWS_ACCESS_KEY_ID=... AWS_SECRET_ACCESS_KEY=... AWS_DEFAULT_REGION=us-east-1
    torchrun --nproc-per-node 2 examples/s3.py save --url s3://my-bucket/run1/step_100
    torchrun --nproc-per-node 3 examples/s3.py load --url s3://my-bucket/run1/step_100

    # a local S3-compatible server (MinIO, moto, ...): the bucket must exist
    torchrun --nproc-per-node 2 examples/s3.py save --url s3://my-bucket/ckpt \\
        --endpoint-url http://127.0.0.1:9000

Credentials and region come from the environment as boto finds them (`AWS_*` variables,
`~/.aws`, an instance role); `--endpoint-url` goes to s3fs as `storage_options`. Any
fsspec URL works the same (`gs://`, `memory://`, ...) with its backend installed.

`save`: an embedding table split row-wise in uneven parts, a projection split
column-wise, a bias every rank holds whole (written once) and a step counter, with
`swc.save(state, url, storage_options=...)`. Each rank uploads its own pieces; the
checkpoint is committed (its records written last) only once every upload completed.

`load`: on any number of ranks, the table column-wise and the projection row-wise:
`swc.load` fetches only the byte ranges each rank's pieces need (ranged GETs). Every
element is checked against the values the save wrote (a function of its global index),
and the bytes each rank fetched are printed beside the bytes its pieces hold.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

import torch
import torch.distributed as dist

import shardwise.checkpoint as swc
from shardwise import Block, Layout, ShardedTensor


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("phase", choices=("save", "load"))
    p.add_argument("--url", required=True, help="where the checkpoint goes: s3://bucket/prefix")
    p.add_argument("--endpoint-url", default=None, help="an S3-compatible server's URL")
    p.add_argument("--rows", type=int, default=4096, help="rows of the embedding table")
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--overwrite", action="store_true", help="replace a checkpoint there")
    p.add_argument("--cuda", action="store_true", help="NCCL and one GPU per rank")
    return p.parse_args()


def uneven(n: int, parts: int) -> list[int]:
    """`n` split in `parts` sizes growing with the rank (1 : 2 : 3 ...), summing to `n`."""
    total = parts * (parts + 1) // 2
    sizes = [n * (r + 1) // total for r in range(parts)]
    sizes[-1] += n - sum(sizes)
    return sizes


def values(key: str, block: Block, shape: tuple[int, ...]) -> torch.Tensor:
    """The elements of `block` of tensor `key`: a function of each element's global index,
    so any rank computes any block's values alone."""
    index = torch.zeros((), dtype=torch.float64)
    stride = 1
    for d in reversed(range(len(shape))):
        along = torch.arange(block.offsets[d], block.offsets[d] + block.sizes[d])
        index = index + along.reshape([-1] + [1] * (len(shape) - 1 - d)).double() * stride
        stride *= shape[d]
    return torch.sin(index * 0.001 + len(key)).float().expand(block.sizes).contiguous()


def layouts(phase: str, rows: int, dim: int, world: int) -> dict[str, Layout]:
    if phase == "save":
        return {
            "emb": Layout.row_wise((rows, dim), uneven(rows, world)),
            "proj": Layout.column_wise((dim, dim), uneven(dim, world)),
        }
    return {
        "emb": Layout.column_wise((rows, dim), uneven(dim, world)),
        "proj": Layout.row_wise((dim, dim), uneven(dim, world)),
    }


def build(phase: str, args: argparse.Namespace, rank: int, world: int, device: Any) -> dict:
    """The state of this rank: the right values to save, zeros to load into."""
    state: dict[str, Any] = {}
    for key, layout in layouts(phase, args.rows, args.dim, world).items():
        blocks = layout.blocks_of(rank)
        shards = [values(key, b, layout.global_shape) for b in blocks]
        if phase == "load":
            shards = [torch.zeros_like(s) for s in shards]
        state[key] = ShardedTensor.from_layout(
            layout, [s.to(device) for s in shards], dtype=torch.float32, device=device
        )
    bias = values("bias", Block((0,), (args.dim,)), (args.dim,))
    state["bias"] = (bias if phase == "save" else torch.zeros_like(bias)).to(device)
    state["step"] = 100 if phase == "save" else 0
    return state


def wrong_elements(state: dict[str, Any]) -> int:
    """Elements of this rank's pieces that differ from what the save wrote."""
    wrong = 0
    for key in ("emb", "proj"):
        st = state[key]
        for block, shard in zip(st.local_blocks, st.local_shards()):
            want = values(key, block, st.layout_spec.global_shape)
            wrong += int((shard.cpu() != want).sum())
    bias = state["bias"].cpu()
    wrong += int((bias != values("bias", Block((0,), tuple(bias.shape)), bias.shape)).sum())
    return wrong + (state["step"] != 100)


def main() -> int:
    args = parse_args()
    cuda = args.cuda and torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else "cpu"
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    options = {"endpoint_url": args.endpoint_url} if args.endpoint_url else None
    state = build(args.phase, args, rank, world, device)
    local = sum(s.nbytes for k in ("emb", "proj") for s in state[k].local_shards())
    status = 0

    if args.phase == "save":
        info = swc.save(state, args.url, storage_options=options, overwrite=args.overwrite)
        if rank == 0:
            print(f"saved on {world} ranks to {info.path} in {info.seconds:.2f} s", flush=True)
    else:
        info = swc.load(state, args.url, storage_options=options)
        counts = torch.tensor([wrong_elements(state), info.bytes_read, local], dtype=torch.int64)
        everyone = [torch.zeros_like(counts) for _ in range(world)]
        dist.all_gather(everyone, counts)
        if rank == 0:
            print(f"loaded on {world} ranks from {info.path}", flush=True)
            for r, (_, read, held) in enumerate(t.tolist() for t in everyone):
                print(f"  rank {r}: fetched {read} bytes for pieces of {held} bytes", flush=True)
            wrong = sum(int(t[0]) for t in everyone)
            ok = wrong == 0
            print(
                f"{'PASS' if ok else 'FAIL'}: every element of emb, proj and bias, and the "
                f"step, as saved ({wrong} wrong)",
                flush=True,
            )
            status = 0 if ok else 1
    dist.destroy_process_group()
    return status


if __name__ == "__main__":
    sys.exit(main())
