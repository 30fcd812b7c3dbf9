"""Train, checkpoint in the background, get preempted, resume on another world size.

    # 2 ranks, killed hard after step 7 (an async save may still be writing):
    torchrun --nproc-per-node 2 examples/train_resume.py --root /tmp/run --steps 12 --die-at-step 7
    # resume on 3 ranks from the latest committed step, train to step 12:
    torchrun --nproc-per-node 3 examples/train_resume.py --root /tmp/run --steps 12

The model: an embedding table split row-wise over the ranks (a `shardwise.ShardedTensor`
parameter; uneven rows when the world size does not divide the vocabulary) feeding a small
MLP that every rank holds whole. Every rank sees the whole batch (a deterministic function
of the step number), so the table is model-parallel and the MLP needs no gradient
all-reduce. Adam (`foreach=False`) steps the sharded table shard by shard.

Every `--save-every` steps `swc.CheckpointManager.save(step, state, async_=True)` returns
once the state is staged and commits in the background; the manager keeps the last
`--keep-last` committed steps. On start, `manager.restore` loads the latest committed step
(whatever world size saved it) into this job's layouts. `--die-at-step K` ends every rank
with `os._exit` right after step K (and its save, if K is a save step, has been started):
a preemption. At the end rank 0 prints `digest: <sha256>` of the whole parameters and
optimizer state, gathered: an uninterrupted run and a killed-and-resumed one print the same.

`--cuda` runs on one GPU per rank with NCCL (when CUDA is available); the default is the
CPU with gloo.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import shardwise.checkpoint as swc
from shardwise import Layout, ShardedTensor

DIED = 75  # the exit status of a simulated preemption


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--root", required=True, help="checkpoint root: a path or an fsspec URL")
    p.add_argument("--steps", type=int, default=12, help="train up to this step")
    p.add_argument("--save-every", type=int, default=3)
    p.add_argument("--keep-last", type=int, default=2)
    p.add_argument("--die-at-step", type=int, default=None, help="os._exit after this step")
    p.add_argument("--vocab", type=int, default=1000)
    p.add_argument("--dim", type=int, default=16)
    p.add_argument("--hidden", type=int, default=32)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--bag", type=int, default=4, help="ids per sample (mean-pooled)")
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cuda", action="store_true", help="NCCL and one GPU per rank")
    return p.parse_args()


class Model(nn.Module):
    """A row-wise sharded embedding table (this rank's rows only) and a replicated MLP."""

    def __init__(self, args: argparse.Namespace, device: torch.device) -> None:
        super().__init__()
        rank, world = dist.get_rank(), dist.get_world_size()
        layout = Layout.chunked((args.vocab, args.dim), 0, world)  # rows as torch.chunk
        # The same initial values whatever the world size: each rank keeps its rows of one
        # seeded table (a large model would draw its own rows instead).
        table = torch.randn(
            args.vocab, args.dim, generator=torch.Generator().manual_seed(args.seed)
        ).mul_(0.1)
        shards = [table[b.slices()].clone().to(device) for b in layout.blocks_of(rank)]
        self.emb = nn.Parameter(
            ShardedTensor.from_layout(layout, shards, dtype=table.dtype, device=device)
        )
        torch.manual_seed(args.seed + 1)  # the same MLP on every rank
        self.mlp = nn.Sequential(
            nn.Linear(args.dim, args.hidden), nn.ReLU(), nn.Linear(args.hidden, 1)
        ).to(device)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        looked_up = F.embedding(ids, self.emb)  # each rank looks up the ids in its rows
        pooled = looked_up.full_tensor().mean(1)  # [batch, dim], whole on every rank
        return self.mlp(pooled)


def batch(args: argparse.Namespace, step: int, device: torch.device) -> tuple[Any, Any]:
    """The batch of `step`: the same on every rank, in every run."""
    g = torch.Generator().manual_seed(args.seed * 1_000_003 + step)
    ids = torch.randint(0, args.vocab, (args.batch, args.bag), generator=g)
    target = torch.randn(args.batch, 1, generator=g)
    return ids.to(device), target.to(device)


def train_state(model: Model, opt: torch.optim.Optimizer, step: int) -> dict[str, Any]:
    """What a checkpoint holds. The tensors are the live ones: a load fills them in place."""
    return {"model": model.state_dict(), "optim": opt.state_dict(), "trainer": {"step": step}}


def whole(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor on every rank (collective for a ShardedTensor), on the CPU."""
    if isinstance(t, ShardedTensor):
        t = t.full_tensor()
    return t.detach().cpu()


def digest(model: Model, opt: torch.optim.Optimizer) -> str:
    """sha256 of every parameter and optimizer tensor, whole, by name. Collective."""
    names = {id(p): n for n, p in model.named_parameters()}
    tensors = {f"param/{n}": whole(p) for n, p in model.named_parameters()}
    for p, state in opt.state.items():
        for k, v in sorted(state.items()):
            tensors[f"optim/{names[id(p)]}/{k}"] = whole(v)
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        h.update(f"{name} {t.dtype} {tuple(t.shape)}\n".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def main() -> int:
    args = parse_args()
    cuda = args.cuda and torch.cuda.is_available()
    if cuda:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()

    def say(*words: Any) -> None:
        if rank == 0:
            print(*words, flush=True)

    model = Model(args, device)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr, foreach=False)
    swc.init_optimizer_state(opt)  # Adam's state, for the restore to fill

    manager = swc.CheckpointManager(args.root, keep_last=args.keep_last)
    restored = manager.restore(train_state(model, opt, 0), missing_ok=True)  # collective
    start = restored or 0
    say(f"{'resumed from step ' + str(restored) if restored else 'started fresh'} on {world} ranks")

    for step in range(start + 1, args.steps + 1):
        ids, target = batch(args, step, device)
        loss = F.mse_loss(model(ids), target)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        say(f"step {step} loss {loss.item():.6f}")
        if step % args.save_every == 0 or step == args.steps:
            # returns once staged (the previous save waited for first); commits meanwhile
            manager.save(step, train_state(model, opt, step), async_=True)
        if step == args.die_at_step:
            # one write of the whole line: the ranks share torchrun's unbuffered stdout, and
            # print() writes the text and its newline apart, so two ranks' lines could merge
            sys.stdout.write(f"rank {rank}: dying after step {step} (simulated preemption)\n")
            sys.stdout.flush()
            # every rank has said so before any exits: torchrun stops the others at the first
            # exit (the save in flight runs on its own group, so this barrier is the loop's)
            dist.barrier()
            os._exit(DIED)  # no cleanup, no waiting for the save in flight

    manager.wait_until_finished()  # the last save committed, retention done
    result = digest(model, opt)
    say(f"committed steps: {manager.steps()}")
    say(f"digest: {result}")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
