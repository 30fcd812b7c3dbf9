"""Run a function on N real ranks (processes, gloo on 127.0.0.1) with a hard timeout::

    from shardwise.testing import run_ranks

    def body(rank: int, world_size: int, x: int) -> int:   # module level: picklable
        ...                                                 # torch.distributed is initialised
        return rank * x

    assert run_ranks(body, 3, 10) == [0, 10, 20]

Each rank runs in a fresh process from a forkserver that has already imported
torch, so starting ranks costs milliseconds, not seconds. A rank that raises
has its exception re-raised in the caller (`RanksFailed`, listing every
rank's error); a rank that hangs past `timeout` gets every rank killed and
`TimeoutError` raised, so a deadlock fails a test instead of eating CI.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import socket
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch

from .errors import RankFailureError, RankTimeoutError, ShardwiseError

__all__ = [
    "RankFailure",
    "RanksFailed",
    "free_port",
    "seconds_across_ranks",
    "run_ranks",
    "shard_of",
]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RankFailure(ShardwiseError):
    """Stands in for a rank's exception that could not be pickled back."""


class RanksFailed(RankFailureError):
    """One or more ranks raised; `errors` maps rank to its exception."""

    def __init__(self, errors: dict[int, BaseException], tracebacks: dict[int, str]) -> None:
        self.errors = errors
        self.tracebacks = tracebacks
        lines = [f"rank {r}: {type(e).__name__}: {e}" for r, e in sorted(errors.items())]
        detail = "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(tracebacks.items()))
        super().__init__("; ".join(lines) + "\n" + detail)


def _context() -> mp.context.ForkServerContext:
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "shardwise"])
    return ctx


def _rank_main(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    port: int,
    backend: str,
    pg_timeout: float,
    args: tuple,
    results: Any,
) -> None:
    import torch.distributed as dist

    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    os.environ["SHARDWISE_RANK"] = str(rank)  # lets failpoints target one rank
    torch.set_num_threads(1)  # N ranks share this machine's cores
    try:
        if "nccl" in backend:  # one GPU per rank, as torchrun's LOCAL_RANK would pick
            torch.cuda.set_device(rank)
        dist.init_process_group(
            backend,
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=pg_timeout),
        )
        value = fn(rank, world_size, *args)
        outcome: tuple[str, Any, str] = ("ok", value, "")
    except BaseException as e:  # report everything, even SystemExit, to the parent
        outcome = ("error", e, traceback.format_exc())
    try:
        payload = pickle.dumps(outcome)
    except Exception:
        kind, value, tb = outcome
        stand_in = RankFailure(f"{type(value).__name__}: {value}")
        payload = pickle.dumps((kind, stand_in, tb))
    results.put((rank, payload))
    if dist.is_initialized():
        dist.destroy_process_group()


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 60.0,
    backend: str = "gloo",
    return_exceptions: bool = False,
    allow_dead: bool = False,
) -> list[Any]:
    """Call `fn(rank, world_size, *args)` on `world_size` processes; return the results by rank.

    `fn` must be picklable (a module-level function). With
    `return_exceptions=True` a rank's exception is returned in its slot
    instead of raising `RanksFailed`. With `allow_dead=True` a rank that dies
    without reporting (killed, `os._exit`) gets a `RankFailure` in its slot
    while the others are still waited for. The process group's own timeout is
    set a little below `timeout`, so a stuck collective raises inside the
    ranks first; anything still alive at `timeout` is killed. `backend` is any
    `init_process_group` backend; with NCCL each rank uses GPU `rank`.
    """
    ctx = _context()
    results = ctx.Queue()
    port = free_port()
    pg_timeout = max(timeout - 5.0, timeout * 0.8)
    procs = [
        ctx.Process(
            target=_rank_main,
            args=(fn, rank, world_size, port, backend, pg_timeout, args, results),
            daemon=True,
        )
        for rank in range(world_size)
    ]
    for p in procs:
        p.start()
    outcomes: dict[int, tuple[str, Any, str]] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(outcomes) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                missing = sorted(set(range(world_size)) - set(outcomes))
                raise RankTimeoutError(
                    f"ranks {missing} of {world_size} did not finish within {timeout:.0f}s "
                    f"(a hang or deadlock); all ranks were killed"
                )
            try:
                rank, payload = results.get(timeout=min(remaining, 0.5))
                outcomes[rank] = pickle.loads(payload)
            except queue.Empty:
                dead = [
                    r
                    for r, p in enumerate(procs)
                    if r not in outcomes and p.exitcode is not None and results.empty()
                ]
                if dead:
                    time.sleep(0.2)  # a result may still be in flight
                    if results.empty():
                        if not allow_dead:
                            raise RankFailureError(
                                f"ranks {dead} exited (codes "
                                f"{[procs[r].exitcode for r in dead]}) without reporting a result"
                            ) from None
                        for r in dead:
                            failure = RankFailure(f"rank {r} died (exit code {procs[r].exitcode})")
                            outcomes[r] = ("error", failure, "")
    finally:
        grace = time.monotonic() + (5.0 if len(outcomes) == world_size else 0.0)
        for p in procs:
            p.join(timeout=max(0.0, grace - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join()
    errors = {r: o[1] for r, o in outcomes.items() if o[0] == "error"}
    if errors and not (return_exceptions or allow_dead):
        raise RanksFailed(errors, {r: outcomes[r][2] for r in errors})
    return [outcomes[r][1] for r in range(world_size)]


def shard_of(full: torch.Tensor, layout: Any, rank: int) -> list[torch.Tensor]:
    """This rank's shards of `full` under `layout`: contiguous copies, block order."""
    return [full[b.slices()].clone() for b in layout.blocks_of(rank)]


def seconds_across_ranks(
    fn: Callable[[], Any],
    repeat: int,
    *,
    before: Callable[[], Any] | None = None,
    warmup: bool = True,
    pick: Callable[[list[float]], float] | None = None,
) -> float:
    """`pick` (default: the median) of `repeat` runs of the slowest rank's time for
    `fn()`. Collective.

    One warm-up run first (unless `warmup=False`); `before()` runs untimed ahead
    of each run (e.g. clearing a folder); ranks start each run together (a
    barrier), so a collective operation is timed as the job sees it.
    """
    import statistics

    import torch.distributed as dist

    if warmup:
        fn()
    # an NCCL-only group reduces CUDA tensors; any group with a CPU backend, CPU ones
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    times = []
    for _ in range(repeat):
        if before is not None:
            before()
        dist.barrier()
        start = time.perf_counter()
        fn()
        elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64, device=device)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        times.append(float(elapsed))
    return (pick or statistics.median)(times)
