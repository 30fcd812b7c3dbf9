"""Async-save staging: blocking part of the 2nd call, stock DCP vs shardwise.

Run: `.venv/bin/python benchmarks/bench_staging.py [--repeat 3] [--dir /dev/shm]`.
On 2 local ranks (gloo), for each case:

* large: 8 ShardedTensors totalling `--size` (default 256MiB) per rank;
* small: `--small` (default 10,000) ShardedTensors of 4 KiB per rank;

it times, as `benchmarks/bench_checkpoint.py` does, the blocking part of the
2nd (and later) call of stock `dcp.async_save` and of `swc.async_save` (the
slowest rank's time, best of `--repeat`), `Stager.stage` alone (a stager of
its own, warmed by one call, `Stager(threads=--threads)`), and a bare `copy_`
of every local tensor into warm buffers: the memory-bandwidth floor of any
snapshot. Ratios > 1 mean shardwise blocks for less time.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the modules beside this file

import checkpoint_cases as cases  # noqa: E402

from shardwise.cli.sizes import parse_size  # noqa: E402


def _state(rank: int, world: int, case: str, nbytes: int, count: int) -> dict:
    import shardwise as sw

    if case == "large":
        n, rows = 8, 1024
        cols = max(1, nbytes * world // 4 // n // rows)  # nbytes per rank
    else:
        n, rows, cols = count, 8 * world, 128  # 4 KiB of fp32 per rank
    state = {}
    for i in range(n):
        layout = sw.Layout.chunked((rows, cols), 0, world)
        state[f"t{i}"] = sw.ShardedTensor.from_layout(
            layout, [torch.full(b.sizes, float(i + rank)) for b in layout.blocks_of(rank)]
        )
    return state


def _rank(
    rank: int,
    world: int,
    folder: str,
    case: str,
    nbytes: int,
    count: int,
    repeat: int,
    threads: int | None,
) -> dict:
    import torch.distributed.checkpoint as dcp

    import shardwise.checkpoint as swc
    from shardwise.checkpoint.engine.staging import Stager

    torch.set_num_threads(1)  # as bench_checkpoint: 2 ranks share the cores
    base = Path(folder)
    state = _state(rank, world, case, nbytes, count)
    out: dict[str, float] = {
        "MiB per rank": sum(s.nbytes for v in state.values() for s in v.local_shards()) / 2**20
    }

    def blocking_part(path: Path, start_save) -> float:
        cases.clean(path)
        dist.barrier()
        t = time.perf_counter()
        future = start_save()
        blocking = time.perf_counter() - t
        future.result()
        return blocking

    stock, ours = base / "stock", base / "ours"
    for name, path, start_save in (
        ("stock", stock, lambda: dcp.async_save(state, checkpoint_id=stock)),
        ("shardwise", ours, lambda: swc.async_save(state, ours)),
    ):
        blocking_part(path, start_save)  # the first call warms caches and staging buffers
        samples = [blocking_part(path, start_save) for _ in range(repeat)]
        out[name] = cases.max_over_ranks(min(samples))[0]
        cases.clean(path)

    stager = Stager() if threads is None else Stager(threads=threads)
    stager.release(stager.stage(state))  # allocates the buffers
    sources = [s for v in state.values() for s in v.local_shards()]
    buffers = [s.clone() for s in sources]

    def bare_copy() -> None:  # the floor: one copy_ per tensor into warm buffers
        for b, s in zip(buffers, sources):
            b.copy_(s)

    def stage() -> None:
        stager.release(stager.stage(state))

    for name, fn in (("stage", stage), ("bare copy", bare_copy)):
        samples = []
        for _ in range(repeat):
            dist.barrier()
            t = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - t)
        out[name] = cases.max_over_ranks(min(samples))[0]
    return out


def main() -> None:
    from shardwise.testing import run_ranks

    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--size", default="256MiB", help="large case: bytes per rank")
    parser.add_argument("--small", type=int, default=10_000, help="small case: count of 4 KiB")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--dir", default="/dev/shm" if Path("/dev/shm").is_dir() else None)
    parser.add_argument("--cases", nargs="+", default=["large", "small"])
    parser.add_argument(
        "--threads", type=int, default=None, help="Stager(threads=) for the stage-alone time"
    )
    args = parser.parse_args()
    nbytes = parse_size(args.size)
    print(f"torch {torch.__version__}, 2 gloo ranks, best of {args.repeat}, target {args.dir}")
    print(
        f"{'case':8}{'MiB/rank':>10}{'stock blocking':>16}{'shardwise':>11}{'ratio':>8}"
        f"{'Stager.stage':>14}{'bare copy_':>12}"
    )
    for case in args.cases:
        folder = tempfile.mkdtemp(prefix="shardwise-bench-staging-", dir=args.dir)
        try:
            r = run_ranks(
                _rank, 2, folder, case, nbytes, args.small, args.repeat, args.threads, timeout=1200
            )[0]
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        print(
            f"{case:8}{r['MiB per rank']:10.1f}{r['stock'] * 1e3:13.1f} ms"
            f"{r['shardwise'] * 1e3:8.1f} ms{r['stock'] / r['shardwise']:7.1f}x"
            f"{r['stage'] * 1e3:11.1f} ms{r['bare copy'] * 1e3:9.1f} ms"
        )
        sys.stdout.flush()


if __name__ == "__main__":
    main()
