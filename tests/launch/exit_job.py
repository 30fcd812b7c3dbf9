"""A training script's checkpoint calls as users write them, ending without
`destroy_process_group()`: a save, an async save awaited, a load, and an async save
still in flight when the script ends. Run by `test_exit.py`.

`python exit_job.py RUNS RANKS FOLDER` imports torch and shardwise once, then for
each run forks one process per rank with the environment `torchrun` gives its
workers; each rank runs `main` and leaves through the interpreter's normal exit
(`sys.exit` up to this module's top level: thread shutdown, atexit, finalization),
as a script does. Prints one line per run: the ranks' wait statuses (0: exit 0;
an abort is its signal, 6)."""

from __future__ import annotations

import gc
import os
import socket
import sys
import time

import torch
import torch.distributed as dist

import shardwise as sw
import shardwise.checkpoint as swc


def main(path: str) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    layout = sw.Layout.chunked((64, 8), 0, world)
    shards = [torch.full(tuple(b.sizes), float(rank)) for b in layout.blocks_of(rank)]
    state = {
        "w": sw.ShardedTensor.from_layout(layout, shards, rank=rank),
        "b": torch.ones(8),
        "step": 3,
    }
    swc.save(state, f"{path}/a")
    swc.async_save(state, f"{path}/b", staging="background").result()
    swc.load(state, f"{path}/a")
    swc.async_save(state, f"{path}/c")  # still writing when the script ends
    print(f"rank {rank} done", flush=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(path: str, ranks: int, timeout: float) -> list[int | None] | None:
    """Fork the ranks of one run; in the parent, their wait statuses (None: killed at
    the deadline). In a child: None, once `main` returned."""
    port = str(_free_port())
    children = []
    for r in range(ranks):
        pid = os.fork()
        if pid == 0:
            os.environ.update(
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=port,
                WORLD_SIZE=str(ranks),
                LOCAL_WORLD_SIZE=str(ranks),
                RANK=str(r),
                LOCAL_RANK=str(r),
            )
            main(path)
            return None
        children.append(pid)
    deadline = time.monotonic() + timeout
    statuses: dict[int, int | None] = {}
    while len(statuses) < ranks and time.monotonic() < deadline:
        for pid in children:
            if pid not in statuses:
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    statuses[pid] = status
        time.sleep(0.05)
    for pid in children:
        if pid not in statuses:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            statuses[pid] = None
    return [statuses[pid] for pid in children]


if __name__ == "__main__":
    runs, ranks, folder = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    # what was imported stays out of the children's collections: their exit does not
    # walk (and copy) the parent's objects, so a run takes seconds, not ten
    gc.freeze()
    for run in range(runs):
        statuses = _run(f"{folder}/run{run}", ranks, timeout=120)
        if statuses is None:
            sys.exit(0)  # a rank: the interpreter's normal exit, as a script's
        print(f"run {run}: {statuses}", flush=True)
